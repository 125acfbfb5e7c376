"""Held-out quality metrics: perplexity on text, and KD loss / top-1 agreement on a cache's held-out split.

Used by the eval command, the trainer's periodic evaluation, export's merge report, the demo and the
benchmarks. Accumulated in fixed-shape batches through the same forward-to-loss path as training.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from tqdm import tqdm

from qat_lora.data import text as data

from qat_lora.runtime import device as dev
from qat_lora.runtime import precision

from qat_lora.data import models
from qat_lora.cache.reader import KDCache
from qat_lora.train.loss import KDLossConfig, forward_loss


def _summed(model, batches, loss_cfg: KDLossConfig, keys: tuple[str, ...], device: torch.device, amp_dtype,
            chunk_size: int | None, bar: tqdm | None = None, sharding: dict | None = None) -> dict[str, float]:
    """Sums of `keys` over every batch, in float64 ON THE HOST (`bar`: ticked once per batch, then closed;
    `sharding`: each batch's layout over an SPMD process's devices, as training's batches).

    Each batch's sums stay on the device in fp32 (exact for its token counts) and are read in ONE transfer at
    the end: a float64 accumulator on the device would be fp32 on a TPU (which stores f64 as f32), where
    counts past 2^24 tokens stop being exact; a read per batch would stall the device every batch.
    """
    chunk_size = precision.default_loss_chunk_size(device) if chunk_size is None or chunk_size < 0 else chunk_size
    per_batch = []
    with dev.device_batches(batches, device, sharding) as on_device:
        for batch in on_device:
            with precision.autocast(device, amp_dtype):  # as in training, so the eval loss is the training loss
                parts = forward_loss(model, batch, loss_cfg, chunk_size)
            per_batch.append(torch.stack([parts[k].float() for k in keys]))
            dev.sync(device)
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    if not per_batch:
        return dict.fromkeys(keys, 0.0)
    totals = np.sum([t.numpy().astype(np.float64) for t in dev.to_host(per_batch)], axis=0)
    return dict(zip(keys, totals.tolist()))


@torch.no_grad()
def perplexity(model, tokenizer, text: list[str], seq_len: int, max_tokens: int | None, batch_size: int,
               device: torch.device, decoding: data.TextDecoding = data.TextDecoding(), progress: bool = False,
               amp_dtype: torch.dtype | None = None, chunk_size: int | None = None) -> dict:
    """exp(mean next-token NLL) over non-overlapping windows of `seq_len` tokens of the given text.

    `decoding`: how the text files are decoded; `progress`: a bar on stderr, for commands a user watches;
    `amp_dtype`: the autocast dtype (training's, `precision.autocast_dtype`); `chunk_size`: positions per lm_head
    chunk (None: the device's default); none of them changes which tokens count.
    """
    limit = models.max_positions(model)
    if limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len}: longer than the model's context ({limit} positions)")
    stream = data.token_stream(data.list_text_files(text, "--text"), tokenizer, max_tokens, decoding=decoding)
    if len(stream) < 2:
        raise ValueError(f"--text {' '.join(text)}: no text found")
    input_ids, mask = data.pack(stream, seq_len, prefix=models.sequence_prefix(tokenizer))

    def batches():
        for start in range(0, len(input_ids), batch_size):
            ids = np.zeros((batch_size, seq_len), dtype=np.int64)  # fixed shape: the last batch is padded + masked
            real = np.zeros((batch_size, seq_len), dtype=np.uint8)
            ids[:len(input_ids[start:start + batch_size])] = input_ids[start:start + batch_size]
            real[:len(mask[start:start + batch_size])] = mask[start:start + batch_size]
            yield {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(real)}

    bar = tqdm(desc="perplexity", unit="batch", total=-(-len(input_ids) // batch_size), disable=not progress)
    sums = _summed(model, batches(), KDLossConfig(alpha=0.0), ("ce_sum", "ce_tokens"), device, amp_dtype, chunk_size,
                   bar)
    nll = sums["ce_sum"] / max(sums["ce_tokens"], 1.0)
    return {"ppl": math.exp(nll), "nll": nll, "tokens": int(sums["ce_tokens"])}


@torch.no_grad()
def kd_metrics(model, cache: KDCache, batch_size: int, device: torch.device, split: str = "heldout",
               progress: bool = False, amp_dtype: torch.dtype | None = None, chunk_size: int | None = None,
               sharding: dict | None = None) -> dict:
    """Soft CE, KL over the K+1 buckets, hard CE and top-1 agreement with the teacher, token-averaged
    (`progress`, `amp_dtype`, `chunk_size` as in `perplexity`; `sharding`: the batches' layout over an SPMD
    process's devices, Backend.input_sharding, so each device evaluates its own rows as in training)."""
    if cache.num_sequences(split) == 0:
        raise ValueError(f"--cache {cache.path}: the {split} split is empty; rebuild with a larger "
                         "--holdout-fraction or --max-tokens")
    keys = ("soft_ce_sum", "kl_sum", "top1_sum", "ce_sum", "kd_tokens", "ce_tokens")
    bar = tqdm(desc=f"KD metrics ({split})", unit="batch", total=-(-cache.num_sequences(split) // batch_size),
               disable=not progress)
    values = _summed(model, cache.batches(split, batch_size, shuffle=False, drop_last=False), KDLossConfig(), keys,
                     device, amp_dtype, chunk_size, bar, sharding)
    kd_tokens, ce_tokens = max(values["kd_tokens"], 1.0), max(values["ce_tokens"], 1.0)
    return {"kd_soft_ce": values["soft_ce_sum"] / kd_tokens, "kd_kl": values["kl_sum"] / kd_tokens,
            "kd_top1": values["top1_sum"] / kd_tokens, "kd_ce": values["ce_sum"] / ce_tokens,
            "kd_tokens": int(values["kd_tokens"])}
