"""Held-out quality metrics: perplexity on text, and KD loss / top-1 agreement on a cache's held-out split.

Used by the eval command, the trainer's periodic evaluation, export's merge report, the demo and the
benchmarks. Accumulated in fixed-shape batches through the same forward-to-loss path as training.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from tqdm import tqdm

from . import data, device as dev, models
from .cache import KDCache
from .loss import KDLossConfig, forward_loss

EVAL_CHUNK = 128  # positions per lm_head chunk: bounds eval memory without changing any value


@torch.no_grad()
def perplexity(model, tokenizer, text: list[str], seq_len: int, max_tokens: int | None, batch_size: int,
               device: torch.device, decoding: data.TextDecoding = data.TextDecoding(), progress: bool = False) -> dict:
    """exp(mean next-token NLL) over non-overlapping windows of `seq_len` tokens of the given text (`progress`:
    a bar on stderr, for commands a user watches)."""
    limit = models.max_positions(model)
    if limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len}: longer than the model's context ({limit} positions)")
    stream = data.token_stream(data.list_text_files(text, "--text"), tokenizer, max_tokens, decoding=decoding)
    if len(stream) < 2:
        raise ValueError(f"--text {' '.join(text)}: no text found")
    input_ids, mask = data.pack(stream, seq_len)
    nll_sum = torch.zeros((), device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.float64)
    for start in tqdm(range(0, len(input_ids), batch_size), desc="perplexity", unit="batch", disable=not progress):
        ids = np.zeros((batch_size, seq_len), dtype=np.int64)  # fixed shape: the last batch is padded + masked
        real = np.zeros((batch_size, seq_len), dtype=np.uint8)
        ids[:len(input_ids[start:start + batch_size])] = input_ids[start:start + batch_size]
        real[:len(mask[start:start + batch_size])] = mask[start:start + batch_size]
        batch = {"input_ids": torch.from_numpy(ids).to(device), "attention_mask": torch.from_numpy(real).to(device)}
        parts = forward_loss(model, batch, KDLossConfig(alpha=0.0), EVAL_CHUNK)
        nll_sum += parts["ce_sum"].double()
        count += parts["ce_tokens"].double()
        dev.sync(device)
    nll = float(nll_sum) / max(float(count), 1.0)
    return {"ppl": math.exp(nll), "nll": nll, "tokens": int(count)}


@torch.no_grad()
def kd_metrics(model, cache: KDCache, batch_size: int, device: torch.device, split: str = "heldout",
               progress: bool = False) -> dict:
    """Soft CE, KL over the K+1 buckets, hard CE and top-1 agreement with the teacher, token-averaged."""
    if cache.num_sequences(split) == 0:
        raise ValueError(f"--cache {cache.path}: the {split} split is empty; rebuild with a larger "
                         "--holdout-fraction or --max-tokens")
    keys = ("soft_ce_sum", "kl_sum", "top1_sum", "ce_sum", "kd_tokens", "ce_tokens")
    sums = {k: torch.zeros((), device=device, dtype=torch.float64) for k in keys}
    batches = cache.batches(split, batch_size, shuffle=False, drop_last=False)
    for batch in tqdm(batches, desc=f"KD metrics ({split})", unit="batch", disable=not progress,
                      total=-(-cache.num_sequences(split) // batch_size)):
        batch = {k: v.to(device) for k, v in batch.items()}
        parts = forward_loss(model, batch, KDLossConfig(), EVAL_CHUNK)
        for k in keys:
            sums[k] += parts[k].double()
        dev.sync(device)
    values = {k: float(v) for k, v in sums.items()}
    kd_tokens, ce_tokens = max(values["kd_tokens"], 1.0), max(values["ce_tokens"], 1.0)
    return {"kd_soft_ce": values["soft_ce_sum"] / kd_tokens, "kd_kl": values["kl_sum"] / kd_tokens,
            "kd_top1": values["top1_sum"] / kd_tokens, "kd_ce": values["ce_sum"] / ce_tokens,
            "kd_tokens": int(values["kd_tokens"])}
