"""Target encodings of the KD cache (DESIGN §2; the on-disk spec is docs/cache-format.md).

Each encoding turns the teacher's logits for a batch of sequences into per-row numpy arrays (every row
decodable on its own, so the reader can memory-map and pick rows), and decodes rows back into
fixed-shape tensors for the loss:
- `topk`: the K largest teacher log-probs over the full vocabulary and their ids (tail mass implied).
  Values are float32 (exact), or an fp32 anchor (the top-1 log-prob) plus K deltas quantised to 16 or 8
  bits. Ids are bit-packed to ceil(log2 V) bits.
- `sampled` (RS-KD, Anshumann et al., ACL 2025): N draws with replacement from the teacher distribution,
  stored as the unique ids and their counts; the target c_i / N is unbiased for the full soft CE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import device as dev

# Delta step (nats) per value width. Decoded log-probs are within step/2 of the teacher's, so each stored
# probability is within a factor exp(step/2) of the truth: 16 bits: 1.00024 (range 32 nats below the
# top-1), 8 bits: 1.032 (range 15.9 nats; anything further is clamped to the range's end).
DELTA_STEP = {16: 1.0 / 2048.0, 8: 1.0 / 16.0}


def id_bits(vocab_size: int) -> int:
    return max(1, math.ceil(math.log2(vocab_size)))


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack non-negative integers (< 2**bits) into bytes, little-endian bit order. Returns uint8 [ceil(n*bits/8)]."""
    values = np.asarray(values, dtype=np.uint64).reshape(-1)
    planes = ((values[:, None] >> np.arange(bits, dtype=np.uint64)) & 1).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little")


