"""llama.cpp's K-quant grids as trainable fake quantisation (DESIGN §9): Q2_K, Q3_K, Q4_K, Q6_K.

Along each weight row, 256-weight super-blocks hold one fp16 scale d (and, for Q2_K / Q4_K, one fp16 dmin) and
sub-blocks of 16 or 32 weights whose own scale sc and min m are small integers:

    s = d * sc,  m' = dmin * m            (fp32 products, as gguf's dequantiser computes them)
    Wq = s * clamp(round((W + m') / s), qmin, qmax) - m'

Trainable: the super-block d / dmin (used at fp16 through an STE) and the sub-block latents sc / m (rounded and
clamped to their integer range through an STE), so the quantised sub-block scales learn as LSQ scales do.
The forward does exactly the dequantiser's arithmetic, so the GGUF export of (d, sc, dmin, m, q) dequantises to
the student's Wq bit for bit. Parameter shapes: super_scale / super_min [out, in / 256], sub_scale / sub_min
[out, in / sub-block]. Rows not a multiple of 256 never get here: QuantConfig.for_width picks the fallback.
"""
from __future__ import annotations

import torch

from qat_lora.quant.config import QK_K, QuantConfig
from qat_lora.quant.inits import fp16_ste, round_ste, snap_fp16

PARAMETERS = ("super_scale", "sub_scale", "super_min", "sub_min")
# llama.cpp's make_qkx2_quants arguments per type (quantize_row_q2_K_ref / q4_K_ref): rmin, rdelta, nstep and
# whether the error is absolute (Q2_K) or squared (Q4_K).
AFFINE_SEARCH = {"Q2_K": (-0.5, 0.1, 15, True), "Q4_K": (-1.0, 0.1, 20, False)}
SYMMETRIC_STEPS = range(-9, 10)  # make_qx_quants tries iscale = -(nmax + 0.1 * step) / max for these steps


