"""The grids' arithmetic, stateless: a weight fake-quantised onto a layer's grid (Wq, with straight-through
gradients), its integer codes, and Wq rebuilt from codes, for every scheme; FakeQuantLinear holds the parameters.

    int:  Wq = s * (clamp(round(W / s) + z, qmin, qmax) - z)       groups of G input columns
          Wq = s * clamp(round((W - m) / s), qmin, qmax) + m      zero_domain float (m: fp16 offset, llama.cpp Q4_1)
    lut:  Wq = s * LUT[nearest(W / s)]                             2^b-entry codebook, per tensor or group

`round`/`nearest` use a straight-through estimator, so scales s, zeros z and codebooks receive LSQ-style
gradients (Esser et al., 2020). Optional low-rank scales multiply the group scales by (1 + A @ B)
(A: [out, r], B: [r, in]; Apple/Anemll style) without running r matmuls. Scales, codebooks and low-rank
factors are always used at fp16 precision (snapped with an STE), which is what the export stores: dequantising
the export therefore reproduces the training-time Wq bit for bit. llama.cpp's K-quants: kquant.py.
"""
from __future__ import annotations

import torch

from qat_lora.runtime import device as dev

from qat_lora.quant import kquant

from qat_lora.quant import inits as quant_init
from qat_lora.quant.config import QuantConfig


_round_ste, _fp16_ste = quant_init.round_ste, quant_init.fp16_ste  # shared with kquant.py


def effective_scale(scale: torch.Tensor, scale_a: torch.Tensor | None, scale_b: torch.Tensor | None,
                    group_size: int) -> torch.Tensor:
    """Per-group scales, optionally times low-rank factors; the one formula training and export share.

    Args:
        scale: [out, groups]; scale_a: [out, r] or None; scale_b: [r, in] or None.
    Returns:
        [out, groups, 1] (no low-rank factors) or [out, groups, G].
    """
    s = _fp16_ste(scale).unsqueeze(-1)
    if scale_a is None:
        return s
    low_rank = _fp16_ste(scale_a) @ _fp16_ste(scale_b)  # [out, in]: one small matmul, not r big ones
    return s * (1.0 + low_rank.reshape(s.shape[0], s.shape[1], group_size))


def _zero_point(zero: torch.Tensor, zero_domain: str) -> torch.Tensor:
    """The zero the grid uses (QuantConfig.zero_domain): round(z) (int) or fp16(m) (float), both through an STE,
    or 0 (none): zero * 0 gives the parameter a gradient of exactly 0, so it stays 0 under AdamW too."""
    if zero_domain == "float":
        return _fp16_ste(zero)
    return zero * 0.0 if zero_domain == "none" else _round_ste(zero)


