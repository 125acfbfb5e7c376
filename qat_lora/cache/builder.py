"""The KD cache builder (DESIGN §2): the teacher runs once; its targets are read thousands of times.

Rank r of W takes the sequences with index = r (mod W) of each split, runs the teacher in fixed-shape
batches, and hands the device results to a background writer that encodes (docs/cache-format.md), writes
each shard under a temporary name, renames it, and records it in `progress-r{r}.json`. `--resume` continues
after the last recorded shard, so a killed build ends byte-identical to an uninterrupted one. When every
rank is done, `merge_manifests` (merge.py; automatic for one rank) writes the single `manifest.json` the reader needs.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from qat_lora import __version__

from qat_lora.data import text as data

from qat_lora.runtime import device as dev
from qat_lora.runtime import precision, xla

from qat_lora.data import identities, models
from qat_lora.cache.reader import BUILD_KEY, MANIFEST, SCHEMA_VERSION
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.cache.folder import check_out, check_out_path, finished, prepare_out, rank_lock  # noqa: F401 (API)
from qat_lora.cache.merge import BUILD_FILE, merge_manifests
from qat_lora.runtime.distributed import Backend
from qat_lora.runtime.files import atomic_write_json, owner_stamp, read_record, save_safetensors, sha256_file
from qat_lora.runtime.runs import StopSignal


_TEACHER_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}  # keys: config.TEACHER_DTYPES


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

    def __init__(self, out: Path, encoding, vocab_size: int, progress_path: Path, progress: dict, build: str) -> None:
        self.out, self.encoding, self.vocab_size, self.metadata = out, encoding, vocab_size, {BUILD_KEY: build}
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
        try:
            save_safetensors(arrays, self.out / name, self.metadata)  # the umask's modes: caches are shared
        except BaseException:
            (self.out / (name + ".tmp")).unlink(missing_ok=True)  # a full disk leaves no half shard, not even its temp
            raise
        self.progress["shards"][split].append({"file": name, "rows": rows, "bytes": (self.out / name).stat().st_size,
                                               "sha256": sha256_file(self.out / name)})
        atomic_write_json(self.progress_path, self.progress)

    def close(self) -> None:
        for future in self.pending:
            future.result()
        self.pool.shutdown()


def _load_progress(cfg: CacheBuildConfig, out: Path, corpus: str) -> dict:
    """This rank's progress record: fresh, or (--resume) the interrupted build's, refused when its arguments, its
    corpus or its shards changed since (the teacher is checked once loaded: `_check_teacher`). Cheap checks
    only: nothing has loaded yet and nothing is written."""
    path = out / f"progress-r{cfg.rank:03d}.json"
    fresh = {**owner_stamp("cache"), "fingerprint": cfg.fingerprint(), "rank": cfg.rank, "corpus_sha256": corpus,
             "shards": {s: [] for s in data.SPLITS}}
    if not cfg.resume or not path.exists():
        return fresh
    progress = read_record(path)
    problem = _progress_problem(progress)
    if problem:
        which = f"rank {cfg.rank}" if cfg.world_size > 1 else "the cache"
        raise ValueError(f"--resume: {path} is damaged ({problem}); rebuild {which} with --overwrite instead of "
                         "--resume")
    if progress.get("fingerprint") != cfg.fingerprint():
        raise ValueError(f"--resume: {out} was built with other arguments; rerun with the same flags"
                         f"{cfg.earlier_default_hint(progress.get('fingerprint'))} or --overwrite")
    # Progress records from before the identities were kept hold no corpus_sha256: nothing to compare.
    if progress.setdefault("corpus_sha256", corpus) != corpus:
        raise ValueError(f"--data {' '.join(cfg.data)}: the corpus changed since this build started; rebuild with "
                         "--overwrite or restore it")
    for split in data.SPLITS:
        for shard in progress["shards"][split]:
            file = out / shard["file"]
            if not file.is_file() or sha256_file(file) != shard["sha256"]:
                raise ValueError(f"--resume: shard {file} is missing or changed; rebuild with --overwrite")
    return {**progress, **owner_stamp("cache")}


def _progress_problem(progress: dict | None) -> str:
    """What makes a progress record unusable for --resume ("" when it is sound): not an object, or a missing or
    ill-typed field; shard names must be this build's (never a path out of the folder)."""
    if progress is None:
        return "not a JSON object"
    if not isinstance(progress.get("fingerprint"), str) or not isinstance(progress.get("shards"), dict):
        return "no `fingerprint` or `shards`"
    for split in data.SPLITS:
        shards = progress["shards"].get(split)
        if not isinstance(shards, list):
            return f"no `shards.{split}` list"
        for shard in shards:
            fields = shard if isinstance(shard, dict) else {}
            rows = fields.get("rows")
            if not (isinstance(fields.get("file"), str) and BUILD_FILE.fullmatch(fields["file"])
                    and isinstance(fields.get("sha256"), str) and isinstance(rows, list) and len(rows) == 3
                    and all(type(r) is int for r in rows) and rows[2] > 0):
                return f"a bad `shards.{split}` entry"
    return ""