def unpack_bits(data: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of pack_bits: the first `count` integers. Returns int64 [count]."""
    planes = np.unpackbits(np.asarray(data, dtype=np.uint8), count=count * bits, bitorder="little")
    weights = (1 << np.arange(bits, dtype=np.int64))
    return planes.reshape(count, bits).astype(np.int64) @ weights


@dataclass(frozen=True)
class TopKEncoding:
    """Top-K log-probs + ids. Tensors per row: `topk_ids_packed` [n, bytes] uint8, and `topk_logprobs`
    [n, L, K] float32 (value_bits 32) or `topk_anchor` [n, L] float32 + `topk_deltas` [n, L, K] uint16/uint8."""

    top_k: int
    value_bits: int = 32
    name: str = "topk"

    def __post_init__(self) -> None:
        if self.top_k <= 0:
            raise ValueError(f"--top-k {self.top_k}: must be positive")
        if self.value_bits not in (32, 16, 8):
            raise ValueError(f"--value-bits {self.value_bits}: choose 32 (exact), 16 or 8")

    def params(self) -> dict:
        return {"name": self.name, "top_k": self.top_k, "value_bits": self.value_bits}

    ragged_keys = ()

    @torch.no_grad()
    def select(self, logits: torch.Tensor, seeds: list[int]) -> list[dict[str, np.ndarray]]:
        """On the teacher's device: logits [B, L, V] -> the top-K log-probs and ids [L, K] of the first
        len(seeds) rows (the seeds are not needed otherwise). The rows after them are padding: the whole
        batch is selected (one graph shape for every batch on XLA) and the padding dropped on the host."""
        values, ids = torch.topk(torch.log_softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        values, ids = dev.to_host([values, ids])  # one transfer; on XLA the teacher's graph runs here, once
        rows = len(seeds)
        return [{"values": v, "ids": i} for v, i in zip(values[:rows].numpy(), ids[:rows].numpy())]

    def pack_row(self, selected: dict[str, np.ndarray], vocab_size: int) -> dict[str, np.ndarray]:
        """CPU side (the background writer): quantise values, bit-pack ids."""
        v = selected["values"]
        row = {"topk_ids_packed": pack_bits(selected["ids"], id_bits(vocab_size))}
        if self.value_bits == 32:
            row["topk_logprobs"] = v.astype(np.float32)
        else:
            step, dtype = DELTA_STEP[self.value_bits], np.uint16 if self.value_bits == 16 else np.uint8
            anchor = v[:, 0].astype(np.float32)
            row["topk_anchor"] = anchor
            row["topk_deltas"] = np.clip(np.rint((anchor[:, None] - v) / step), 0, np.iinfo(dtype).max).astype(dtype)
        return row

    def decode(self, row: dict[str, np.ndarray], seq_len: int, vocab_size: int) -> dict[str, torch.Tensor]:
        """One row's arrays -> `topk_ids` [L, K] int64 and `topk_logprobs` [L, K] float32."""
        ids = unpack_bits(row["topk_ids_packed"], id_bits(vocab_size), seq_len * self.top_k)
        if self.value_bits == 32:
            logprobs = np.asarray(row["topk_logprobs"], dtype=np.float32)
        else:
            step = DELTA_STEP[self.value_bits]
            logprobs = row["topk_anchor"][:, None] - np.asarray(row["topk_deltas"], dtype=np.float32) * np.float32(step)
        return {"topk_ids": torch.from_numpy(ids.reshape(seq_len, self.top_k)),
                "topk_logprobs": torch.from_numpy(np.ascontiguousarray(logprobs, dtype=np.float32))}


@dataclass(frozen=True)
class SampledEncoding:
    """N teacher samples per position as unique ids + counts. One variable-length byte string per row:
    L unique-counts (uint8), then the ids packed to ceil(log2 V) bits, then the counts packed to
    ceil(log2 (N+1)) bits, each part byte-aligned. Decoded to fixed [L, N] ids and weights (count / N)."""

    num_samples: int
    name: str = "sampled"

    def __post_init__(self) -> None:
        if not 1 <= self.num_samples <= 255:
            raise ValueError(f"--num-samples {self.num_samples}: must be in [1, 255]")

    def params(self) -> dict:
        return {"name": self.name, "num_samples": self.num_samples}

    @property
    def count_bits(self) -> int:
        return id_bits(self.num_samples + 1)

    ragged_keys = ("sample_data",)

    @torch.no_grad()
    def select(self, logits: torch.Tensor, seeds: list[int]) -> list[dict[str, np.ndarray]]:
        """Logits [B, L, V] -> per row of the first len(seeds) (the rest is padding) the draws [L, N], from one
        generator per row seeded by `seeds`, so a row's draws never depend on which rows share its batch.

        The draws happen on the teacher's device where it has generators (CPU, CUDA); on XLA, which has none,
        the logits come to the host in one transfer and are drawn there exactly as on the CPU.
        """
        if not dev.has_device_generator(logits.device):
            (logits,) = dev.to_host([logits])
        probs = torch.softmax(logits.float(), dim=-1)
        draws = [torch.multinomial(row_probs, self.num_samples, replacement=True,
                                   generator=torch.Generator(device=row_probs.device).manual_seed(seed))
                 for row_probs, seed in zip(probs, seeds)]
        return [{"draws": d.numpy()} for d in dev.to_host(draws)]

    def pack_row(self, selected: dict[str, np.ndarray], vocab_size: int) -> dict[str, np.ndarray]:
        ordered = np.sort(selected["draws"], axis=1)  # [L, N]
        starts = np.ones_like(ordered, dtype=bool)
        starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        unique_per_position = starts.sum(1).astype(np.uint8)
        flat_starts = np.flatnonzero(starts.reshape(-1))
        counts = np.diff(np.append(flat_starts, ordered.size))
        ids = ordered.reshape(-1)[flat_starts]
        return {"sample_data": np.concatenate([unique_per_position, pack_bits(ids, id_bits(vocab_size)),
                                               pack_bits(counts, self.count_bits)])}

    def decode(self, row: dict[str, np.ndarray], seq_len: int, vocab_size: int) -> dict[str, torch.Tensor]:
        """One row -> `sample_ids` [L, N] int64 and `sample_weights` [L, N] float32 (0 in unused slots)."""
        data = np.asarray(row["sample_data"], dtype=np.uint8)
        unique = data[:seq_len].astype(np.int64)
        total = int(unique.sum())
        id_bytes = -(-total * id_bits(vocab_size) // 8)
        ids = unpack_bits(data[seq_len:seq_len + id_bytes], id_bits(vocab_size), total)
        counts = unpack_bits(data[seq_len + id_bytes:], self.count_bits, total)
        slot = np.arange(total) - np.repeat(np.cumsum(unique) - unique, unique)  # index within its position
        position = np.repeat(np.arange(seq_len), unique)
        out_ids = np.zeros((seq_len, self.num_samples), dtype=np.int64)
        weights = np.zeros((seq_len, self.num_samples), dtype=np.float32)
        out_ids[position, slot] = ids
        weights[position, slot] = counts / self.num_samples
        return {"sample_ids": torch.from_numpy(out_ids), "sample_weights": torch.from_numpy(weights)}


def encode_rows(encoding, logits: torch.Tensor, vocab_size: int, seeds: list[int]) -> list[dict[str, np.ndarray]]:
    """select + pack_row in one call (tests and small tools)."""
    return [encoding.pack_row(row, vocab_size) for row in encoding.select(logits, seeds)]


def make_encoding(params: dict) -> TopKEncoding | SampledEncoding:
    """The encoding a manifest (or the CLI) names."""
    kind = params.get("name")
    if kind == "topk":
        return TopKEncoding(params["top_k"], params.get("value_bits", 32))
    if kind == "sampled":
        return SampledEncoding(params["num_samples"])
    raise ValueError(f"unknown cache encoding {kind!r}: choose topk or sampled")
