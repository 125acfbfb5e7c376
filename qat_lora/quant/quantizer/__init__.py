"""One quantiser object per grid: the only package that knows what a scheme's grid is (DESIGN §4).

`quantizer_for(cfg, group_size)` returns the grid of a QuantConfig; every module that fake-quantises, encodes,
decodes, GPTQ-rounds, counts bits or exports asks it instead of branching on the scheme:

    IntQuantizer     Wq = s * (clamp(round(W / s) + z, qmin, qmax) - z)    integer zero z (zero_domain int), or none
    OffsetQuantizer  Wq = s * clamp(round((W - m) / s), qmin, qmax) + m    fp16 offset m (llama.cpp's Q4_1 "min")
    LutQuantizer     Wq = s * LUT[nearest(W / s)]                          2^b-entry codebook, per tensor or group
    KQuantizer       llama.cpp's K-quants: quantised sub-block scales under an fp16 super-block d (kquant.py)

s is per group of G input columns, optionally times low-rank factors (1 + A @ B) (A: [out, r], B: [r, in];
Apple/Anemll style) without running r matmuls. `round` / `nearest` use a straight-through estimator, so scales,
zeros and codebooks receive LSQ-style gradients (Esser et al., 2020). Scales, offsets, codebooks and low-rank
factors are always used at fp16 precision (snapped with an STE), which is what the exports store: decoding the
codes therefore reproduces the training-time Wq bit for bit. FakeQuantLinear holds the parameters; a quantiser
holds none, only its config and group size, and takes the parameters by name.
"""
from __future__ import annotations

from qat_lora.quant.config import QuantConfig
from qat_lora.quant.quantizer.base import (GGUF_BLOCK, LOW_RANK_FACTORS, ColumnGrid, Quantizer,  # noqa: F401
                                          effective_scale)
from qat_lora.quant.quantizer.kquant import KQuantizer
from qat_lora.quant.quantizer.lut import LutQuantizer, _lut_lookup  # noqa: F401
from qat_lora.quant.quantizer.uniform import IntQuantizer, OffsetQuantizer

_BY_SCHEME: dict[str, type[Quantizer]] = {"int": IntQuantizer, "lut": LutQuantizer, "kquant": KQuantizer}


def quantizer_for(cfg: QuantConfig, group_size: int | None = None) -> Quantizer:
    """The grid of `cfg` for layers of `group_size` input columns per group (None: cfg.group_size, which is None
    for a per-channel preset whose layers' widths are not known yet)."""
    cls = OffsetQuantizer if cfg.zero_domain == "float" else _BY_SCHEME[cfg.scheme]
    return cls(cfg, cfg.group_size if group_size is None else group_size)
