"""The KD cache reader (DESIGN §2): a memory-mapped view of a cache folder, `cache verify` and `cache inspect`.

The trainer and eval need only this module; the builder (`cache/builder.py`) writes what it reads. Layout and
encodings: docs/cache-format.md.
"""
from __future__ import annotations

import bisect
import itertools
import json
import queue
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from qat_lora.data import identities
from qat_lora.cache.encodings import make_encoding
from qat_lora.runtime.files import first_line, sha256_file

SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
BASE_KEYS = ("input_ids", "attention_mask")
TOKEN_BYTES = 5  # a cached token's own bytes, targets aside: its int32 id and its mask byte (docs/cache-format.md)
BUILD_KEY = "qat_lora_build"  # a shard's safetensors metadata: the build that wrote it (the manifest's `build_id`)
_MIXED = ("written by another build than its manifest (two builders wrote this folder); rebuild the cache with "
          "--overwrite")


def shard_build(file: str | Path) -> str | None:
    """The `build_id` a shard records in its metadata (None: a shard from before it was recorded, or unreadable)."""
    try:
        with safe_open(str(file), framework="np") as f:
            return (f.metadata() or {}).get(BUILD_KEY)
    except Exception:  # a damaged header: the callers' own checks name it
        return None


class KDCache:
    """Read-only, memory-mapped view of a cache folder.

    `sequence(i, split)` decodes one sequence; `batches(...)` yields fixed-shape training batches for one
    rank in an order that is a pure function of (seed, epoch, rank, world_size), decoded ahead on a thread.
    """

    def __init__(self, path: str | Path, preload: bool = False) -> None:
        self.path = Path(path)
        self.manifest = _load_manifest(self.path)
        try:
            self.encoding = make_encoding(self.manifest["encoding"])
        except (KeyError, TypeError) as e:  # a hand-edited encoding entry: one line, not a traceback
            raise ValueError(f"--cache {self.path / MANIFEST}: `encoding` lacks {e} or holds a wrong type; "
                             f"{_MANIFEST_FIX}") from None
        self.preload = preload
        self._handles: dict[str, object] = {}
        self._index = {s: _RowIndex(info["shards"]) for s, info in self.manifest["splits"].items()}

    @property
    def seq_len(self) -> int:
        return self.manifest["seq_len"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    def num_sequences(self, split: str) -> int:
        return self.manifest["splits"][split]["sequences"]

    def _shard(self, name: str):
        if name not in self._handles:
            file = self.path / name
            if not file.exists():
                raise ValueError(f"--cache {self.path}: shard {name} is missing; run `qat-lora cache verify`")
            if not file.is_file():  # mmap of a folder fails with a bare "No such device"
                raise ValueError(f"--cache {self.path}: shard {name} {_not_a_file(file)}; remove it and rebuild the "
                                 "cache with --resume or --overwrite")
            if self.manifest.get("build_id") and shard_build(file) not in (None, self.manifest["build_id"]):
                raise ValueError(f"--cache {self.path}: shard {name} was {_MIXED}")
            try:
                if self.preload:
                    with safe_open(str(file), framework="np") as f:
                        self._handles[name] = {k: f.get_tensor(k) for k in f.keys()}
                else:
                    self._handles[name] = safe_open(str(file), framework="np")  # memory-mapped
            except SafetensorError as e:  # cut short by a full disk or a broken copy
                raise ValueError(f"--cache {self.path}: shard {name} is damaged ({first_line(e)}); run `qat-lora "
                                 "cache verify` and rebuild the cache with --resume or --overwrite") from None
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
        raw = self._read(*self._index[split].locate(index))
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
        if identities.tokenizer_hash(tokenizer) != self.manifest["tokenizer_sha256"]:
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


_MANIFEST_FIX = "rebuild the cache or restore its manifest.json"
# The fields every reader relies on, with their JSON types (bool is not an int here).
_HEADER_FIELDS = {"schema_version": int, "encoding": dict, "seq_len": int, "vocab_size": int, "splits": dict,
                  "tokenizer_sha256": str, "teacher": dict}
_JSON_NAMES = {dict: "object", str: "string"}
_SHARD_FIELDS = {"bytes": (int, "a non-negative integer"), "sha256": (str, "a string")}
# The least one row can take on disk: L int32 input ids + L uint8 mask bytes (docs/cache-format.md), targets
# not counted. Bounds the rows a shard of its recorded size can hold, so a forged count is refused, not allocated.
_MIN_BYTES_PER_TOKEN = 5


def _load_manifest(path: Path) -> dict:
    """The manifest of the cache folder `path`, checked (`_check_manifest`) before anything relies on it."""
    file = path / MANIFEST
    if not file.exists():
        hint = "run `qat-lora cache merge`" if list(path.glob("manifest-r*.json")) else \
            "build one with `qat-lora build-cache`"
        raise ValueError(f"--cache {path}: no {MANIFEST}; {hint}")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--cache {file}: not valid JSON ({e}); rebuild or restore it") from None
    if isinstance(manifest, dict) and manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"--cache {path}: schema version {manifest.get('schema_version')}, this "
                         f"qat-lora reads {SCHEMA_VERSION}; rebuild the cache")
    _check_manifest(manifest, file)
    return manifest


