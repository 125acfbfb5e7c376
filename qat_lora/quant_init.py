"""Initialisation of quantiser parameters (DESIGN §4): round-to-nearest, MSE-optimal clipping search, and
(weighted) 1-D k-means for LUT codebooks.

These run once, on the CPU, before training: they may branch on values freely. Every function takes an
optional per-input-column `importance` ([in], e.g. the mean squared activation from a few calibration batches,
as in AWQ/GPTQ-style data-aware PTQ) that weights the reconstruction error; None weights all columns equally.
"""
from __future__ import annotations

import torch

CLIP_GRID = 20  # clipping ratios tried per group by the MSE search (1.0 down to MIN_CLIP)
MIN_CLIP = 0.35
KMEANS_ITERS = 30
SCALE_FLOOR = torch.finfo(torch.float16).tiny  # smallest normal fp16: all-zero groups stay finite in fp16


def snap_fp16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest fp16 value, kept in x's dtype (what the export stores)."""
    return x.to(torch.float16).to(x.dtype)


def _grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    return weight.detach().float().reshape(weight.shape[0], -1, group_size)  # [out, groups, G]


def _importance(importance: torch.Tensor | None, weight: torch.Tensor, group_size: int) -> torch.Tensor:
    if importance is None:
        return torch.ones(1, 1, 1)
    return importance.detach().float().reshape(1, -1, group_size)  # [1, groups, G]


def _int_scale_zero(wmin: torch.Tensor, wmax: torch.Tensor, qmin: int, qmax: int,
                    symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16-representable scale and integer zero for a [lo, hi] range per group."""
    if symmetric:
        scale = torch.maximum(wmax.abs(), wmin.abs()) / ((qmax - qmin) / 2)
        scale = snap_fp16(scale.clamp(min=SCALE_FLOOR))
        return scale, torch.zeros_like(scale)
    wmin, wmax = wmin.clamp(max=0), wmax.clamp(min=0)
    scale = snap_fp16(((wmax - wmin) / (qmax - qmin)).clamp(min=SCALE_FLOOR))
    zero = torch.round(-wmin / scale).clamp(qmin, qmax)
    return scale, zero


def _int_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int,
               imp: torch.Tensor) -> torch.Tensor:
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
    wq = (torch.clamp(torch.round(w / s) + z, qmin, qmax) - z) * s
    return ((wq - w) ** 2 * imp).sum(-1)  # [out, groups]


def rtn_scale_zero(weight: torch.Tensor, bits: int, symmetric: bool, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest initialisation: min/max per group.

    Args:
        weight: [out, in] full-precision weight.
    Returns:
        scale, zero: [out, in // group_size] fp32 each; scale is fp16-representable, zero integer (0 if symmetric).
    """
    qmin, qmax = _int_range(bits, symmetric)
    w = _grouped(weight, group_size)
    return _int_scale_zero(w.amin(-1), w.amax(-1), qmin, qmax, symmetric)


def mse_scale_zero(weight: torch.Tensor, bits: int, symmetric: bool, group_size: int,
                   importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MSE-optimal clipping: per group, shrink the [min, max] range by each ratio of a grid and keep the
    ratio whose quantise-dequantise error (importance-weighted) is smallest. Never worse than RTN (ratio 1).

    Args:
        weight: [out, in]; importance: [in] or None.
    Returns:
        scale, zero: [out, in // group_size] as in `rtn_scale_zero`.
    """
    qmin, qmax = _int_range(bits, symmetric)
    w = _grouped(weight, group_size)
    imp = _importance(importance, weight, group_size)
    wmin, wmax = w.amin(-1), w.amax(-1)
    best_scale, best_zero = _int_scale_zero(wmin, wmax, qmin, qmax, symmetric)
    best_err = _int_error(w, best_scale, best_zero, qmin, qmax, imp)
    for ratio in torch.linspace(1.0, MIN_CLIP, CLIP_GRID)[1:].tolist():
        scale, zero = _int_scale_zero(wmin * ratio, wmax * ratio, qmin, qmax, symmetric)
        err = _int_error(w, scale, zero, qmin, qmax, imp)
        better = err < best_err
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
        best_err = torch.where(better, err, best_err)
    return best_scale, best_zero


def _int_range(bits: int, symmetric: bool) -> tuple[int, int]:
    return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)


def lut_scale(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group absmax scale ([out, groups], fp16-representable): normalised weights lie in [-1, 1]."""
    return snap_fp16(_grouped(weight, group_size).abs().amax(-1).clamp(min=SCALE_FLOOR))


def weighted_kmeans_1d(x: torch.Tensor, weights: torch.Tensor, k: int, iters: int = KMEANS_ITERS) -> torch.Tensor:
    """Lloyd's algorithm on scalars, batched: `k` centroids per row minimising sum w * (x - c)^2.

    Args:
        x: [B, N] values; weights: [B, N] non-negative (broadcastable).
    Returns:
        [B, k] sorted centroids. Initialised at weighted quantiles, so the result is deterministic.
    """
    weights = torch.broadcast_to(weights, x.shape)
    order = x.argsort(-1)
    xs, ws = x.gather(-1, order), weights.gather(-1, order)
    cdf = ws.cumsum(-1) / ws.sum(-1, keepdim=True).clamp(min=1e-30)
    targets = (torch.arange(k, dtype=x.dtype) + 0.5) / k
    idx = torch.searchsorted(cdf.contiguous(), targets.expand(x.shape[0], k).contiguous()).clamp(max=x.shape[1] - 1)
    centroids = xs.gather(-1, idx)
    for _ in range(iters):
        mids = (centroids[:, 1:] + centroids[:, :-1]) / 2
        assign = torch.searchsorted(mids.contiguous(), x.contiguous())  # [B, N] nearest centroid
        total = torch.zeros_like(centroids).scatter_add_(1, assign, weights * x)
        mass = torch.zeros_like(centroids).scatter_add_(1, assign, weights)
        centroids = torch.where(mass > 0, total / mass.clamp(min=1e-30), centroids).sort(-1).values
    return centroids


def kmeans_codebook(weight: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int, per_group: bool,
                    importance: torch.Tensor | None = None) -> torch.Tensor:
    """k-means codebook of 2^bits values over the normalised weights W / s (weighted by importance).

    Args:
        weight: [out, in]; scale: [out, groups]; importance: [in] or None.
    Returns:
        codebook: [out, groups, 2^bits] (per_group) or [1, 1, 2^bits], fp16-representable and sorted.
    """
    v = _grouped(weight, group_size) / scale.unsqueeze(-1)  # [out, groups, G]
    imp = _importance(importance, weight, group_size).expand_as(v)
    k = 2**bits
    if per_group:
        flat = weighted_kmeans_1d(v.reshape(-1, group_size), imp.reshape(-1, group_size), k)
        return snap_fp16(flat.reshape(v.shape[0], v.shape[1], k))
    return snap_fp16(weighted_kmeans_1d(v.reshape(1, -1), imp.reshape(1, -1), k).reshape(1, 1, k))


def uniform_codebook(bits: int, per_group_shape: tuple[int, int] | None = None) -> torch.Tensor:
    """The round-to-nearest LUT: 2^bits evenly spaced values over [-1, 1]."""
    grid = snap_fp16(torch.linspace(-1.0, 1.0, 2**bits))
    if per_group_shape is None:
        return grid.reshape(1, 1, -1)
    return grid.expand(*per_group_shape, -1).clone()
