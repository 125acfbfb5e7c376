"""Initialisation of quantiser parameters (DESIGN §4): round-to-nearest, MSE-optimal clipping search,
half-quadratic (HQQ-style) robust fitting, and (weighted) 1-D k-means for LUT codebooks.

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
# HQQ defaults (Badri & Shaji 2023): l_p "norm" 0.7, 20 iterations, beta x1.01 per iteration. Our beta is in code
# units (errors divided by the group's scale), so one value suits every layer whatever its weights' magnitude.
HQQ_ITERS = 20
HQQ_P = 0.7
HQQ_BETA = 10.0
HQQ_KAPPA = 1.01
HQQ_CHUNK = 65_536  # weights per block of output rows: the loops' temporaries stay in cache (3x faster on CPU)


def snap_fp16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest fp16 value, kept in x's dtype (what the export stores)."""
    return x.to(torch.float16).to(x.dtype)


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """Forward: round (bit-exact: x + (round(x) - x) == round(x) in floating point); backward: identity."""
    return x + (torch.round(x) - x).detach()


def fp16_ste(x: torch.Tensor) -> torch.Tensor:
    """Forward: the nearest fp16 value (what the export stores); backward: identity, so fp32 Adam state keeps
    accumulating sub-fp16 updates."""
    return x + (snap_fp16(x) - x).detach()


# fp8 E4M3 (OCP FP8, the "fn" variant NVFP4 uses for its block scales): 3 mantissa bits, normals 2^-6 .. 448,
# subnormals down to 2^-9. Scales stored so (QuantConfig.scale_bits 8) sit under one power-of-two exponent per tensor.
E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXP = -6
E4M3_MIN = 2.0 ** -9


def fp8_exponent(scale: torch.Tensor) -> torch.Tensor:
    """[1, 1] float: the smallest k with every scale of the tensor <= 448 * 2^k (its largest scale then has the
    full E4M3 precision; a power of two moves E4M3's grid without changing its relative steps, and E4M3 spans
    2^17.8, so one exponent per tensor suffices)."""
    # explicit dims: torch_xla 2.9's amax() over every dim returns its input unreduced
    return torch.ceil(torch.log2(scale.amax(dim=(0, 1), keepdim=True).clamp(min=SCALE_FLOOR) / E4M3_MAX))


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2^k, exact for integer-valued k (torch.exp2 falls back to the CPU on torch_xla 2.9; pow lowers)."""
    return torch.pow(2.0, exponent)


def fp8_scale(scale: torch.Tensor, exponent: torch.Tensor, up: bool = False) -> torch.Tensor:
    """`scale` [out, groups] (> 0) on the E4M3 grid times 2^exponent ([1, 1]): the nearest value (ties to even,
    as a cast to torch.float8_e4m3fn rounds), or with `up` the next one up (the init: a group's range stays
    covered); at least SCALE_FLOOR. Device-agnostic arithmetic (no fp8 dtype), no host read."""
    unit = power_of_two(exponent)
    x = scale / unit
    step = power_of_two(torch.floor(torch.log2(x.clamp(min=2.0 ** E4M3_MIN_NORMAL_EXP))) - 3)  # 8 steps an octave
    q = (torch.ceil(x / step) if up else torch.round(x / step)) * step
    return (q.clamp(E4M3_MIN, E4M3_MAX) * unit).clamp(min=SCALE_FLOOR)


def fp8_scale_ste(scale: torch.Tensor) -> torch.Tensor:
    """Forward: `scale` on its tensor's fp8 grid (fp8_scale, the exponent from the scales themselves); backward:
    identity, so the fp32 Adam state keeps accumulating updates smaller than a grid step."""
    held = scale.detach()
    return scale + (fp8_scale(held, fp8_exponent(held)) - held)


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


def ggml_scale_zero(weight: torch.Tensor, bits: int, group_size: int, zero_domain: str) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's reference round-to-nearest for its block types (ggml-quants.c, quantize_row_*_ref).

    zero_domain none, 8 bits (Q8_0): d = absmax / 127. none, fewer bits (Q4_0): d = the signed weight of largest
    magnitude / qmin, so that weight lands exactly on code qmin (-8) and all 2^b levels are used (d is negative
    when that weight is positive). float (Q4_1): d = (max - min) / (2^b - 1), offset m = min.

    Returns:
        scale, zero: [out, groups]; d and m fp16-representable as llama.cpp stores them (|d| floored at
        SCALE_FLOOR so all-zero groups stay finite); zero is m (float) or 0 (none).
    """
    w = _grouped(weight, group_size)
    if zero_domain == "float":
        lo = w.amin(-1)
        return snap_fp16(((w.amax(-1) - lo) / (2**bits - 1)).clamp(min=SCALE_FLOOR)), snap_fp16(lo)
    if bits == 8:
        scale = w.abs().amax(-1) / 127
    else:
        scale = w.gather(-1, w.abs().argmax(-1, keepdim=True)).squeeze(-1) / -(2 ** (bits - 1))
    scale = torch.where(scale.abs() < SCALE_FLOOR, torch.full_like(scale, SCALE_FLOOR), scale)
    return snap_fp16(scale), torch.zeros_like(scale)