def _check_teacher(cfg: CacheBuildConfig, progress: dict, identity: dict) -> None:
    """Record the teacher's identity in the progress, or (--resume) refuse a teacher whose weights or config
    changed since the build started: its new shards would mix two teachers' targets."""
    teacher = {k: identity[k] for k in ("weights_sha256", "config_sha256")}
    if progress.setdefault("teacher", teacher) != teacher:  # older records: none to compare
        raise ValueError(f"--teacher {cfg.teacher}: the teacher changed since this build started (weights or config); "
                         "rebuild with --overwrite or restore it")


def _tokenise(cfg: CacheBuildConfig, files: list[Path], tokenizer) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    docs = data.tokenized_documents(files, tokenizer, cfg.text_field, chat=cfg.chat,
                                   decoding=cfg.text_decoding())
    streams = data.split_token_streams(docs, tokenizer, cfg.holdout_fraction, cfg.max_tokens or None)
    if not streams["train"]:
        raise ValueError(f"--data {' '.join(cfg.data)}: no text found (empty corpus)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prefix = models.sequence_prefix(tokenizer)  # Gemma's BOS opens every sequence, as in its training
    return {s: data.pack(streams[s], cfg.seq_len, pad_id=pad, prefix=prefix) for s in data.SPLITS}


def _load_teacher(cfg: CacheBuildConfig):
    tokenizer = models.load_tokenizer(cfg.teacher)
    teacher = models.load_causal_lm(cfg.teacher)
    limit = models.max_positions(teacher)
    if limit is not None and cfg.seq_len > limit:
        raise ValueError(f"--seq-len {cfg.seq_len}: longer than the teacher's context ({limit} positions)")
    if cfg.encoding == "topk" and cfg.top_k > models.vocab_size(teacher):
        raise ValueError(f"--top-k {cfg.top_k}: larger than the vocabulary ({models.vocab_size(teacher)})")
    return tokenizer, teacher


def _teacher_to(teacher: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                backend: Backend | None = None) -> None:
    """Parameters to `dtype` on `device` (fsdp: split over the devices as they move); buffers stay fp32, as
    from_pretrained(dtype=...) leaves them (the rotary frequencies in bf16 would shift every position's angle)."""
    for param in teacher.parameters():
        param.data = param.data.to(dtype)
    (backend or Backend()).shard_model_(teacher.requires_grad_(False), device)  # frozen: fsdp splits it all


def build_cache(cfg: CacheBuildConfig, log: Callable[[str], None] = print, backend: Backend | None = None) -> Path:
    """Run the teacher over this rank's sequences and write its shards; with one rank also the manifest.

    `backend`: an SPMD one (launch.build_cache_on_chips with `--parallel spmd / fsdp`) spreads each batch over the
    host's XLA devices, `batch_size` rows per device, and with fsdp the teacher's weights too
    (sharding.FsdpBackend), so a teacher larger than one chip fits; the shards are the same as one device's.
    Returns the manifest path (one rank) or this rank's partial manifest (several ranks).
    Raises:
        ValueError: missing teacher or data, empty corpus, seq_len beyond the teacher's context, an existing
            cache without --overwrite, another builder of this rank in --out, a damaged progress record, a
            --resume whose arguments, corpus or teacher differ from the interrupted build's.
        SystemExit: 128 + the signal after SIGTERM / SIGINT, once the shards already queued are written (the
            build then continues with --resume).
    """
    files = data.list_text_files(cfg.data)  # cheap checks first: a typo should not wait for the teacher
    if finished(cfg):  # a preemption loop may rerun the build once more after it completed
        log(f"{cfg.out}: this build is already complete; nothing to resume")
        return Path(cfg.out) / MANIFEST
    check_out(cfg)  # before the lock, whose file would sit among a user's files for a moment
    with rank_lock(cfg.out, cfg.rank):  # one builder per rank: two would mix their shards
        return _build(cfg, files, log, backend)


def _build(cfg: CacheBuildConfig, files: list[Path], log: Callable[[str], None], backend: Backend | None) -> Path:
    out = check_out(cfg)
    corpus = data.corpus_fingerprint(files)
    progress = _load_progress(cfg, out, corpus)
    tokenizer, teacher = _load_teacher(cfg)
    identity = identities.model_fingerprint(teacher, cfg.teacher)  # of the weights as stored, whatever --dtype runs
    _check_teacher(cfg, progress, identity)
    packed = _tokenise(cfg, files, tokenizer)
    prepare_out(cfg)
    backend = backend or Backend()
    # A builder among several on this host (launch.build_cache_on_chips, torchrun) drives its own GPU.
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = dev.prepare_process(dev.resolve_device(cfg.device), local_rank,
                                 int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if dev.is_xla(device):  # a rebuild, a resume or the next build of this teacher loads its graphs from disk
        xla.init_xla_cache(cfg.xla_cache_dir, local_rank)
    _teacher_to(teacher, device, _TEACHER_DTYPE[cfg.dtype], backend)
    encoding, vocab = cfg.target_encoding(), models.vocab_size(teacher)
    header = _header(cfg, corpus, identity, tokenizer, vocab, encoding)
    build = _build_id(cfg, header)
    writer = _ShardWriter(out, encoding, vocab, out / f"progress-r{cfg.rank:03d}.json", progress, build)
    # Until here a stop signal ends the process at once (nothing is written yet); from here it ends the build
    # between batches, after the shards already queued.
    with StopSignal() as stop:
        try:
            elapsed, xla_loop = _run_teacher(cfg, teacher, device, backend, encoding, packed, writer, stop, log)
        except _Stopped as stopped:
            writer.close()  # the shards already queued are whole and recorded: --resume continues after them
            log(f"stopped by {signal.Signals(stopped.signum).name}: {sum(map(len, progress['shards'].values()))} "
                "shard(s) kept; rerun the same command with --resume to continue")
            raise SystemExit(128 + stopped.signum) from None
    partial = {**owner_stamp("cache"), "rank": cfg.rank, "world_size": cfg.world_size, "shards": progress["shards"],
               "sequences": {s: len(packed[s][0]) for s in data.SPLITS},
               "tokens": {s: int(packed[s][1].sum()) for s in data.SPLITS},
               "header": header, "build_id": build, "seconds": round(elapsed, 2)}
    if dev.is_xla(device):
        partial["xla"] = xla_loop  # this rank's batch loop: one graph per batch shape, one run per batch
    path = out / f"manifest-r{cfg.rank:03d}.json"
    atomic_write_json(path, partial)
    log(f"{f'rank {cfg.rank}: ' if cfg.world_size > 1 else ''}shards written in {elapsed:.1f} s")
    return merge_manifests(out, log) if cfg.world_size == 1 else path


class _Stopped(Exception):
    """A stop signal arrived: the build ends between batches (the shard being gathered is abandoned)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _run_teacher(cfg: CacheBuildConfig, teacher, device, backend: Backend, encoding, packed: dict,
                 writer: _ShardWriter, stop: StopSignal, log: Callable[[str], None]) -> tuple[float, dict]:
    """Every split's shards of this rank, after those `writer.progress` already holds; returns the seconds taken
    and the XLA counters of the batch loop ({} off XLA; laying out an fsdp teacher's shards before it is not counted).

    Raises:
        _Stopped: a stop signal arrived (the writer is left for the caller to close).
    """
    progress = writer.progress
    mine = {s: np.arange(cfg.rank, len(packed[s][0]), cfg.world_size) for s in data.SPLITS}
    done = {s: sum(len(range(*sh["rows"])) for sh in progress["shards"][s]) for s in data.SPLITS}
    total = sum(int(packed[s][1][mine[s]].sum()) for s in data.SPLITS)
    _warn_small_holdout(cfg, len(packed["heldout"][0]), log)
    who = f", rank {cfg.rank} of {cfg.world_size}" if cfg.world_size > 1 else ""  # one builder has no rank to name
    on = f"{device} ({backend.describe()})" if backend.data_parallel > 1 else f"{device}"
    log(f"teacher {cfg.teacher} on {on}{who}: {total:,} tokens, "
        + ", ".join(f"{s} {len(mine[s])} x {cfg.seq_len}" for s in data.SPLITS)
        + (f", resuming after {sum(done.values())} sequences" if any(done.values()) else ""))
    started, before = time.perf_counter(), xla.compile_metrics()
    with tqdm(total=total, unit="tok", unit_scale=True, desc="teacher") as bar:
        bar.update(sum(int(packed[s][1][mine[s][:done[s]]].sum()) for s in data.SPLITS))
        with precision.matmul_precision(device, cfg.matmul_precision):
            for split in data.SPLITS:
                _build_split(cfg, teacher, device, backend, encoding, split, packed[split], mine[split],
                             done[split], writer, bar, stop)
    writer.close()
    loop = xla.compile_metrics_since(before)
    if dev.is_xla(device):
        log(f"XLA: {json.dumps(loop)}")
    return time.perf_counter() - started, loop


def _warn_small_holdout(cfg: CacheBuildConfig, sequences: int, log: Callable[[str], None]) -> None:
    """A held-out split of one sequence (or none) makes every held-out number noise; say so, with the fix."""
    if cfg.holdout_fraction > 0 and sequences <= 1:
        log(f"warning: the held-out split holds {sequences} sequence(s) of {cfg.seq_len} tokens, too few to measure "
            "anything; raise --holdout-fraction or --max-tokens (or add documents)")


def _build_split(cfg, teacher, device, backend: Backend, encoding, split: str, packed: tuple[np.ndarray, np.ndarray],
                 rows: np.ndarray, done: int, writer: _ShardWriter, bar: tqdm, stop: StopSignal) -> None:
    input_ids, mask = packed
    batch_size = cfg.batch_size * backend.data_parallel  # SPMD: --batch-size rows on each device
    for shard_start in range(done, len(rows), cfg.shard_sequences):
        shard_rows = rows[shard_start:shard_start + cfg.shard_sequences]
        selected: list[dict] = []
        previous: Callable[[], None] | None = None  # the last batch's results, on their way to the host
        for start in range(0, len(shard_rows), batch_size):
            if stop.signum is not None:  # checked per batch: a large shard of a large teacher takes minutes
                raise _Stopped(stop.signum)
            batch_rows = shard_rows[start:start + batch_size]
            ids = np.zeros((batch_size, cfg.seq_len), dtype=np.int64)  # fixed shape: pad the last batch
            ids[:len(batch_rows)] = input_ids[batch_rows]
            with torch.no_grad():
                # SPMD: rows split over the devices and the logits kept split the same way; the selection is per
                # row, so no device ever holds the whole B x L x V.
                placed = backend.shard_rows_(torch.from_numpy(ids).to(device))
                logits = backend.shard_rows_(teacher(input_ids=placed).logits)
            seeds = [_row_seed(cfg.seed, split, int(r)) for r in batch_rows]
            # The whole padded batch is selected (a short last batch compiles no second graph on XLA) and its
            # graph launched; the last batch's results come to the host while this one computes (one transfer
            # each), and the pad rows are dropped there.
            fetch = dev.to_host_soon(encoding.select_on_device(logits, seeds))
            if previous is not None:
                previous()
            previous = functools.partial(_collect, encoding, fetch, batch_rows, mask, selected, bar)
        if previous is not None:
            previous()
        name = f"{split}-r{cfg.rank:03d}-{shard_start // cfg.shard_sequences:05d}.safetensors"
        base = {"input_ids": input_ids[shard_rows].astype(np.int32), "attention_mask": mask[shard_rows]}
        span = [int(shard_rows[0]), int(shard_rows[-1]) + cfg.world_size, cfg.world_size]  # range(*span)
        writer.submit(split, name, base, selected, span)


def _collect(encoding, fetch: Callable[[], list[torch.Tensor]], batch_rows: np.ndarray, mask: np.ndarray,
             selected: list[dict], bar: tqdm) -> None:
    """One batch's selection, fetched to the host, appended to its shard's rows."""
    selected += encoding.host_rows(fetch(), len(batch_rows))
    bar.update(int(mask[batch_rows].sum()))


def _header(cfg: CacheBuildConfig, corpus: str, identity: dict, tokenizer, vocab: int, encoding) -> dict:
    return {"schema_version": SCHEMA_VERSION, "teacher": identity,
            "tokenizer_sha256": identities.tokenizer_hash(tokenizer), "vocab_size": vocab, "seq_len": cfg.seq_len,
            "encoding": encoding.params(), "teacher_dtype": cfg.dtype, "matmul_precision": cfg.matmul_precision,
            "corpus_sha256": corpus,
            "builder": {"version": __version__, "args": {k: v for k, v in asdict(cfg).items()
                                                         if k not in ("rank", "resume", "overwrite")}}}


# Flags that change where files lie, which device runs or how batches are cut, never a shard's bytes.
_PLACEMENT_FLAGS = ("teacher", "data", "out", "rank", "resume", "overwrite", "device", "parallel", "num_chips",
                    "batch_size", "xla_cache_dir")


def _build_id(cfg: CacheBuildConfig, header: dict) -> str:
    """What makes this build's shards: the identities of the teacher, tokenizer and corpus, the encoding and the
    flags that cut and draw the rows. Each shard records it (its metadata) and each manifest too: shards of two
    builds never pass as one cache (merge, verify and the reader compare them)."""
    content = {k: v for k, v in header.items() if k not in ("builder", "teacher")}
    content["teacher"] = {k: header["teacher"][k] for k in ("config_sha256", "weights_sha256")}
    unused = cfg.unused_flags()  # the other encoding's flags: whatever they hold, they draw nothing
    content["args"] = {k: v for k, v in asdict(cfg).items() if k not in _PLACEMENT_FLAGS and k not in unused}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:32]
