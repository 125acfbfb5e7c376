"""Data-aware statistics of a full-precision model's linear inputs, for data-aware quantiser initialisation.

`activation_importance` gives each input column of every linear a weight (its mean squared activation on
calibration text), which the MSE clipping search and k-means use to weigh the reconstruction error
(AWQ-style: columns that see large activations matter more).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .quant import QuantConfig, get_preset


@torch.no_grad()
def activation_importance(model: nn.Module, batches: Iterable[torch.Tensor], config: QuantConfig | str) -> dict[str, torch.Tensor]:
    """Mean squared input activation per column of every Linear `config` would quantise (data-aware init).

    Args:
        batches: input_ids tensors [B, L] run through the full-precision model.
    Returns:
        {module name: [in] float32} to pass to `quantize_(..., importance=...)`.
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
        for input_ids in batches:
            model(input_ids=input_ids)
    finally:
        for h in handles:
            h.remove()
    return {name: (sums[name] / counts[name]).cpu() for name in sums}