def int_scale_zero(weight: torch.Tensor, bits: int, symmetric: bool, group_size: int, init: str = "rtn",
                   zero_domain: str = "int", importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The int grid's initial (scale, zero) for QuantConfig.init / zero_domain ([out, groups] each).

    zero_domain float: rtn / ggml are llama.cpp's Q4_1 min/max (m = the group's min); mse / hqq search an integer
    zero as for the int grid and store the same grid points as an fp16 offset m = fp16(s * (qmin - z)), which a
    trained offset then moves continuously (only m's fp16 rounding differs from the integer grid)."""
    if init == "ggml" or (zero_domain == "float" and init == "rtn"):
        return ggml_scale_zero(weight, bits, group_size, "float" if zero_domain == "float" else "none")
    search = {"mse": mse_scale_zero, "hqq": hqq_scale_zero}.get(init)
    scale, zero = (search(weight, bits, symmetric, group_size, importance) if search
                   else rtn_scale_zero(weight, bits, symmetric, group_size))
    if zero_domain == "float":
        return scale, snap_fp16(scale * (_int_range(bits, symmetric)[0] - zero))
    return scale, zero


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


def _abs_pow(x: torch.Tensor, p: float) -> torch.Tensor:
    # |x|^p as exp(p log|x|): 2.5x faster than Tensor.pow on CPU, and the HQQ loops are dominated by it. Zeros
    # give 1e-8^p (negligible in a sum, and the shrinkage below maps them to 0).
    return torch.exp(torch.log(x.abs().clamp(min=1e-8)) * p)


def shrink_lp(x: torch.Tensor, beta: float, p: float, x_abs_p: torch.Tensor | None = None) -> torch.Tensor:
    """Generalised soft-thresholding (Badri & Shaji 2023, after Chartrand 2012): the closed-form step of the
    half-quadratic split, approximately argmin_y |y|^p + beta/2 (y - x)^2 for p < 1.

    Errors below the threshold beta^(-1 / (2 - p)) go to 0 (fitted by the quantiser); larger ones pass almost
    whole, so the fit treats them as sparse outliers instead of letting them drag the grid.

    Args:
        x: any shape; x_abs_p: |x|^p if already computed (the loops below need it for their error too).
    """
    a = x.abs().clamp(min=1e-8)
    a_p = _abs_pow(x, p) if x_abs_p is None else x_abs_p
    return torch.sign(x) * torch.relu(a - a_p / a / beta)  # |x|^(p-1) = |x|^p / |x|


def _weighted_mean(x: torch.Tensor, imp: torch.Tensor) -> torch.Tensor:
    return (x * imp).sum(-1, keepdim=True) / torch.broadcast_to(imp, x.shape).sum(-1, keepdim=True)


def _keep_best(err: torch.Tensor, value: torch.Tensor, best_err: torch.Tensor | None,
               best: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if best_err is None:
        return err, value
    better = err < best_err
    return torch.where(better, err, best_err), torch.where(better, value, best)


def _hqq_zero(x: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int, imp: torch.Tensor, iters: int, p: float,
              beta: float, kappa: float) -> torch.Tensor:
    """The published HQQ loop at a fixed scale: a real-valued zero minimising sum |x - (Q - z)|^p per group.

    Args:
        x: [out, groups, G] weights in code units (W / s); zero: [out, groups, 1] starting zero.
    Returns:
        [out, groups, 1] the zero of the lowest l_p error met (HQQ stops when the error rises; keeping each
        group's best needs no branch on values).
    """
    best_err = best = None
    for step in range(iters + 1):
        residual = x - (torch.clamp(torch.round(x + zero), qmin, qmax) - zero)  # (W - W_r) / s
        residual_p = _abs_pow(residual, p)
        best_err, best = _keep_best((residual_p * imp).sum(-1, keepdim=True), zero, best_err, best)
        if step == iters:
            break
        outlier = shrink_lp(residual, beta, p, residual_p)  # W_e / s
        # closed form: argmin_z ||Q - z - (W - W_e) / s||^2 = mean(Q - (W - W_e) / s), and Q = x + z - residual
        zero = zero + _weighted_mean(outlier - residual, imp)
        beta *= kappa
    return best


def _hqq_scale(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int, imp: torch.Tensor,
               iters: int, p: float, beta: float, kappa: float) -> torch.Tensor:
    """The same half-quadratic loop over the scale, the (integer) zero fixed: s = <W - W_e, Q - z> / |Q - z|^2.

    Args:
        w: [out, groups, G] weights; scale, zero: [out, groups, 1].
    Returns:
        [out, groups, 1] the scale of the lowest (importance-weighted) squared error met, not yet fp16-snapped.
        The loop's own l_p objective keeps scales that clip more outliers: on SmolLM2-135M w3g64 that measured
        ppl 50.8 against 46.0 for the lowest-MSE iterate (RTN 46.5), so the l_p norm only shapes the steps.
    """
    best_err = best = None
    for step in range(iters + 1):
        level = torch.clamp(torch.round(w / scale) + zero, qmin, qmax) - zero  # Q - z
        residual = w / scale - level  # (W - W_r) / s: thresholds in code units
        err = (residual.square() * imp).sum(-1, keepdim=True) * scale.square()  # in weight units
        best_err, best = _keep_best(err, scale, best_err, best)
        if step == iters:
            break
        outlier = shrink_lp(residual, beta, p) * scale  # W_e
        num = ((w - outlier) * level * imp).sum(-1, keepdim=True)
        den = (level * level * imp).sum(-1, keepdim=True)
        scale = torch.where(den > 0, num / den.clamp(min=1e-30), scale).clamp(min=SCALE_FLOOR)  # all-zero: keep
        beta *= kappa
    return best


def hqq_scale_zero(weight: torch.Tensor, bits: int, symmetric: bool, group_size: int,
                   importance: torch.Tensor | None = None, iters: int = HQQ_ITERS, p: float = HQQ_P,
                   beta: float = HQQ_BETA, kappa: float = HQQ_KAPPA) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-quadratic quantisation (HQQ, Badri & Shaji 2023), data-free: per group, minimise the robust error
    sum |W - Wq|^p (p < 1) by splitting off a sparse outlier term W_e and alternating closed-form steps.

    1. Zero, at the min/max scale (the published algorithm): W_e = shrink_lp(W - Wq(z)), then
       z = mean(Q - (W - W_e) / s), beta growing by kappa each iteration.
    2. The forward rounds the zero (`grid.fake_quantize`) and the export stores it as an integer, which undoes
       step 1 at a fixed scale (on SmolLM2-135M the rounded HQQ zero never beat RTN's in squared error, in any
       group). So the zero is rounded here and the same loop then fits the scale with that zero fixed:
       s = <W - W_e, Q - z> / |Q - z|^2. Symmetric grids have no zero: they run this step only.
    3. The scale loop keeps its lowest-MSE iterate, which is snapped to fp16; each group then keeps RTN's scale
       and zero where those have the smaller (importance-weighted) squared error: never worse than RTN in MSE.

    Args:
        weight: [out, in]; importance: [in] or None (weights every error term and mean, as in the other inits).
        iters: iterations of each loop; p: the l_p exponent (< 1); beta, kappa: the half-quadratic penalty, in
            code units (errors / scale), and its growth per iteration.
    Returns:
        scale, zero: [out, in // group_size] as in `rtn_scale_zero`.
    Raises:
        ValueError: p outside (0, 1], or a negative iteration count.
    """
    if not 0 < p <= 1 or iters < 0:
        raise ValueError(f"hqq_scale_zero(p={p}, iters={iters}): use 0 < p <= 1 (HQQ uses 0.7) and iters >= 0")
    qmin, qmax = _int_range(bits, symmetric)
    w = _grouped(weight, group_size)
    imp = _importance(importance, weight, group_size)
    wmin, wmax = w.amin(-1), w.amax(-1)
    rtn_scale, rtn_zero = _int_scale_zero(wmin, wmax, qmin, qmax, symmetric)
    start_zero = rtn_zero if symmetric else -wmin.clamp(max=0) / rtn_scale  # HQQ starts from the unrounded zero
    rows = max(1, HQQ_CHUNK // weight.shape[1])
    scale, zero = [], []
    for w_c, s_c, z_c in zip(w.split(rows), rtn_scale.unsqueeze(-1).split(rows), start_zero.unsqueeze(-1).split(rows)):
        if not symmetric:
            z_c = _hqq_zero(w_c / s_c, z_c, qmin, qmax, imp, iters, p, beta, kappa)
            z_c = torch.round(z_c).clamp(qmin, qmax)
        scale.append(_hqq_scale(w_c, s_c, z_c, qmin, qmax, imp, iters, p, beta, kappa).squeeze(-1))
        zero.append(z_c.squeeze(-1))
    fit_scale, fit_zero = snap_fp16(torch.cat(scale).clamp(min=SCALE_FLOOR)), torch.cat(zero)
    better = _int_error(w, fit_scale, fit_zero, qmin, qmax, imp) < _int_error(w, rtn_scale, rtn_zero, qmin, qmax, imp)
    return torch.where(better, fit_scale, rtn_scale), torch.where(better, fit_zero, rtn_zero)
