"""Carrying the recovery adapter into an export (issue 18, item 3): beside the base, merged into the grid, or
merged in full precision; and the held-out report that says whether a merge kept the recovery.

    unmerged:  the base as exported (LoRA wrappers removed, nothing merged) + adapter/ in PEFT's own format,
               so `PeftModel.from_pretrained(base, adapter/)` over the exported base reproduces the student
    grid:      Wq' = Q(Wq + dW) with the base's scales: small, but re-quantisation can erase dW (the report's
               `requant_rel_error` = ||Wq' - (Wq + dW)|| / ||dW|| near 1 means the adapter is gone)
    full:      W = Wq + dW in full precision, a plain transformers folder: exact, and NOT smaller than the model

`recovery_kept` = (KL_base - KL_merged) / (KL_base - KL_student) on the cache's held-out split: 1 keeps all
the adapter gained over the quantised base, 0 none.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from qat_lora.cache.reader import KDCache
from qat_lora.runtime import device as dev
from qat_lora.train.metrics import kd_metrics
from qat_lora.quant.fake_quant import FakeQuantLinear, quantised_layers
from qat_lora.quant.lora_layer import dense_merge, lora_delta, requantize_

KEEP_THRESHOLD = 0.5  # a merge that keeps less than half of the adapter's gain is not called good


def _lora_modules(peft_model):
    """(module, its FakeQuantLinear base) for every LoRA-wrapped quantised linear."""
    for module in peft_model.modules():
        base = getattr(module, "base_layer", None)
        if isinstance(base, FakeQuantLinear) and getattr(module, "lora_A", None):
            yield module, base


@torch.no_grad()
def merge_lora_(peft_model) -> tuple[nn.Module, dict]:
    """Merge each LoRA adapter into its quantised base and re-quantise with the base's scales
    (quant/lora_layer.requantize_, which `QuantLoraLinear.merge(grid=True)` runs too).

    Returns:
        (the unwrapped student, {"requant_rel_error": ||Wq' - (Wq + dW)||_F / ||dW||_F over all layers,
         "merged_layers": count}); the error is what re-quantisation adds on top of the adapter.
    """
    err2 = delta2 = 0.0
    merged = 0
    for module, base in _lora_modules(peft_model):
        delta = lora_delta(module)
        target = requantize_(base, delta)  # the latent weight: a following re-snap stage starts from Wq + dW
        err2 += float(((base.quantized_weight() - target) ** 2).sum())
        delta2 += float((delta**2).sum())
        merged += 1
    student = peft_model.unload()
    return student, {"requant_rel_error": math.sqrt(err2 / max(delta2, 1e-30)), "merged_layers": merged}


@torch.no_grad()
def merge_full_(peft_model) -> nn.Module:
    """Replace each adapted quantised linear by a plain nn.Linear holding Wq + dW (full precision), in place;
    any quantised linear without an adapter becomes its Wq. Returns the unwrapped plain transformers model: what
    `merge_and_unload()` gives over QuantLoraLinear (quant/lora_layer.dense_merge, both), the rest made dense."""
    for module, base in _lora_modules(peft_model):
        module.base_layer = dense_merge(base, lora_delta(module))
    model = peft_model.unload()
    for name, layer in quantised_layers(model).items():  # collected before the loop replaces them
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer.to_linear())
    return model


HOST = torch.device("cpu")


def heldout_metrics(model, cache_dir: str, batch_size: int, device: torch.device = HOST,
                    amp_dtype: torch.dtype | None = None) -> dict:
    """KL to the teacher, soft CE and perplexity (exp of the hard CE) on the cache's held-out split: eval's
    kd_metrics with its forwards on `device` under `amp_dtype` autocast (precision.autocast_dtype); the model is
    back on the host when it returns."""
    with dev.model_on(model, device):
        return _heldout(model, cache_dir, batch_size, device, amp_dtype)


def student_and_base_metrics(peft_model, cache_dir: str, batch_size: int, device: torch.device = HOST,
                             amp_dtype: torch.dtype | None = None) -> dict:
    """Held-out metrics of the trained student (adapter on) and of its quantised base (adapter off), as
    `heldout_metrics` (one move to `device` and back for both)."""
    with dev.model_on(peft_model, device):
        student = _heldout(peft_model, cache_dir, batch_size, device, amp_dtype)
        with peft_model.disable_adapter():
            base = _heldout(peft_model, cache_dir, batch_size, device, amp_dtype)
    return {"student": student, "base": base}


def _heldout(model, cache_dir: str, batch_size: int, device: torch.device, amp_dtype: torch.dtype | None) -> dict:
    m = kd_metrics(model, KDCache(cache_dir), batch_size, device, amp_dtype=amp_dtype)
    return {"kd_kl": m["kd_kl"], "kd_soft_ce": m["kd_soft_ce"], "ppl": math.exp(m["kd_ce"])}


def recovery_verdict(measured: dict, merged: dict, name: str) -> dict:
    """How much of the adapter's gain over the quantised base a merged model keeps (KL on held-out data).

    Args:
        measured: `student_and_base_metrics`; merged: `heldout_metrics` of the merged model; name: the merge.
    Returns:
        {"merged": metrics, "recovery_kept": fraction, "good": kept >= KEEP_THRESHOLD, "verdict": one line}.
    """
    base, student = measured["base"]["kd_kl"], measured["student"]["kd_kl"]
    gain = base - student
    kept = (base - merged["kd_kl"]) / gain if gain > 0 else float("nan")
    good = gain > 0 and kept >= KEEP_THRESHOLD
    if gain <= 0:
        verdict = f"{name}: the adapter does not beat its quantised base on held-out KL; nothing to keep"
    elif good:
        verdict = f"{name}: keeps {kept:.0%} of the adapter's recovery (KL {student:.4f} -> {merged['kd_kl']:.4f})"
    else:
        verdict = (f"WARNING {name}: keeps only {kept:.0%} of the adapter's recovery (KL base {base:.4f}, student "
                   f"{student:.4f}, merged {merged['kd_kl']:.4f}); deploy the unmerged adapter, --merge-fp, or "
                   "add --resnap-steps")
    return {"merged": merged, "recovery_kept": kept, "good": good, "verdict": verdict}
