"""Data-aware statistics of a full-precision model's linear inputs, for data-aware quantiser initialisation.

`calibration_batches` takes the calibration text from a KD cache's training split. `activation_importance`
gives each input column of every linear a weight (its mean squared activation on calibration text), which the
MSE clipping search and k-means use to weigh the reconstruction error (AWQ-style: columns that see large
activations matter more).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from qat_lora.cache.reader import KDCache
from qat_lora.quant import blocks
from qat_lora.quant.fake_quant import QuantConfig, get_preset


@torch.no_grad()
def activation_importance(model: nn.Module, batches: Iterable[torch.Tensor], config: QuantConfig | str,
                          device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Mean squared input activation per column of every Linear `config` would quantise (data-aware init).

    The model runs one decoder layer at a time (quant/blocks.py), each on `device` (None: where it is) and back
    where it was: only that layer and its calibration activations (when they fit: `BlockInputs.kept_on`, else one
    batch at a time) are ever on the device. Linears outside the
    decoder layers (the lm_head, which presets leave in full precision) get no statistics.

    Args:
        batches: input_ids tensors [B, L] run through the full-precision model.
    Returns:
        {module name: [in] float32 CPU} to pass to `quantize_(..., importance=...)`.
    """
    cfg = get_preset(config) if isinstance(config, str) else config
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name):
        def accumulate(module, inputs, output):
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return accumulate

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if type(m) is nn.Linear and cfg.for_module(n) is not None]
    try:
        inputs = blocks.capture_block_inputs(model, list(batches)).kept_on(device)
        for layer in blocks.decoder_layers(model):
            home = next(layer.parameters()).device
            layer.to(device if device is not None else home)
            inputs = inputs.with_hidden(blocks.run_block(layer, inputs))
            layer.to(home)
    finally:
        for h in handles:
            h.remove()
    return {name: (sums[name] / counts[name]).cpu() for name in sums}


def calibration_batches(cache_dir: str, sequences: int, batch_size: int, flag: str = "--calib-sequences"
                        ) -> list[torch.Tensor]:
    """The first `sequences` training sequences of a KD cache as input_ids batches [B, L] (fixed order);
    `flag` is the option named when the cache holds fewer."""
    cache = KDCache(cache_dir)
    available = cache.num_sequences("train")
    if available < sequences:
        raise ValueError(f"{flag} {sequences}: the cache {cache_dir} holds {available} training "
                         "sequences; lower it or build a larger cache")
    out, taken = [], 0
    for batch in cache.batches("train", batch_size, shuffle=False, drop_last=False):
        keep = min(batch_size, sequences - taken)
        out.append(batch["input_ids"][:keep])
        taken += keep
        if taken >= sequences:
            break
    return out
