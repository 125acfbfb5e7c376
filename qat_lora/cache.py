"""The KD cache (DESIGN §2): teacher top-K log-probabilities over the full vocabulary, written once, read often.

Layout of a cache folder:
    manifest.json                         schema, teacher and tokenizer identity, encoding, splits, shards
    {split}-r{rank:03d}-{index:05d}.safetensors
        input_ids      [n, L]    int32    packed token ids
        attention_mask [n, L]    uint8    1 = real token (only the corpus's last row is padded)
        topk_ids       [n, L, K] int32    teacher's K most likely next tokens at each position, descending
        topk_logprobs  [n, L, K] float32  their log-softmax over the FULL vocabulary (tail mass implied)
Every file is written under a temporary name and renamed when complete; the manifest is written last.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file
from tqdm import tqdm

from . import __version__, data, device as dev, models
from .files import atomic_write_json, sha256_file

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
TENSOR_KEYS = ("input_ids", "attention_mask", "topk_ids", "topk_logprobs")


@dataclass
class CacheBuildConfig:
    teacher: str = field(default="", metadata={"help": "teacher: transformers folder, .gguf file or hub name"})
    data: list[str] = field(default_factory=list, metadata={"help": "text files or folders (.txt, .jsonl)"})
    out: str = field(default="caches/kd", metadata={"help": "output folder"})
    seq_len: int = field(default=512, metadata={"help": "tokens per packed sequence"})
    top_k: int = field(default=64, metadata={"help": "teacher log-probs kept per position"})
    max_tokens: int = field(default=1_000_000, metadata={"help": "token budget over both splits (0 = all)"})
    batch_size: int = field(default=8, metadata={"help": "sequences per teacher forward"})
    holdout_fraction: float = field(default=0.02, metadata={"help": "fraction of documents held out, by hash"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, xla or tpu"})
    text_field: str = field(default="text", metadata={"help": "text key of .jsonl records"})
    shard_sequences: int = field(default=1024, metadata={"help": "sequences per shard file"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing cache in --out"})

    def __post_init__(self) -> None:
        for name in ("seq_len", "top_k", "batch_size", "shard_sequences"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be positive")
        if self.max_tokens < 0:
            raise ValueError(f"--max-tokens {self.max_tokens}: must be >= 0 (0 = the whole corpus)")


def _write_shard(out: Path, name: str, arrays: dict[str, np.ndarray], row_start: int) -> dict:
    tmp = out / (name + ".tmp")
    save_file(arrays, str(tmp))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # safetensors creates 0600 files; caches are meant to be shared
    os.replace(tmp, out / name)
    rows = len(arrays["input_ids"])
    return {"file": name, "rank": 0, "rows": [row_start, row_start + rows],
            "bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)}


@torch.no_grad()
def teacher_topk(teacher, input_ids: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K of the teacher's fp32 log-softmax over the full vocabulary. Returns (logprobs, ids), [B, L, K]."""
    logits = teacher(input_ids=input_ids).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, top_k, dim=-1)
    return values, ids


def _build_split(teacher, device, split: str, input_ids: np.ndarray, mask: np.ndarray, cfg: CacheBuildConfig,
                 out: Path, progress: tqdm) -> dict:
    shards, pending, row_start = [], [], 0
    n = len(input_ids)
    for start in range(0, n, cfg.batch_size):
        ids = np.zeros((cfg.batch_size, cfg.seq_len), dtype=np.int32)  # fixed shape: pad the last batch
        rows = min(cfg.batch_size, n - start)
        ids[:rows] = input_ids[start:start + rows]
        values, topk_ids = teacher_topk(teacher, torch.from_numpy(ids).long().to(device), cfg.top_k)
        pending.append((values[:rows].cpu().numpy(), topk_ids[:rows].cpu().numpy().astype(np.int32)))
        progress.update(int(mask[start:start + rows].sum()))
        done = start + rows
        if sum(len(v) for v, _ in pending) >= cfg.shard_sequences or done == n:
            end = row_start + sum(len(v) for v, _ in pending)
            arrays = {"input_ids": input_ids[row_start:end], "attention_mask": mask[row_start:end],
                      "topk_ids": np.concatenate([i for _, i in pending]),
                      "topk_logprobs": np.concatenate([v for v, _ in pending]).astype(np.float32)}
            shards.append(_write_shard(out, f"{split}-r000-{len(shards):05d}.safetensors", arrays, row_start))
            pending, row_start = [], end
    return {"sequences": n, "tokens": int(mask.sum()), "shards": shards}