def _is(value, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _check_manifest(manifest: dict, where: Path) -> None:
    """The whole schema the reader and `cache verify` rely on, in one place: every field present with its type,
    shard names confined to the cache folder (a manifest is data from elsewhere: `../x` or `/etc/x` must never be
    opened), each shard named once, the shards of a split covering its rows exactly once, and every count
    within what the recorded shard sizes can hold (checked before any index is allocated).

    Raises:
        ValueError: one line naming the manifest and the bad entry.
    """
    if not isinstance(manifest, dict):
        raise ValueError(f"{where}: not a JSON object; {_MANIFEST_FIX}")
    for key, kind in _HEADER_FIELDS.items():
        if key not in manifest:
            raise ValueError(f"{where}: no `{key}` entry; the manifest is damaged: rebuild the cache")
        if not _is(manifest[key], kind) or (kind is int and manifest[key] <= 0):
            what = "a positive integer" if kind is int else f"a JSON {_JSON_NAMES[kind]}"
            raise ValueError(f"{where}: `{key}` is {manifest[key]!r}, not {what}; {_MANIFEST_FIX}")
    seen: set[str] = set()  # shard names over every split: one file read as two shards is double data
    for split, info in manifest["splits"].items():
        _check_split(split, info, manifest["seq_len"], where, seen)


def _check_split(split: str, info, seq_len: int, where: Path, seen: set[str]) -> None:
    sequences = info.get("sequences") if isinstance(info, dict) else None
    if not _is(sequences, int) or sequences < 0 or not isinstance(info.get("shards"), list):
        raise ValueError(f"{where}: split {split!r} lacks `sequences` or `shards`; rebuild the cache")
    if "tokens" in info and not _is(info["tokens"], int):
        raise ValueError(f"{where}: split {split!r} has `tokens` {info['tokens']!r}, not an integer; {_MANIFEST_FIX}")
    spans = []
    for shard in info["shards"]:
        name, span = _check_shard_entry(shard, split, sequences, seq_len, where)
        if name in seen:
            raise ValueError(f"{where}: shard {name} is listed twice; {_MANIFEST_FIX}")
        seen.add(name)
        spans.append((span, name))
    covered = sum(len(span) for span, _ in spans)
    if covered != sequences:
        raise ValueError(f"{where}: {split} shards hold {covered} sequences, the manifest says {sequences}; "
                         f"{_MANIFEST_FIX}")
    _check_disjoint(spans, where)


def _check_shard_entry(shard, split: str, sequences: int, seq_len: int, where: Path) -> tuple[str, range]:
    """One `shards[]` entry: its name, fields and row range. Returns (file name, rows)."""
    name = shard.get("file") if isinstance(shard, dict) else None
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..") or "\\" in name:
        raise ValueError(f"{where}: shard name {name!r} is not a file inside the cache folder; refusing it")
    for key, (kind, what) in _SHARD_FIELDS.items():
        if not _is(shard.get(key), kind) or (kind is int and shard[key] < 0):
            raise ValueError(f"{where}: shard {name} has `{key}` {shard.get(key)!r}, not {what}; {_MANIFEST_FIX}")
    rows = shard.get("rows")
    span = range(*rows) if (isinstance(rows, list) and len(rows) == 3 and all(_is(r, int) for r in rows)
                            and rows[2] > 0) else None
    if span is None or not len(span) or span[0] < 0 or span[-1] >= sequences:
        raise ValueError(f"{where}: shard {name} has row range {rows!r} outside the {split} split's "
                         f"{sequences} sequences; rebuild the cache")
    if len(span) * seq_len * _MIN_BYTES_PER_TOKEN > shard["bytes"]:
        raise ValueError(f"{where}: shard {name} claims {len(span)} rows of {seq_len} tokens in {shard['bytes']} "
                         f"bytes, fewer than they take; {_MANIFEST_FIX}")
    return name, span


def _check_disjoint(spans: list[tuple[range, str]], where: Path) -> None:
    """No row in two shards. A build steps every shard of a split by its world size, so shards of one residue
    class sorted by start overlap only where one starts before its predecessor ends."""
    steps = {span.step: name for span, name in spans}
    if len(steps) > 1:
        (a, first), (b, second) = list(steps.items())[:2]
        raise ValueError(f"{where}: shards {first} and {second} step through rows by {a} and {b}, one build steps "
                         f"by one world size; {_MANIFEST_FIX}")
    ordered = sorted(spans, key=lambda item: (item[0].start % item[0].step, item[0].start))
    for (prev, prev_name), (span, name) in zip(ordered, ordered[1:]):
        if span.start % span.step == prev.start % prev.step and span.start <= prev[-1]:
            raise ValueError(f"{where}: shards {prev_name} and {name} both hold row {span.start}; {_MANIFEST_FIX}")


class _RowIndex:
    """Global row -> (shard file, row within the shard) of one split, in memory per shard, not per row: the
    shards of a checked manifest share one step and cover the rows exactly once (`_check_disjoint`)."""

    def __init__(self, shards: list[dict]) -> None:
        self.step = shards[0]["rows"][2] if shards else 1
        self.starts: dict[int, list[int]] = {}
        self.names: dict[int, list[str]] = {}
        for shard in sorted(shards, key=lambda sh: sh["rows"][0]):
            start = shard["rows"][0]
            self.starts.setdefault(start % self.step, []).append(start)
            self.names.setdefault(start % self.step, []).append(shard["file"])

    def locate(self, row: int) -> tuple[str, int]:
        residue = row % self.step
        at = bisect.bisect_right(self.starts[residue], row) - 1
        return self.names[residue][at], (row - self.starts[residue][at]) // self.step


def _not_a_file(file: Path) -> str:
    return "is a folder, not a shard file" if file.is_dir() else "is not a regular file"


def verify_cache(path: str | Path) -> list[str]:
    """Check a cache against its manifest: every shard present, of the recorded size and sha256, readable,
    with the shapes the manifest implies, and the splits' counts consistent. Returns the problems found,
    one line each naming the file (empty: the cache is sound)."""
    try:
        cache = KDCache(path)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:  # verify itself never crashes
        return [str(e).splitlines()[0] if isinstance(e, ValueError) and str(e) else
                f"{Path(path) / MANIFEST}: unreadable manifest ({type(e).__name__}: {e})"]
    problems = []  # the manifest's counts, names and fields were checked by KDCache (_check_manifest)
    for info in cache.manifest["splits"].values():
        for shard in info["shards"]:
            file = cache.path / shard["file"]
            if not file.exists():
                problems.append(f"{file}: missing")
            elif not file.is_file():
                problems.append(f"{file}: {_not_a_file(file)}; remove it and rebuild the cache with --resume")
            elif cache.manifest.get("build_id") and shard_build(file) not in (None, cache.manifest["build_id"]):
                problems.append(f"{file}: {_MIXED}")
            elif file.stat().st_size != shard["bytes"]:
                problems.append(f"{file}: {file.stat().st_size} bytes, the manifest says {shard['bytes']} (truncated?)")
            elif sha256_file(file) != shard["sha256"]:
                problems.append(f"{file}: sha256 differs from the manifest (corrupted)")
            else:
                problems += _check_shard(file, len(range(*shard["rows"])), cache.seq_len)
    return problems


def _check_shard(file: Path, rows: int, seq_len: int) -> list[str]:
    """Shapes of the base arrays, and every stored float finite: a checksum only proves the bytes are the ones
    written, and a teacher that overflowed writes NaN log-probs with a valid checksum."""
    try:
        with safe_open(str(file), framework="np") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
            nonfinite = [k for k in f.keys() if np.issubdtype((a := f.get_tensor(k)).dtype, np.floating)
                         and not np.isfinite(a).all()]
    except Exception as e:  # a header that does not parse is a corrupt shard, whatever the library raises
        return [f"{file}: unreadable safetensors ({str(e).splitlines()[0]})"]
    bad = [k for k in BASE_KEYS if shapes.get(k) != [rows, seq_len]]
    problems = [f"{file}: {', '.join(bad)} shaped {[shapes.get(k) for k in bad]}, expected [{rows}, {seq_len}]"] \
        if bad else []
    return problems + [f"{file}: {k} holds NaN or inf values; rebuild the cache" for k in nonfinite]


def inspect_cache(path: str | Path) -> dict:
    """Summary of a cache: tokens, sequences, bytes per token (target bytes included), encoding, identities."""
    cache = KDCache(path)
    m = cache.manifest
    total_bytes = sum(sh["bytes"] for info in m["splits"].values() for sh in info["shards"])
    tokens = sum(info.get("tokens", 0) for info in m["splits"].values())
    return {"path": str(cache.path), "encoding": m["encoding"], "seq_len": m["seq_len"], "vocab_size": m["vocab_size"],
            "sequences": {s: i["sequences"] for s, i in m["splits"].items()},
            "tokens": {s: i.get("tokens") for s, i in m["splits"].items()},
            "bytes": total_bytes, "bytes_per_token": round(total_bytes / max(tokens, 1), 2),
            "teacher": m["teacher"].get("name_or_path"), "teacher_weights_sha256": m["teacher"].get("weights_sha256"),
            "tokenizer_sha256": m["tokenizer_sha256"], "world_size": m.get("world_size", 1),
            # Caches built before these were recorded ran the teacher in fp32 at the backend's matmul precision.
            "teacher_dtype": m.get("teacher_dtype", "fp32"), "matmul_precision": m.get("matmul_precision", "default")}


def batches_per_epoch(cache: KDCache, batch_size: int, rank: int = 0, world_size: int = 1) -> int:
    """Full batches one rank reads per epoch (its rows are `order[rank::world_size]`)."""
    return len(range(rank, cache.num_sequences("train"), world_size)) // batch_size


def endless_batches(cache: KDCache, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                    start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Epoch after epoch of shuffled fixed-shape training batches (each epoch's last partial batch dropped).

    `start` batches are skipped (resume): the order is a pure function of (seed, epoch, rank, world_size), so
    whole epochs are skipped without reading them, and only the batches before `start` in its epoch are read.
    """
    epoch, skip = divmod(start, batches_per_epoch(cache, batch_size, rank, world_size))
    while True:
        yield from itertools.islice(cache.batches("train", batch_size, seed=seed, epoch=epoch, rank=rank,
                                                  world_size=world_size), skip, None)
        epoch, skip = epoch + 1, 0