def parameter_shapes(cfg: QuantConfig, out_features: int, in_features: int) -> dict[str, tuple[int, int]]:
    """The quantiser parameters of a K-quant layer and their shapes."""
    kt = cfg.kquant
    shapes = {"super_scale": (out_features, in_features // QK_K),
              "sub_scale": (out_features, in_features // kt.sub_block)}
    if kt.min_max:
        shapes.update(super_min=shapes["super_scale"], sub_min=shapes["sub_scale"])
    return shapes


def _times_super(d: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    """d [out, supers] times each of its sub-block integers sub [out, subs] -> [out, subs], one fp32 product."""
    return (d.unsqueeze(-1) * sub.reshape(d.shape[0], d.shape[1], -1)).reshape(sub.shape)


def stored_parameters(cfg: QuantConfig, super_scale: torch.Tensor, sub_scale: torch.Tensor,
                      super_min: torch.Tensor | None = None, sub_min: torch.Tensor | None = None) -> dict:
    """The values the forward uses and the GGUF stores: fp16 d / dmin, integer sc / m (STE, differentiable).

    Returns:
        {"d", "sc"} and, with mins, {"dmin", "m"}; fp32, shapes as the parameters.
    """
    kt = cfg.kquant
    out = {"d": fp16_ste(super_scale), "sc": torch.clamp(round_ste(sub_scale), *kt.scale_range)}
    if kt.min_max:
        out.update(dmin=fp16_ste(super_min), m=torch.clamp(round_ste(sub_min), 0, kt.min_max))
    return out


def sub_block_grid(cfg: QuantConfig, **params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-sub-block scale d * sc and min dmin * m ([out, subs] each; the min None for Q3_K / Q6_K)."""
    p = stored_parameters(cfg, **params)
    s = _times_super(p["d"], p["sc"])
    return s, (_times_super(p["dmin"], p["m"]) if "m" in p else None)


def _codes(weight: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None, qmin: int, qmax: int) -> torch.Tensor:
    """q = clamp(round((W + m) / s)) [out, subs, G] (STE); a zero sub-block scale (sc rounded to 0) divides by
    1 instead, where every q gives the same Wq = -m, without a data-dependent branch."""
    w = weight.reshape(s.shape[0], s.shape[1], -1)
    s3 = s.unsqueeze(-1)
    safe = torch.where(s3 == 0, torch.ones_like(s3), s3)
    x = w / safe if m is None else (w + m.unsqueeze(-1)) / safe
    return torch.clamp(round_ste(x), qmin, qmax)


def _dequantize(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    # dl * q - ml, in that order: gguf's dequantize_blocks for Q2_K / Q4_K (Q3_K / Q6_K: dl * q).
    wq = q * s.unsqueeze(-1)
    return wq if m is None else wq - m.unsqueeze(-1)


def on_grid(weight: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None, cfg: QuantConfig) -> torch.Tensor:
    """Wq of weight [out, subs * G] on sub-block scales s and mins m ([out, subs], sub_block_grid's), the forward's
    arithmetic without gradients (GPTQ's columns: one sub-block of width 1)."""
    return _dequantize(_codes(weight, s, m, cfg.qmin, cfg.qmax), s, m).reshape(weight.shape)


def fake_quantize_kquant(weight: torch.Tensor, cfg: QuantConfig, hold_codes: bool = False,
                         **params: torch.Tensor) -> torch.Tensor:
    """The K-quant Wq of weight [out, in] (STE through the codes, the sub-block integers and d / dmin); with
    `hold_codes` the codes see s and m detached, so they get d Wq / d s = q, d Wq / d m = -1 (fake_quant.py's
    docstring)."""
    s, m = sub_block_grid(cfg, **params)
    q = _codes(weight, s.detach(), None if m is None else m.detach(), cfg.qmin, cfg.qmax) if hold_codes else \
        _codes(weight, s, m, cfg.qmin, cfg.qmax)
    return _dequantize(q, s, m).reshape(weight.shape).to(weight.dtype)


@torch.no_grad()
def codes(weight: torch.Tensor, cfg: QuantConfig, **params: torch.Tensor) -> torch.Tensor:
    """The signed integer codes q [out, in] (float32, in [qmin, qmax]) of the forward."""
    s, m = sub_block_grid(cfg, **params)
    return _codes(weight.float(), s, m, cfg.qmin, cfg.qmax).reshape(weight.shape)


def dequantize(q: torch.Tensor, cfg: QuantConfig, **params: torch.Tensor) -> torch.Tensor:
    """Wq [out, in] float32 from signed codes q [out, in], bit-exact with the forward."""
    s, m = sub_block_grid(cfg, **{k: v.float() for k, v in params.items()})
    return _dequantize(q.float().reshape(s.shape[0], s.shape[1], -1), s, m).reshape(q.shape)


def _affine_search(w: torch.Tensor, ew: torch.Tensor, nmax: int, init: str,
                   search: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block (scale, min) with w ~ scale * l - min, l in [0, nmax], min >= 0. rtn: min/max. ggml: the
    search of llama.cpp's make_qkx2_quants: for nstep + 1 stretched grids, round, refit scale and offset by
    weighted least squares (offset clamped to <= 0), keep the lowest weighted error (absolute or squared).

    Args:
        w, ew: [out, subs, G] weights and per-weight error weights.
    Returns:
        scale, min: [out, subs] fp32, both >= 0 (0, -lo for a flat sub-block).
    """
    lo = w.amin(-1, keepdim=True).clamp(max=0)
    span = w.amax(-1, keepdim=True) - lo
    flat = span == 0
    span = torch.where(flat, torch.ones_like(span), span)
    best_s, best_lo = span / nmax, lo
    if init == "ggml":
        rmin, rdelta, nstep, use_mad = search

        def error(scale, offset, levels):
            diff = scale * levels + offset - w
            return (ew * (diff.abs() if use_mad else diff * diff)).sum(-1, keepdim=True)

        best_e = error(best_s, best_lo, torch.clamp(torch.round(nmax / span * (w - lo)), 0, nmax))
        sw, sx = ew.sum(-1, keepdim=True), (ew * w).sum(-1, keepdim=True)
        for step in range(nstep + 1):
            levels = torch.clamp(torch.round((rmin + rdelta * step + nmax) / span * (w - lo)), 0, nmax)
            sl, sl2, sxl = ((ew * t).sum(-1, keepdim=True) for t in (levels, levels * levels, levels * w))
            det = sw * sl2 - sl * sl
            safe = torch.where(det > 0, det, torch.ones_like(det))
            scale, offset = (sw * sxl - sx * sl) / safe, (sl2 * sx - sl * sxl) / safe
            positive = offset > 0  # the grid must reach 0: refit the scale alone through the origin
            scale = torch.where(positive, sxl / torch.where(sl2 > 0, sl2, torch.ones_like(sl2)), scale)
            offset = torch.where(positive, torch.zeros_like(offset), offset)
            err = error(scale, offset, levels)
            better = (det > 0) & (err < best_e)
            best_s, best_lo, best_e = (torch.where(better, a, b) for a, b in
                                       ((scale, best_s), (offset, best_lo), (err, best_e)))
    best_s = torch.where(flat, torch.zeros_like(best_s), best_s)
    return best_s.squeeze(-1), (-best_lo).squeeze(-1)


def _symmetric_search(w: torch.Tensor, ew: torch.Tensor, nmax: int, init: str) -> torch.Tensor:
    """Per sub-block signed scale with w ~ scale * l, l in [-nmax, nmax - 1]. rtn: the weight of largest
    magnitude lands on -nmax (as Q4_0). ggml: llama.cpp's make_qx_quants search (rmse_type 1): stretch that grid
    by SYMMETRIC_STEPS, refit the scale by weighted least squares, keep the largest (sum w x l)^2 / sum w l^2.

    Returns:
        scale: [out, subs] fp32 (0 for an all-zero sub-block).
    """
    peak = w.gather(-1, w.abs().argmax(-1, keepdim=True))  # signed
    zero = peak.abs() < 1e-15
    peak = torch.where(zero, torch.ones_like(peak), peak)
    best_s = -peak / nmax
    if init == "ggml":
        best_score = torch.full_like(peak, -1.0)
        for step in (0, *SYMMETRIC_STEPS):
            levels = torch.clamp(torch.round(-(nmax + 0.1 * step) / peak * w), -nmax, nmax - 1)
            sxl, sl2 = (ew * w * levels).sum(-1, keepdim=True), (ew * levels * levels).sum(-1, keepdim=True)
            scale = sxl / torch.where(sl2 > 0, sl2, torch.ones_like(sl2))
            better = (sl2 > 0) & (scale * sxl > best_score)
            best_s, best_score = torch.where(better, scale, best_s), torch.where(better, scale * sxl, best_score)
    return torch.where(zero, torch.zeros_like(best_s), best_s).squeeze(-1)


def _quantise_scales(x: torch.Tensor, per: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Second level: per super-block an fp16 d and integers in [lo, hi] with x ~ d * integer. Unsigned (lo 0):
    d = max / hi. Signed: d = (the x of largest magnitude) / lo, so that one lands on lo (llama.cpp's Q3_K, Q6_K).

    Args:
        x: [out, subs] sub-block scales or mins; per: sub-blocks per super-block.
    Returns:
        d: [out, supers] fp16-representable; integers: [out, subs].
    """
    g = x.reshape(x.shape[0], -1, per)
    peak = g.amax(-1, keepdim=True) if lo == 0 else g.gather(-1, g.abs().argmax(-1, keepdim=True))
    d = peak / (hi if lo == 0 else lo)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    ints = torch.where(d == 0, torch.zeros_like(g), torch.clamp(torch.round(g / safe), lo, hi))
    return snap_fp16(d.squeeze(-1)), ints.reshape(x.shape)


@torch.no_grad()
def init_parameters(weight: torch.Tensor, cfg: QuantConfig, importance: torch.Tensor | None = None) -> dict:
    """Initial K-quant parameters of weight [out, in] (cfg.init rtn or ggml), as llama.cpp's reference quantiser
    builds them: per sub-block (scale, min) by the search of `_affine_search` / `_symmetric_search`, weighted
    as quantize_row_q*_K_ref weights the error (Q2_K |x|, Q4_K rms(super-block) + |x|, Q3_K / Q6_K x^2; times
    `importance` [in] when given, as llama.cpp's imatrix), then those quantised under an fp16 super-block d.

    Returns:
        {name: tensor} for `parameter_shapes`' names, fp32 on the CPU.
    """
    kt = cfg.kquant
    w = weight.detach().float().cpu().reshape(weight.shape[0], -1, kt.sub_block)  # [out, subs, G]
    per = QK_K // kt.sub_block
    if kt.ggml_type == "Q4_K":
        rms = w.reshape(w.shape[0], -1, QK_K).square().mean(-1, keepdim=True).sqrt()  # [out, supers, 1]
        ew = (rms.unsqueeze(-1) + w.reshape(w.shape[0], -1, per, kt.sub_block).abs()).reshape(w.shape)
    else:
        ew = w.abs() if kt.min_max else w * w
    if importance is not None:
        ew = ew * importance.detach().float().cpu().reshape(1, -1, kt.sub_block)
    if kt.min_max:
        scale, offset = _affine_search(w, ew, cfg.qmax, cfg.init, AFFINE_SEARCH.get(kt.ggml_type))
        d, sc = _quantise_scales(scale, per, *kt.scale_range)
        dmin, m = _quantise_scales(offset, per, 0, kt.min_max)
        return {"super_scale": d, "sub_scale": sc, "super_min": dmin, "sub_min": m}
    d, sc = _quantise_scales(_symmetric_search(w, ew, -cfg.qmin, cfg.init), per, *kt.scale_range)
    return {"super_scale": d, "sub_scale": sc}