def build_cache(cfg: CacheBuildConfig, log: Callable[[str], None] = print) -> Path:
    """Run the teacher over the corpus once and write the cache. Returns the manifest path.

    Raises:
        ValueError: missing teacher or data, empty corpus, seq_len beyond the teacher's context, an
            existing cache in `out` without `overwrite`, top_k larger than the vocabulary.
    """
    out = Path(cfg.out)
    if (out / MANIFEST).exists() and not cfg.overwrite:
        raise ValueError(f"--out {out}: a cache already exists there; pass --overwrite or choose another folder")
    files = data.list_text_files(cfg.data)
    tokenizer = models.load_tokenizer(cfg.teacher)
    teacher = models.load_causal_lm(cfg.teacher)
    limit = models.max_positions(teacher)
    if limit is not None and cfg.seq_len > limit:
        raise ValueError(f"--seq-len {cfg.seq_len}: longer than the teacher's context ({limit} positions)")
    vocab = models.vocab_size(teacher)
    if cfg.top_k > vocab:
        raise ValueError(f"--top-k {cfg.top_k}: larger than the vocabulary ({vocab})")
    device = dev.resolve_device(cfg.device)
    teacher.to(device)

    docs = data.tokenized_documents(files, tokenizer, cfg.text_field)
    streams = data.split_token_streams(docs, tokenizer, cfg.holdout_fraction, cfg.max_tokens or None)
    if not streams["train"]:
        raise ValueError(f"--data {' '.join(cfg.data)}: no text found (empty corpus)")
    packed = {s: data.pack(streams[s], cfg.seq_len, pad_id=tokenizer.pad_token_id or 0) for s in data.SPLITS}
    total = sum(int(m.sum()) for _, m in packed.values())
    log(f"teacher {cfg.teacher} on {device}: {total:,} tokens, "
        + ", ".join(f"{s} {len(packed[s][0])} x {cfg.seq_len}" for s in data.SPLITS))

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()  # only reached with --overwrite or a folder holding no manifest
    started = time.perf_counter()
    with tqdm(total=total, unit="tok", unit_scale=True, desc="teacher") as progress:
        splits = {s: _build_split(teacher, device, s, *packed[s], cfg, out, progress) for s in data.SPLITS}
    elapsed = time.perf_counter() - started
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "teacher": models.model_fingerprint(teacher, cfg.teacher),
        "tokenizer_sha256": models.tokenizer_hash(tokenizer),
        "vocab_size": vocab,
        "seq_len": cfg.seq_len,
        "encoding": {"name": "topk", "top_k": cfg.top_k, "value_dtype": "float32", "id_dtype": "int32"},
        "splits": splits,
        "corpus_sha256": data.corpus_fingerprint(files),
        "builder": {"version": __version__, "args": asdict(cfg), "seconds": round(elapsed, 2),
                    "tokens_per_s": round(total / max(elapsed, 1e-9), 1)},
    }
    atomic_write_json(out / MANIFEST, manifest)
    log(f"wrote {out / MANIFEST} ({total / max(elapsed, 1e-9):,.0f} tok/s)")
    return out / MANIFEST


class KDCache:
    """Read-only view of a cache folder."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.exists():
            raise ValueError(f"--cache {self.path}: no {MANIFEST}; build one with `qat-lora build-cache`")
        self.manifest = json.loads(manifest_path.read_text())
        if self.manifest.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"--cache {self.path}: schema version {self.manifest.get('schema_version')}, this "
                             f"qat-lora reads {SCHEMA_VERSION}; rebuild the cache")

    @property
    def seq_len(self) -> int:
        return self.manifest["seq_len"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    def num_sequences(self, split: str) -> int:
        return self.manifest["splits"][split]["sequences"]

    def read_split(self, split: str) -> dict[str, torch.Tensor]:
        """All rows of one split as CPU tensors (ids int64, mask uint8, log-probs float32)."""
        if split not in self.manifest["splits"]:
            raise ValueError(f"--cache {self.path}: no split {split!r} (have {', '.join(self.manifest['splits'])})")
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in TENSOR_KEYS}
        for shard in self.manifest["splits"][split]["shards"]:
            file = self.path / shard["file"]
            if not file.exists():
                raise ValueError(f"--cache {self.path}: shard {shard['file']} is missing; rebuild the cache")
            tensors = load_file(str(file))
            for key in TENSOR_KEYS:
                parts[key].append(tensors[key])
        if not parts["input_ids"]:
            return {}
        out = {k: torch.cat(v) for k, v in parts.items()}
        out["input_ids"] = out["input_ids"].long()
        out["topk_ids"] = out["topk_ids"].long()
        return out

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


def batch_order(num_rows: int, *, seed: int, epoch: int, rank: int = 0, world_size: int = 1,
                shuffle: bool = True) -> torch.Tensor:
    """Row order for one epoch of one rank: a pure function of (seed, epoch, rank, world_size)."""
    if shuffle:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(num_rows, generator=generator)
    else:
        order = torch.arange(num_rows)
    return order[rank::world_size]


def iterate_batches(rows: dict[str, torch.Tensor], batch_size: int, order: torch.Tensor,
                    drop_last: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """Fixed-shape batches in `order`. With drop_last=False the last batch is padded with masked rows."""
    for start in range(0, len(order), batch_size):
        index = order[start:start + batch_size]
        if len(index) < batch_size:
            if drop_last:
                return
            batch = {k: v[index] for k, v in rows.items()}
            pad = batch_size - len(index)
            batch = {k: torch.cat([v, torch.zeros((pad, *v.shape[1:]), dtype=v.dtype)]) for k, v in batch.items()}
            yield batch
            return
        yield {k: v[index] for k, v in rows.items()}
