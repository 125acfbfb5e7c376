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

from qat_lora.runtime import device as dev

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

    def select(self, logits: torch.Tensor, seeds: list[int]) -> list[dict[str, np.ndarray]]:
        """select_on_device, then its results on the host in one transfer (on XLA the teacher's graph runs
        there, once)."""
        return self.host_rows(dev.to_host(self.select_on_device(logits, seeds)), len(seeds))

    @torch.no_grad()
    def select_on_device(self, logits: torch.Tensor, seeds: list[int]) -> list[torch.Tensor]:
        """On the teacher's device: logits [B, L, V] -> the top-K log-probs and ids [B, L, K] of every row, the
        padding rows after the first len(seeds) included (one graph shape for every batch on XLA); the seeds
        are not needed."""
        return list(torch.topk(torch.log_softmax(logits.float(), dim=-1), self.top_k, dim=-1))

    @staticmethod
    def host_rows(selected: list[torch.Tensor], rows: int) -> list[dict[str, np.ndarray]]:
        """select_on_device's tensors, on the host -> one dict per real row (the padding dropped)."""
        values, ids = selected
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

    def select(self, logits: torch.Tensor, seeds: list[int]) -> list[dict[str, np.ndarray]]:
        """Logits [B, L, V] -> per row of the first len(seeds) (the rest is padding) the draws [L, N]; only the
        [B, L, N] ids leave the device, in one transfer."""
        return self.host_rows(dev.to_host(self.select_on_device(logits, seeds)), len(seeds))

    @torch.no_grad()
    def select_on_device(self, logits: torch.Tensor, seeds: list[int]) -> list[torch.Tensor]:
        """Inverse-CDF sampling on the teacher's device: the uniforms come from one CPU generator per row, seeded
        by `seeds` (a row's draws never depend on which rows share its batch, and CPU, CUDA and XLA draw the
        same tokens up to the logits' rounding). Returns [draws [B, L, N]], padding rows included."""
        cdf = torch.softmax(logits.float(), dim=-1).cumsum_(-1)  # in place: one [B, L, V] float tensor, not two
        batch, length, vocab = cdf.shape
        uniforms = torch.zeros(batch, length, self.num_samples)
        for row, seed in enumerate(seeds):
            uniforms[row] = torch.rand(length, self.num_samples, generator=torch.Generator().manual_seed(seed))
        # Scaled by the row's own total, which rounding keeps near but not at 1: every draw lands in the vocabulary.
        targets = uniforms.to(cdf.device) * cdf[..., -1:]
        return [inverse_cdf(cdf, targets).clamp(max=vocab - 1)]

    @staticmethod
    def host_rows(selected: list[torch.Tensor], rows: int) -> list[dict[str, np.ndarray]]:
        """select_on_device's tensors, on the host -> one dict per real row (the padding dropped)."""
        return [{"draws": d.numpy()} for d in selected[0][:rows]]

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


def inverse_cdf(cdf: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """For a non-decreasing `cdf` [..., V] and `targets` [..., N]: how many cdf entries are <= each target
    (searchsorted's right-side index), i.e. the token whose CDF step holds the target. [..., N] int64."""
    if dev.searchsorted_is_native(cdf.device):
        return torch.searchsorted(cdf.contiguous(), targets.contiguous(), right=True)
    return blocked_count_at_most(cdf, targets)


def blocked_count_at_most(cdf: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """inverse_cdf without searchsorted (XLA has none): the vocabulary in ~sqrt(V) blocks; count the blocks
    whose last entry is <= the target, then the entries <= it inside the next block. Static shapes, and
    N x 2 sqrt(V) comparisons per position where a plain compare-and-sum would make N x V."""
    vocab = cdf.shape[-1]
    block = math.isqrt(vocab - 1) + 1
    num_blocks = -(-vocab // block)
    if num_blocks * block > vocab:  # padding above every target: never counted
        cdf = torch.nn.functional.pad(cdf, (0, num_blocks * block - vocab), value=float("inf"))
    lead = cdf.shape[:-1]
    blocks = cdf.reshape(-1, num_blocks, block)  # [R, blocks, block]
    flat_targets = targets.reshape(blocks.shape[0], -1)  # [R, N]
    whole = (blocks[:, :, -1].unsqueeze(1) <= flat_targets.unsqueeze(-1)).sum(-1)  # [R, N] blocks wholly <= target
    chosen = whole.clamp(max=num_blocks - 1)
    rows = torch.arange(blocks.shape[0], device=cdf.device).unsqueeze(-1)
    inside = (blocks[rows, chosen] <= flat_targets.unsqueeze(-1)).sum(-1)  # [R, N]
    return (chosen * block + inside).reshape(*lead, -1)


def encoding_from_flags(name: str, top_k: int, value_bits: int, num_samples: int) -> TopKEncoding | SampledEncoding:
    """The encoding `--encoding name` chooses. Every target flag is range-checked, the other encoding's too: a bad
    value is refused even where it would not be used."""
    chosen = {"sampled": SampledEncoding(num_samples), "topk": TopKEncoding(top_k, value_bits)}
    if name not in chosen:
        raise ValueError(f"--encoding {name!r}: choose sampled or topk")
    return chosen[name]


def make_encoding(params: dict) -> TopKEncoding | SampledEncoding:
    """The encoding a manifest names (the CLI's flags: `encoding_from_flags`)."""
    kind = params.get("name")
    if kind == "topk":
        return TopKEncoding(params["top_k"], params.get("value_bits", 32))
    if kind == "sampled":
        return SampledEncoding(params["num_samples"])
    raise ValueError(f"unknown cache encoding {kind!r}: choose topk or sampled")
