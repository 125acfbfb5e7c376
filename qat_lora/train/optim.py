"""The trainer's optimizer and learning-rate schedule."""
from __future__ import annotations

import math

import torch

from qat_lora.train.config import TrainConfig
from qat_lora.quant.fake_quant import latent_weights, quantised_layers, quantizer_parameters
from qat_lora.quant.state import norm_parameters


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to `min_ratio` at `max_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, params: dict[str, torch.nn.Parameter]
                    ) -> torch.optim.Optimizer:
    """AdamW in up to five groups (and one per other grid of a mixed preset: grid_rates): the adapter (--lr), the
    quantisers' scales and zeros (--lr x --quantizer-lr-ratio: Adam moves each parameter by about its rate per
    step, and a scale here is ~0.1, so the adapter's rate would move a grid by 1-2 % per step; its zeros / offsets
    at --zero-lr-ratio of that), trained latent weights (weight-qat; --lr x --weight-lr-ratio) and trained norms
    (--train-norms; the quantiser's rate: part of the base, as it is). None of the base's parameters decays: decay
    would pull them towards zero, off the grid the quantiser was fitted to (a norm gain, off its scale of ~1)."""
    weights = {id(p) for p in latent_weights(model) if p.requires_grad}
    quantizer = {id(p) for p in quantizer_parameters(model) if p.requires_grad}
    norms = {id(p) for p in norm_parameters(model).values() if p.requires_grad}
    # --zero-lr-ratio other than 1: the zeros / offsets in a group of their own (at 1 the group stays one, so the
    # optimizer state of a run written before the flag existed still loads)
    zeros = {id(p) for p in quantizer_parameters(model, names=("zero",)) if p.requires_grad} \
        if cfg.zero_lr_ratio != 1.0 else set()
    quantizer_lr = cfg.lr * cfg.quantizer_lr_ratio
    rates = grid_rates(model)
    groups = [{"params": [p for p in params.values() if id(p) not in weights | quantizer | norms]},
              {"params": [p for p in params.values() if id(p) in quantizer - zeros and id(p) not in rates],
               "lr": quantizer_lr, "weight_decay": 0.0},
              {"params": [p for p in params.values() if id(p) in weights], "lr": cfg.lr * cfg.weight_lr_ratio,
               "weight_decay": 0.0},
              {"params": [p for p in params.values() if id(p) in zeros], "lr": quantizer_lr * cfg.zero_lr_ratio,
               "weight_decay": 0.0},
              {"params": [p for p in params.values() if id(p) in norms], "lr": quantizer_lr, "weight_decay": 0.0}]
    for ratio in sorted(set(rates.values())):  # a mixed preset's other grids, each at its own rate
        chosen = [p for p in params.values() if rates.get(id(p)) == ratio and id(p) not in zeros]
        groups.append({"params": chosen, "lr": quantizer_lr * ratio, "weight_decay": 0.0})
    # CUDA: the fused kernel, one launch for every tensor instead of several per tensor (the same update, to
    # rounding). XLA traces the plain loop into the step's graph anyway; the CPU has no fused AdamW for fp32 here.
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params.values())
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, weight_decay=cfg.weight_decay,
                             fused=True if on_cuda else None)


def grid_rates(model: torch.nn.Module) -> dict[int, float]:
    """{id(parameter): rate multiplier} for the quantiser parameters of the layers a mixed preset's overrides
    quantise (every other student, per-channel and K-quant fallbacks included, gets none). Adam moves a parameter
    by about its rate per step whatever its size or reach: a scale is ~1 / (2^b - 1) of its group's range and moves
    all g weights of its group. (2^base - 1) / (2^b - 1) x g_base / g keeps each grid's step near the base's; at
    one rate for every scale w4g64-v8 diverged by step 16 (docs/RESULTS.md, "Where 4 bits lose")."""
    layers = list(quantised_layers(model).values())
    base = next((layer.cfg for layer in layers if layer.cfg.overrides), None)  # the preset's own layers keep it
    if base is None:
        return {}
    return {id(p): (2 ** base.bits - 1) / (2 ** layer.cfg.bits - 1)
            * (base.group_size or layer.in_features) / layer.group_size
            for layer in layers if not layer.cfg.overrides for p in layer.quant_parameters().values()}
