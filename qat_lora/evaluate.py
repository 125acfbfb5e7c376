"""Held-out quality: perplexity on text, and KD loss / top-1 agreement on the cache's held-out split.

    qat-lora eval --model M --quant w3g64 --adapter runs/w3g64/adapter --text wiki.txt --cache caches/kd
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from . import data, device as dev, models
from .files import atomic_write_json
from .cache import KDCache
from .lora import load_recovery_lora
from .loss import KDLossConfig
from .train import build_student, forward_loss, resolve_attn

EVAL_CHUNK = 128  # positions per lm_head chunk: bounds eval memory without changing any value


@dataclass
class EvalConfig:
    model: str = field(default="", metadata={"help": "full-precision model (folder, .gguf or hub name)"})
    quant: str = field(default="", metadata={"help": "quantisation preset; empty = evaluate the model unquantised"})
    adapter: str = field(default="", metadata={"help": "PEFT adapter folder (a run's adapter/) to attach"})
    quantizer: str = field(default="", metadata={"help": "a qat run's quantizer.safetensors to load into the student"})
    text: list[str] = field(default_factory=list, metadata={"help": "held-out text files or folders for perplexity"})
    cache: str = field(default="", metadata={"help": "KD cache whose held-out split gives KD loss and top-1"})
    seq_len: int = field(default=512, metadata={"help": "perplexity context (non-overlapping windows)"})
    max_tokens: int = field(default=20_000, metadata={"help": "perplexity token budget (0 = all)"})
    batch_size: int = field(default=4, metadata={"help": "sequences per forward"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, xla or tpu"})
    json_out: str = field(default="", metadata={"help": "write the results here as JSON"})

    def __post_init__(self) -> None:
        if not self.text and not self.cache:
            raise ValueError("eval: pass --text (perplexity) and/or --cache (KD metrics)")
        if (self.adapter or self.quantizer) and not self.quant:
            flag = "--adapter" if self.adapter else "--quantizer"
            raise ValueError(f"{flag} needs --quant: it belongs to a quantised student (pass the run's --quant)")


@torch.no_grad()
def perplexity(model, tokenizer, text: list[str], seq_len: int, max_tokens: int | None, batch_size: int,
               device: torch.device) -> dict:
    """exp(mean next-token NLL) over non-overlapping windows of `seq_len` tokens of the given text."""
    limit = models.max_positions(model)
    if limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len}: longer than the model's context ({limit} positions)")
    stream = data.token_stream(data.list_text_files(text), tokenizer, max_tokens)
    if len(stream) < 2:
        raise ValueError(f"--text {' '.join(text)}: no text found")
    input_ids, mask = data.pack(stream, seq_len)
    nll_sum = torch.zeros((), device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.float64)
    for start in range(0, len(input_ids), batch_size):
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
def kd_metrics(model, cache: KDCache, batch_size: int, device: torch.device, split: str = "heldout") -> dict:
    """Soft CE, KL over the K+1 buckets, hard CE and top-1 agreement with the teacher, token-averaged."""
    if cache.num_sequences(split) == 0:
        raise ValueError(f"--cache {cache.path}: the {split} split is empty; rebuild with a larger "
                         "--holdout-fraction or --max-tokens")
    keys = ("soft_ce_sum", "kl_sum", "top1_sum", "ce_sum", "kd_tokens", "ce_tokens")
    sums = {k: torch.zeros((), device=device, dtype=torch.float64) for k in keys}
    for batch in cache.batches(split, batch_size, shuffle=False, drop_last=False):
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


def load_model_for_eval(model: str, quant: str = "", adapter: str = "", attn_implementation: str = "sdpa",
                        quantizer: str = ""):
    """Teacher (no quant), PTQ student (quant), or trained student (quant + a qat run's quantizer and/or a
    recovery adapter), in eval mode."""
    if not quant:
        return models.load_causal_lm(model, attn_implementation=attn_implementation).eval()
    student = build_student(model, quant, attn_implementation, quantizer)
    if adapter:
        student = load_recovery_lora(student, adapter)
    return student.eval()


def evaluate(cfg: EvalConfig, log=print) -> dict:
    """Run the metrics `cfg` asks for; returns (and optionally writes) a JSON-ready dict."""
    device = dev.resolve_device(cfg.device)
    tokenizer = models.load_tokenizer(cfg.model)
    model = load_model_for_eval(cfg.model, cfg.quant, cfg.adapter, resolve_attn("auto", device),
                                cfg.quantizer).to(device)
    result: dict = {"model": cfg.model, "quant": cfg.quant or None, "adapter": cfg.adapter or None,
                    "quantizer": cfg.quantizer or None}
    if cfg.text:
        result.update(perplexity(model, tokenizer, cfg.text, cfg.seq_len, cfg.max_tokens or None,
                                 cfg.batch_size, device))
    if cfg.cache:
        cache = KDCache(cfg.cache)
        cache.check_compatible(tokenizer, models.vocab_size(model), models.max_positions(model))
        result.update(kd_metrics(model, cache, cfg.batch_size, device))
    if cfg.json_out:
        atomic_write_json(cfg.json_out, {**result, "config": asdict(cfg)})
    log(json.dumps(result, indent=2))
    return result
