"""`qat-lora eval`: held-out perplexity on text and KD metrics on a cache's held-out split, as JSON.

    qat-lora eval --model M --quant w3g64 --adapter runs/w3g64/adapter --text wiki.txt --cache caches/kd
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Callable

from torch import nn

from qat_lora.runtime import device as dev
from qat_lora.runtime import precision, xla

from qat_lora.data import models
from qat_lora.cache.reader import KDCache
from qat_lora.commands.config import EVAL_KIND, EvalConfig
from qat_lora.runtime.files import atomic_write_json, owner_stamp
from qat_lora.runtime.runs import RunDiverged
from qat_lora.train.metrics import kd_metrics, perplexity
from qat_lora.quant.state import bits_per_weight
from qat_lora.train.config import StudentSpec
from qat_lora.train.student import adapter_bits_per_weight, load_student, resolve_attn


def evaluate(cfg: EvalConfig, log: Callable[[str], None] = print) -> dict:
    """Run the metrics `cfg` asks for; returns (and optionally writes) a JSON-ready dict. EvalConfig has checked
    the flags, --text, --adapter, --quantizer and --json-out already."""
    cache = KDCache(cfg.cache) if cfg.cache else None  # a bad cache fails before the model loads, too
    device = dev.resolve_device(cfg.device)
    if dev.is_xla(device):
        xla.init_xla_cache(cfg.xla_cache_dir)  # no-op when this process compiled already (a notebook's 2nd call)
    amp_dtype = precision.autocast_dtype(device, cfg.precision)  # training's default autocast: the same loss values
    tokenizer = models.load_tokenizer(cfg.model)
    model = dev.move_model_(load_model(cfg, resolve_attn("auto", device)), device)
    result: dict = {"model": cfg.model, "quant": cfg.quant or None, "adapter": cfg.adapter or None,
                    "quantizer": cfg.quantizer or None}
    if cfg.quant or models.is_packed_export(cfg.model):  # what the student weighs: the base's bits, and what an
        # unmerged adapter adds to them
        result.update(bits_per_weight=round(bits_per_weight(model), 4),
                      adapter_bits_per_weight=round(adapter_bits_per_weight(model), 4))
    if cfg.text:
        result.update(perplexity(model, tokenizer, cfg.text, cfg.seq_len, cfg.max_tokens or None,
                                 cfg.batch_size, device, cfg.text_decoding(), progress=True, amp_dtype=amp_dtype))
    if cache is not None:
        cache.check_compatible(tokenizer, models.vocab_size(model), models.max_positions(model))
        result.update(kd_metrics(model, cache, cfg.batch_size, device, progress=True, amp_dtype=amp_dtype))
    if cfg.json_out:  # a non-finite metric is written as null (valid JSON), then reported below
        atomic_write_json(cfg.json_out, {**owner_stamp(EVAL_KIND), **result, "config": asdict(cfg)})
    bad = [k for k, v in result.items() if isinstance(v, float) and not math.isfinite(v)]
    log(json.dumps({k: None if k in bad else v for k, v in result.items()}, indent=2))
    if bad:
        _report_non_finite(cfg, bad[0], result[bad[0]])
    return result


def load_model(cfg: StudentSpec, attn: str = "sdpa") -> nn.Module:
    """The model a command runs: the student built from model + preset + quantiser + adapter (`cfg.adapter`, if
    the config has one), a packed export (+ adapter), or any folder / .gguf transformers loads (quant empty)."""
    adapter = getattr(cfg, "adapter", "")
    if models.is_packed_export(cfg.model):
        from qat_lora.export.exporter import load_packed
        from qat_lora.train.lora import load_recovery_lora

        model = load_packed(cfg.model)
        return load_recovery_lora(model, adapter) if adapter else model
    return load_student(cfg.student_spec(), adapter, attn)


def _report_non_finite(cfg: EvalConfig, metric: str, value: float) -> None:
    """A NaN / inf metric is no result: the command fails (exit 1), naming the metric and its likely cause.

    Raises:
        RunDiverged: always.
    """
    suspects = " or ".join(f"{flag} {path}" for flag, path in (("--adapter", cfg.adapter),
                                                              ("--quantizer", cfg.quantizer)) if path)
    cause = (f"{suspects} likely holds NaN or inf weights (from a diverged run: use an earlier checkpoint)"
             if suspects else f"--model {cfg.model} likely holds NaN or inf weights")
    raise RunDiverged(f"{metric} is {value} (not finite): {cause}, or the forward overflowed (try --precision fp32)"
                      + (f"; {cfg.json_out} records it as null" if cfg.json_out else ""))
