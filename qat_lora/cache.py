"""The KD cache (DESIGN §2): the teacher runs once; its targets are read thousands of times.

Build: rank r of W takes the sequences with index = r (mod W) of each split, runs the teacher in fixed-shape
batches, and hands the device results to a background writer that encodes (docs/cache-format.md), writes
each shard under a temporary name, renames it, and records it in `progress-r{r}.json`. `--resume` continues
after the last recorded shard, so a killed build ends byte-identical to an uninterrupted one. When every
rank is done, `merge` (automatic for one rank) writes the single `manifest.json` the reader needs.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from . import __version__, data, device as dev, models
from .encodings import SampledEncoding, TopKEncoding, make_encoding
from .files import atomic_write_json, sha256_file

SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
BASE_KEYS = ("input_ids", "attention_mask")


@dataclass
class CacheBuildConfig:
    teacher: str = field(default="", metadata={"help": "teacher: transformers folder, .gguf file or hub name"})
    data: list[str] = field(default_factory=list, metadata={"help": "text files or folders (.txt, .jsonl, datasets on disk)"})
    out: str = field(default="caches/kd", metadata={"help": "output folder"})
    seq_len: int = field(default=512, metadata={"help": "tokens per packed sequence"})
    encoding: str = field(default="topk", metadata={"help": "topk (top-K + tail) or sampled (RS-KD)"})
    top_k: int = field(default=64, metadata={"help": "topk: teacher log-probs kept per position"})
    value_bits: int = field(default=16, metadata={"help": "topk: 32 (exact), 16 or 8 bits per log-prob"})
    num_samples: int = field(default=50, metadata={"help": "sampled: draws per position"})
    max_tokens: int = field(default=1_000_000, metadata={"help": "token budget over both splits (0 = all)"})
    batch_size: int = field(default=8, metadata={"help": "sequences per teacher forward"})
    holdout_fraction: float = field(default=0.02, metadata={"help": "fraction of documents held out, by hash"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, xla or tpu"})
    text_field: str = field(default="text", metadata={"help": "text key of .jsonl records and datasets"})
    chat: bool = field(default=False, metadata={"help": "records hold `messages`: render them with the chat template"})
    shard_sequences: int = field(default=1024, metadata={"help": "sequences per shard file"})
    seed: int = field(default=0, metadata={"help": "sampled: seed of the draws"})
    rank: int = field(default=0, metadata={"help": "this builder's rank (builds sequences = rank mod world size)"})
    world_size: int = field(default=1, metadata={"help": "number of builders (torchrun: from RANK, WORLD_SIZE)"})
    resume: bool = field(default=False, metadata={"help": "continue an interrupted build in --out"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing cache in --out"})

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "shard_sequences", "world_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be positive")
        if self.max_tokens < 0:
            raise ValueError(f"--max-tokens {self.max_tokens}: must be >= 0 (0 = the whole corpus)")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"--rank {self.rank}: must be in [0, --world-size {self.world_size})")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite exclude each other")
        self.target_encoding()

    def target_encoding(self) -> TopKEncoding | SampledEncoding:
        if self.encoding == "topk":
            return TopKEncoding(self.top_k, self.value_bits)
        if self.encoding == "sampled":
            return SampledEncoding(self.num_samples)
        raise ValueError(f"--encoding {self.encoding!r}: choose topk or sampled")

    def fingerprint(self) -> str:
        """What must match for --resume to continue a build (everything but resume/overwrite/device)."""
        args = {k: v for k, v in asdict(self).items() if k not in ("resume", "overwrite", "device")}
        return hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()


def _row_seed(seed: int, split: str, row: int) -> int:
    digest = hashlib.sha256(f"{seed}/{split}/{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _stack_rows(rows: list[dict[str, np.ndarray]], ragged: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Rows -> shard tensors: fixed-shape keys stacked, ragged keys concatenated with `{key}_offsets`."""
    out = {}
    for key in rows[0]:
        if key in ragged:
            lengths = [len(r[key]) for r in rows]
            out[key] = np.concatenate([r[key] for r in rows])
            out[f"{key}_offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        else:
            out[key] = np.stack([r[key] for r in rows])
    return out


class _ShardWriter:
    """Background writer: packs rows, writes `name.tmp`, renames, records progress — in submission order."""

    def __init__(self, out: Path, encoding, vocab_size: int, progress_path: Path, progress: dict) -> None:
        self.out, self.encoding, self.vocab_size = out, encoding, vocab_size
        self.progress_path, self.progress = progress_path, progress
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.pending: list[Future] = []

    def submit(self, split: str, name: str, base: dict[str, np.ndarray], selected: list[dict], rows: list[int]) -> None:
        """Queue one shard; `rows` = [start, stop, step] of its global sequence indices."""
        while len(self.pending) >= 2:  # bound the memory held by queued shards
            self.pending.pop(0).result()
        self.pending.append(self.pool.submit(self._write, split, name, base, selected, rows))

    def _write(self, split: str, name: str, base: dict[str, np.ndarray], selected: list[dict], rows: list[int]) -> None:
        packed = [self.encoding.pack_row(s, self.vocab_size) for s in selected]
        arrays = {**base, **_stack_rows(packed, self.encoding.ragged_keys)}
        tmp = self.out / (name + ".tmp")
        save_file(arrays, str(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates 0600 files; caches are meant to be shared
        os.replace(tmp, self.out / name)
        self.progress["shards"][split].append({"file": name, "rows": rows, "bytes": (self.out / name).stat().st_size,
                                               "sha256": sha256_file(self.out / name)})
        atomic_write_json(self.progress_path, self.progress)

    def close(self) -> None:
        for future in self.pending:
            future.result()
        self.pool.shutdown()


def _load_progress(cfg: CacheBuildConfig, out: Path, path: Path) -> dict:
    fresh = {"fingerprint": cfg.fingerprint(), "rank": cfg.rank, "shards": {s: [] for s in data.SPLITS}}
    if not cfg.resume or not path.exists():
        return fresh
    progress = json.loads(path.read_text())
    if progress.get("fingerprint") != cfg.fingerprint():
        raise ValueError(f"--resume: {out} was built with other arguments; rerun with the same flags or --overwrite")
    for split in data.SPLITS:
        for shard in progress["shards"][split]:
            file = out / shard["file"]
            if not file.exists() or sha256_file(file) != shard["sha256"]:
                raise ValueError(f"--resume: shard {file} is missing or changed; rebuild with --overwrite")
    return progress


def _prepare_out(cfg: CacheBuildConfig) -> Path:
    out = Path(cfg.out)
    mine = f"-r{cfg.rank:03d}-"
    if (out / MANIFEST).exists() and not cfg.overwrite:
        raise ValueError(f"--out {out}: a cache already exists there; pass --overwrite or choose another folder")
    if not cfg.resume and any(mine in p.name for p in out.glob("*.safetensors")) and not cfg.overwrite:
        raise ValueError(f"--out {out}: holds an unfinished build of rank {cfg.rank}; pass --resume or --overwrite")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):
        stale.unlink()  # half-written files of a crashed build never carry a real name
    if cfg.overwrite:
        for old in [*out.glob("*.safetensors"), *out.glob("progress-r*.json"), *out.glob("manifest*.json")]:
            old.unlink()
    return out


def _tokenise(cfg: CacheBuildConfig, files: list[Path], tokenizer) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    docs = data.tokenized_documents(files, tokenizer, cfg.text_field, chat=cfg.chat)
    streams = data.split_token_streams(docs, tokenizer, cfg.holdout_fraction, cfg.max_tokens or None)
    if not streams["train"]:
        raise ValueError(f"--data {' '.join(cfg.data)}: no text found (empty corpus)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return {s: data.pack(streams[s], cfg.seq_len, pad_id=pad) for s in data.SPLITS}


def _load_teacher(cfg: CacheBuildConfig):
    tokenizer = models.load_tokenizer(cfg.teacher)
    teacher = models.load_causal_lm(cfg.teacher)
    limit = models.max_positions(teacher)
    if limit is not None and cfg.seq_len > limit:
        raise ValueError(f"--seq-len {cfg.seq_len}: longer than the teacher's context ({limit} positions)")
    if cfg.encoding == "topk" and cfg.top_k > models.vocab_size(teacher):
        raise ValueError(f"--top-k {cfg.top_k}: larger than the vocabulary ({models.vocab_size(teacher)})")
    return tokenizer, teacher


def build_cache(cfg: CacheBuildConfig, log: Callable[[str], None] = print) -> Path:
    """Run the teacher over this rank's sequences and write its shards; with one rank also the manifest.

    Returns the manifest path (one rank) or this rank's partial manifest (several ranks).
    Raises:
        ValueError: missing teacher or data, empty corpus, seq_len beyond the teacher's context, an existing
            cache without --overwrite, a --resume whose arguments differ from the interrupted build.
    """
    files = data.list_text_files(cfg.data)  # cheap checks first: a typo should not wait for the teacher
    tokenizer, teacher = _load_teacher(cfg)
    packed = _tokenise(cfg, files, tokenizer)
    out = _prepare_out(cfg)
    device = dev.resolve_device(cfg.device)
    if device.type == "cpu":
        dev.tune_host_allocator()
    teacher.to(device)
    encoding, vocab = cfg.target_encoding(), models.vocab_size(teacher)
    progress_path = out / f"progress-r{cfg.rank:03d}.json"
    progress = _load_progress(cfg, out, progress_path)
    writer = _ShardWriter(out, encoding, vocab, progress_path, progress)
    mine = {s: np.arange(cfg.rank, len(packed[s][0]), cfg.world_size) for s in data.SPLITS}
    done = {s: sum(len(range(*sh["rows"])) for sh in progress["shards"][s]) for s in data.SPLITS}
    total = sum(int(packed[s][1][mine[s]].sum()) for s in data.SPLITS)
    log(f"teacher {cfg.teacher} on {device}, rank {cfg.rank}/{cfg.world_size}: {total:,} tokens, "
        + ", ".join(f"{s} {len(mine[s])} x {cfg.seq_len}" for s in data.SPLITS)
        + (f", resuming after {sum(done.values())} sequences" if any(done.values()) else ""))
    started = time.perf_counter()
    with tqdm(total=total, unit="tok", unit_scale=True, desc="teacher") as bar:
        bar.update(sum(int(packed[s][1][mine[s][:done[s]]].sum()) for s in data.SPLITS))
        for split in data.SPLITS:
            _build_split(cfg, teacher, device, encoding, split, packed[split], mine[split], done[split], writer, bar)
    writer.close()
    elapsed = time.perf_counter() - started
    partial = {"rank": cfg.rank, "world_size": cfg.world_size, "shards": progress["shards"],
               "sequences": {s: len(packed[s][0]) for s in data.SPLITS},
               "tokens": {s: int(packed[s][1].sum()) for s in data.SPLITS},
               "header": _header(cfg, files, teacher, tokenizer, vocab, encoding),
               "seconds": round(elapsed, 2)}
    path = out / f"manifest-r{cfg.rank:03d}.json"
    atomic_write_json(path, partial)
    log(f"rank {cfg.rank}: shards written in {elapsed:.1f} s")
    return merge_manifests(out, log) if cfg.world_size == 1 else path


def _build_split(cfg, teacher, device, encoding, split: str, packed: tuple[np.ndarray, np.ndarray],
                 rows: np.ndarray, done: int, writer: _ShardWriter, bar: tqdm) -> None:
    input_ids, mask = packed
    for shard_start in range(done, len(rows), cfg.shard_sequences):
        shard_rows = rows[shard_start:shard_start + cfg.shard_sequences]
        selected: list[dict] = []
        for start in range(0, len(shard_rows), cfg.batch_size):
            batch_rows = shard_rows[start:start + cfg.batch_size]
            ids = np.zeros((cfg.batch_size, cfg.seq_len), dtype=np.int64)  # fixed shape: pad the last batch
            ids[:len(batch_rows)] = input_ids[batch_rows]
            with torch.no_grad():
                logits = teacher(input_ids=torch.from_numpy(ids).to(device)).logits
            seeds = [_row_seed(cfg.seed, split, int(r)) for r in batch_rows]
            selected += encoding.select(logits[:len(batch_rows)], seeds)
            bar.update(int(mask[batch_rows].sum()))
        name = f"{split}-r{cfg.rank:03d}-{shard_start // cfg.shard_sequences:05d}.safetensors"
        base = {"input_ids": input_ids[shard_rows].astype(np.int32), "attention_mask": mask[shard_rows]}
        span = [int(shard_rows[0]), int(shard_rows[-1]) + cfg.world_size, cfg.world_size]  # range(*span)
        writer.submit(split, name, base, selected, span)


def _header(cfg: CacheBuildConfig, files: list[Path], teacher, tokenizer, vocab: int, encoding) -> dict:
    return {"schema_version": SCHEMA_VERSION, "teacher": models.model_fingerprint(teacher, cfg.teacher),
            "tokenizer_sha256": models.tokenizer_hash(tokenizer), "vocab_size": vocab, "seq_len": cfg.seq_len,
            "encoding": encoding.params(), "corpus_sha256": data.corpus_fingerprint(files),
            "builder": {"version": __version__, "args": {k: v for k, v in asdict(cfg).items()
                                                         if k not in ("rank", "resume", "overwrite")}}}


def merge_manifests(path: str | Path, log: Callable[[str], None] = print) -> Path:
    """Unite the ranks' partial manifests into `manifest.json`; every rank of the build must be done."""
    out = Path(path)
    partials = [json.loads(p.read_text()) for p in sorted(out.glob("manifest-r*.json"))]
    if not partials:
        raise ValueError(f"{out}: no manifest-r*.json; run build-cache first")
    world = partials[0]["world_size"]
    ranks = sorted(p["rank"] for p in partials)
    if ranks != list(range(world)):
        raise ValueError(f"{out}: ranks {ranks} finished, the build has {world}; finish the missing ranks first")
    headers = [json.dumps({k: v for k, v in p["header"].items() if k != "builder"}, sort_keys=True) for p in partials]
    if len(set(headers)) != 1:
        raise ValueError(f"{out}: the ranks' manifests disagree (teacher, tokenizer, encoding or corpus)")
    splits = {}
    for split in data.SPLITS:
        shards = [dict(sh, rank=p["rank"]) for p in partials for sh in p["shards"][split]]
        splits[split] = {"sequences": partials[0]["sequences"][split], "tokens": partials[0]["tokens"][split],
                         "shards": shards}
        if sum(len(range(*sh["rows"])) for sh in shards) != splits[split]["sequences"]:
            raise ValueError(f"{out}: the {split} shards do not cover its {splits[split]['sequences']} sequences")
    manifest = {**partials[0]["header"], "world_size": world, "splits": splits,
                "build_seconds": max(p["seconds"] for p in partials)}
    atomic_write_json(out / MANIFEST, manifest)
    log(f"wrote {out / MANIFEST}")
    return out / MANIFEST


class KDCache:
    """Read-only, memory-mapped view of a cache folder.

    `sequence(i, split)` decodes one sequence; `batches(...)` yields fixed-shape training batches for one
    rank in an order that is a pure function of (seed, epoch, rank, world_size), decoded ahead on a thread.
    """

    def __init__(self, path: str | Path, preload: bool = False) -> None:
        self.path = Path(path)
        if not (self.path / MANIFEST).exists():
            hint = "run `qat-lora cache merge`" if list(self.path.glob("manifest-r*.json")) else \
                "build one with `qat-lora build-cache`"
            raise ValueError(f"--cache {self.path}: no {MANIFEST}; {hint}")
        try:
            self.manifest = json.loads((self.path / MANIFEST).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--cache {self.path / MANIFEST}: not valid JSON ({e}); rebuild or restore it") from None
        if self.manifest.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"--cache {self.path}: schema version {self.manifest.get('schema_version')}, this "
                             f"qat-lora reads {SCHEMA_VERSION}; rebuild the cache")
        self.encoding = make_encoding(self.manifest["encoding"])
        self.preload = preload
        self._handles: dict[str, object] = {}
        self._index = {s: self._row_index(s) for s in self.manifest["splits"]}

    @property
    def seq_len(self) -> int:
        return self.manifest["seq_len"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    def num_sequences(self, split: str) -> int:
        return self.manifest["splits"][split]["sequences"]

    def _row_index(self, split: str) -> list[tuple[str, int]]:
        """Global row -> (shard file, row within the shard)."""
        index: list[tuple[str, int] | None] = [None] * self.num_sequences(split)
        for shard in self.manifest["splits"][split]["shards"]:
            for local, row in enumerate(range(*shard["rows"])):
                index[row] = (shard["file"], local)
        return index  # type: ignore[return-value]

    def _shard(self, name: str):
        if name not in self._handles:
            file = self.path / name
            if not file.exists():
                raise ValueError(f"--cache {self.path}: shard {name} is missing; run `qat-lora cache verify`")
            if self.preload:
                with safe_open(str(file), framework="np") as f:
                    self._handles[name] = {k: f.get_tensor(k) for k in f.keys()}
            else:
                self._handles[name] = safe_open(str(file), framework="np")  # memory-mapped
        return self._handles[name]

    def _read(self, name: str, local: int) -> dict[str, np.ndarray]:
        shard = self._shard(name)
        get = (lambda k: shard[k]) if isinstance(shard, dict) else shard.get_tensor
        keys = shard.keys()
        row = {}
        for key in keys:
            if key.endswith("_offsets"):
                continue
            if f"{key}_offsets" in keys:
                offsets = get(f"{key}_offsets")
                start, stop = int(offsets[local]), int(offsets[local + 1])
                row[key] = (shard[key] if isinstance(shard, dict) else shard.get_slice(key))[start:stop]
            else:
                row[key] = get(key)[local] if isinstance(shard, dict) else shard.get_slice(key)[local]
        return row

    def sequence(self, index: int, split: str = "train") -> dict[str, torch.Tensor]:
        """Decode sequence `index`: `input_ids` [L] int64, `attention_mask` [L] uint8, and the targets
        (`topk_ids`/`topk_logprobs` [L, K] or `sample_ids`/`sample_weights` [L, N])."""
        if not 0 <= index < self.num_sequences(split):
            raise IndexError(f"sequence {index} out of range for the {split} split ({self.num_sequences(split)})")
        raw = self._read(*self._index[split][index])
        out = {"input_ids": torch.from_numpy(np.asarray(raw["input_ids"], dtype=np.int64)),
               "attention_mask": torch.from_numpy(np.asarray(raw["attention_mask"], dtype=np.uint8))}
        out.update(self.encoding.decode(raw, self.seq_len, self.vocab_size))
        return out

    def batches(self, split: str, batch_size: int, *, seed: int = 0, epoch: int = 0, rank: int = 0,
                world_size: int = 1, shuffle: bool = True, drop_last: bool = True,
                prefetch: int = 2) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch of fixed-shape batches for one rank. drop_last=False pads the last batch with
        all-masked rows (evaluation: every token counted, shapes unchanged)."""
        order = batch_order(self.num_sequences(split), seed=seed, epoch=epoch, rank=rank, world_size=world_size,
                            shuffle=shuffle)

        def make(rows: list[int]) -> dict[str, torch.Tensor]:
            seqs = [self.sequence(i, split) for i in rows]
            batch = {k: torch.stack([s[k] for s in seqs]) for k in seqs[0]}
            if len(rows) < batch_size:
                batch = {k: torch.cat([v, v.new_zeros((batch_size - len(rows), *v.shape[1:]))]) for k, v in batch.items()}
            return batch

        groups = [order[i:i + batch_size].tolist() for i in range(0, len(order), batch_size)]
        if groups and len(groups[-1]) < batch_size and drop_last:
            groups.pop()
        yield from _prefetched(map(make, groups), prefetch)

    def check_compatible(self, tokenizer, vocab_size: int, seq_len: int | None = None) -> None:
        """Refuse a student whose tokenizer, logits width or context does not match the cache."""
        if vocab_size != self.vocab_size:
            raise ValueError(f"--cache {self.path}: built for vocab size {self.vocab_size}, the student has "
                             f"{vocab_size}; rebuild the cache with this model's teacher")
        if models.tokenizer_hash(tokenizer) != self.manifest["tokenizer_sha256"]:
            raise ValueError(f"--cache {self.path}: built with a different tokenizer than the student's; "
                             "rebuild the cache with the student's tokenizer")
        if seq_len is not None and seq_len < self.seq_len:
            raise ValueError(f"--cache {self.path}: sequences of {self.seq_len} tokens exceed the student's "
                             f"context ({seq_len}); rebuild with a smaller --seq-len")


def _prefetched(items: Iterator, depth: int) -> Iterator:
    """Produce `items` on a background thread, `depth` ahead (decoding overlaps the training step)."""
    if depth <= 0:
        yield from items
        return
    slots: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def produce() -> None:
        try:
            for item in items:
                slots.put(item)
        except BaseException as e:  # surface decode errors in the consumer
            slots.put(e)
        slots.put(done)

    threading.Thread(target=produce, daemon=True).start()
    while (item := slots.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def batch_order(num_rows: int, *, seed: int, epoch: int, rank: int = 0, world_size: int = 1,
                shuffle: bool = True) -> torch.Tensor:
    """Row order for one epoch of one rank: a pure function of (seed, epoch, rank, world_size)."""
    if shuffle:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(num_rows, generator=generator)
    else:
        order = torch.arange(num_rows)
    return order[rank::world_size]


def verify_cache(path: str | Path) -> list[str]:
    """Check a cache against its manifest: every shard present, of the recorded size and sha256, readable,
    with the shapes the manifest implies, and the splits' counts consistent. Returns the problems found,
    one line each naming the file (empty: the cache is sound)."""
    try:
        cache = KDCache(path)
    except (ValueError, KeyError) as e:
        return [str(e).splitlines()[0] if str(e) else f"{path}: unreadable manifest ({e!r})"]
    problems = []
    for split, info in cache.manifest["splits"].items():
        covered = 0
        for shard in info["shards"]:
            file = cache.path / shard["file"]
            count = len(range(*shard["rows"]))
            covered += count
            if not file.exists():
                problems.append(f"{file}: missing")
            elif file.stat().st_size != shard["bytes"]:
                problems.append(f"{file}: {file.stat().st_size} bytes, the manifest says {shard['bytes']} (truncated?)")
            elif sha256_file(file) != shard["sha256"]:
                problems.append(f"{file}: sha256 differs from the manifest (corrupted)")
            else:
                problems += _check_shapes(file, count, cache.seq_len)
        if covered != info["sequences"]:
            problems.append(f"{cache.path / MANIFEST}: {split} shards hold {covered} sequences, the manifest says {info['sequences']}")
    return problems


def _check_shapes(file: Path, rows: int, seq_len: int) -> list[str]:
    try:
        with safe_open(str(file), framework="np") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    except Exception as e:  # a header that does not parse is a corrupt shard, whatever the library raises
        return [f"{file}: unreadable safetensors ({str(e).splitlines()[0]})"]
    bad = [k for k in BASE_KEYS if shapes.get(k) != [rows, seq_len]]
    return [f"{file}: {', '.join(bad)} shaped {[shapes.get(k) for k in bad]}, expected [{rows}, {seq_len}]"] if bad else []


def inspect_cache(path: str | Path) -> dict:
    """Summary of a cache: tokens, sequences, bytes per token (target bytes included), encoding, identities."""
    cache = KDCache(path)
    m = cache.manifest
    total_bytes = sum(sh["bytes"] for info in m["splits"].values() for sh in info["shards"])
    tokens = sum(info["tokens"] for info in m["splits"].values())
    return {"path": str(cache.path), "encoding": m["encoding"], "seq_len": m["seq_len"], "vocab_size": m["vocab_size"],
            "sequences": {s: i["sequences"] for s, i in m["splits"].items()},
            "tokens": {s: i["tokens"] for s, i in m["splits"].items()},
            "bytes": total_bytes, "bytes_per_token": round(total_bytes / max(tokens, 1), 2),
            "teacher": m["teacher"]["name_or_path"], "teacher_weights_sha256": m["teacher"]["weights_sha256"],
            "tokenizer_sha256": m["tokenizer_sha256"], "world_size": m.get("world_size", 1)}