def fake_quantize(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int,
                  zero_domain: str = "int", hold_codes: bool = False) -> torch.Tensor:
    """Wq = s * (clamp(round(W/s) + round(z), qmin, qmax) - round(z)), group-wise, STE on both rounds; with
    zero_domain float Wq = s * clamp(round((W - m)/s), qmin, qmax) + m, m at fp16 (llama.cpp's Q4_1).

    Args:
        weight: [out, in]; scale: [out, groups] or [out, groups, G|1]; zero: [out, groups].
        hold_codes: s (and a float m) enter round's argument detached: d Wq / d s = the code (fake_quant.py).
    Returns:
        [out, in] fake-quantised weight in weight's dtype.
    """
    out_features, in_features = weight.shape
    groups = zero.shape[1]
    w = weight.reshape(out_features, groups, in_features // groups)
    s = scale.unsqueeze(-1) if scale.dim() == 2 else scale
    z = _zero_point(zero, zero_domain).unsqueeze(-1)
    s_in, z_in = (s.detach(), z.detach()) if hold_codes else (s, z)  # round's argument (same values either way)
    if zero_domain == "float":  # d * q, then + m, in that order: what gguf's dequantiser computes, so bit-exact
        wq = torch.clamp(_round_ste((w - z_in) / s_in), qmin, qmax) * s + z
    else:  # an integer zero stays in the argument: shifting it shifts the codes, and Wq does not change
        wq = (torch.clamp(_round_ste(w / s_in) + z, qmin, qmax) - z) * s
    return wq.reshape(out_features, in_features).to(weight.dtype)


def _lut_lookup(v: torch.Tensor, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest codebook entry of each value, without data-dependent shapes (sort, then searchsorted's left-side
    index over the midpoints; on XLA, which has no searchsorted, the same index as a compare-and-sum).

    Args:
        v: [out, groups, G]; codebook: [1, 1, K] or [out, groups, K].
    Returns:
        (values [out, groups, G], differentiable w.r.t. codebook; codes [out, groups, G] int64 into codebook)
    """
    ordered, order = codebook.sort(-1)
    ordered = ordered.expand(v.shape[0], v.shape[1], -1)
    mids = (ordered[..., 1:] + ordered[..., :-1]) / 2
    if dev.searchsorted_is_native(v.device):
        pos = torch.searchsorted(mids.detach().contiguous(), v.detach().contiguous())
    else:  # how many midpoints are < v: [out, groups, G, K-1] -> [out, groups, G], ties left as searchsorted's
        pos = (mids.detach().unsqueeze(-2) < v.detach().unsqueeze(-1)).sum(-1)
    return ordered.gather(-1, pos), order.expand(v.shape[0], v.shape[1], -1).gather(-1, pos)


def fake_quantize_lut(weight: torch.Tensor, scale: torch.Tensor, codebook: torch.Tensor,
                      hold_codes: bool = False) -> torch.Tensor:
    """Wq = s * LUT[nearest(W / s)]; STE passes W/s through (inside the codebook's range) to W and s.

    Args:
        weight: [out, in]; scale: [out, groups, G|1]; codebook: [1, 1, K] or [out, groups, K].
        hold_codes: s enters W / s detached: d Wq / d s = the code's value (fake_quant.py).
    Returns:
        [out, in] in weight's dtype.
    """
    out_features, in_features = weight.shape
    v = weight.reshape(out_features, scale.shape[1], -1) / (scale.detach() if hold_codes else scale)
    values, _ = _lut_lookup(v, codebook)
    lo = codebook.detach().amin(-1, keepdim=True)
    hi = codebook.detach().amax(-1, keepdim=True)
    vc = torch.clamp(v, lo, hi)
    q = values + (vc - vc.detach())  # forward: exactly values; backward: d/dv = 1 inside the range
    return (q * scale).reshape(out_features, in_features).to(weight.dtype)


def quantize_weight(weight: torch.Tensor, cfg: QuantConfig, group_size: int, hold_codes: bool = False,
                    **parameters: torch.Tensor) -> torch.Tensor:
    """Wq of `weight` [out, in] on the grid of `cfg` and a layer's quantiser `parameters` (its
    FakeQuantLinear.quant_parameters()), differentiable as the training forward needs."""
    if cfg.scheme == "kquant":
        return kquant.fake_quantize_kquant(weight, cfg, hold_codes, **parameters)
    scale = effective_scale(parameters["scale"], parameters.get("scale_a"), parameters.get("scale_b"), group_size)
    if cfg.scheme == "int":
        return fake_quantize(weight, scale, parameters["zero"], cfg.qmin, cfg.qmax, cfg.zero_domain, hold_codes)
    return fake_quantize_lut(weight, scale, _fp16_ste(parameters["codebook"]), hold_codes)


def weight_codes(weight: torch.Tensor, cfg: QuantConfig, group_size: int, **parameters: torch.Tensor) -> torch.Tensor:
    """Integer codes [out, in] (uint8, in [0, 2^bits)) of `weight` on the grid: `dequantize` maps them back to
    `quantize_weight`'s Wq."""
    if cfg.scheme == "kquant":
        return (kquant.codes(weight, cfg, **parameters) - cfg.qmin).to(torch.uint8)
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, -1, group_size)
    s = effective_scale(parameters["scale"], parameters.get("scale_a"), parameters.get("scale_b"), group_size)
    if cfg.scheme == "int":
        z = _zero_point(parameters["zero"], cfg.zero_domain).unsqueeze(-1)
        r = torch.round((w - z) / s) if cfg.zero_domain == "float" else torch.round(w / s) + z
        q = torch.clamp(r, cfg.qmin, cfg.qmax) - cfg.qmin
    else:
        _, q = _lut_lookup(w / s, quant_init.snap_fp16(parameters["codebook"]))
    return q.reshape(out_features, in_features).to(torch.uint8)


def dequantize(codes: torch.Tensor, cfg: QuantConfig, group_size: int, scale: torch.Tensor | None = None,
               zero: torch.Tensor | None = None, codebook: torch.Tensor | None = None,
               scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
               **kquant_parameters: torch.Tensor) -> torch.Tensor:
    """Rebuild Wq from integer codes with the same arithmetic as the training-time forward (bit-exact).

    Args:
        codes: [out, in] integers in [0, 2^bits); scale: [out, groups]; zero: [out, groups] (int scheme);
            codebook: [1, 1, K] or [out, groups, K] (lut); scale_a/scale_b: low-rank factors or None;
            kquant_parameters: kquant.PARAMETERS by name (scheme kquant; scale unused).
    Returns:
        [out, in] float32.
    """
    if cfg.scheme == "kquant":
        return kquant.dequantize(codes.float() + cfg.qmin, cfg, **kquant_parameters)
    f32 = [None if t is None else t.float() for t in (scale, zero, codebook, scale_a, scale_b)]
    scale, zero, codebook, scale_a, scale_b = f32
    out_features, in_features = codes.shape
    s = effective_scale(scale, scale_a, scale_b, group_size)
    c = codes.long().reshape(out_features, -1, group_size)
    if cfg.scheme == "int":
        z = _zero_point(zero, cfg.zero_domain).unsqueeze(-1)
        wq = (c + cfg.qmin).float() * s + z if cfg.zero_domain == "float" else ((c + cfg.qmin).float() - z) * s
    else:
        wq = codebook.expand(out_features, c.shape[1], -1).gather(-1, c) * s
    return wq.reshape(out_features, in_features)
