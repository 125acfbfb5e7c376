"""llama.cpp's K-quant grids as a quantiser; their arithmetic lives in quant/kquant.py."""
from __future__ import annotations

import torch

from qat_lora.quant import kquant
from qat_lora.quant.config import QK_K, QuantConfig
from qat_lora.quant.quantizer.base import ColumnGrid, Params, Quantizer


class KQuantizer(Quantizer):
    """llama.cpp's Q2_K / Q3_K / Q4_K / Q6_K (kquant.py holds the arithmetic). Rows not a multiple of 256 never
    get one: QuantConfig.for_width picks the fallback preset."""

    scheme = "kquant"
    clip_search = False  # the two-level scales admit llama.cpp's min/max and search only
    reconstructable = False

    def parameter_shapes(self, out_features: int, in_features: int) -> dict[str, tuple[int, ...]]:
        return kquant.parameter_shapes(self.cfg, out_features, in_features)

    def init_parameters(self, weight: torch.Tensor, importance: torch.Tensor | None = None) -> Params:
        return kquant.init_parameters(weight, self.cfg, importance)

    def stored_parameters(self, params: Params) -> Params:
        out = super().stored_parameters(params)
        stored = kquant.stored_parameters(self.cfg, **out)  # sub-block integers rounded and clamped to range
        out.update({"sub_scale": stored["sc"], **({"sub_min": stored["m"]} if "m" in stored else {})})
        return out

    def fake_quantize(self, weight: torch.Tensor, params: Params, hold_codes: bool = False) -> torch.Tensor:
        return kquant.fake_quantize_kquant(weight, self.cfg, hold_codes, **params)

    def codes(self, weight: torch.Tensor, params: Params) -> torch.Tensor:
        return (kquant.codes(weight, self.cfg, **params) - self.cfg.qmin).to(torch.uint8)

    def dequantize(self, codes: torch.Tensor, params: Params) -> torch.Tensor:
        return kquant.dequantize(codes.float() + self.cfg.qmin, self.cfg, **params)

    def column_grid(self, params: Params | None, out_features: int, in_features: int,
                    device: torch.device) -> ColumnGrid:
        if params is None or "sub_scale" not in params:
            raise ValueError("gptq_quantize: the kquant scheme keeps the layer's two-level scales fixed; pass "
                             "params=layer.quant_parameters()")
        return _KQuantColumns(self.cfg, params, device)

    def storage_bits(self, out_features: int, in_features: int) -> int:
        # the sub-block scales and mins are 4-8-bit integers, not fp16: the type's own block size
        return round(out_features * in_features * self.cfg.kquant.bits_per_weight)

    @property
    def gguf_type(self) -> str | None:
        return self.cfg.kquant.ggml_type

    @property
    def gguf_exact(self) -> bool:
        return True

    @property
    def gguf_block(self) -> int:
        return QK_K

    def gguf_fields(self, weight: torch.Tensor, params: Params) -> dict | None:
        params = {k: p.detach().float().cpu() for k, p in params.items()}
        stored = kquant.stored_parameters(self.cfg, **params)
        return {"type": self.gguf_type, "q": kquant.codes(weight.detach().cpu(), self.cfg, **params), **stored}

    def describe(self) -> str:
        kt = self.cfg.kquant
        return (f"llama.cpp {kt.ggml_type}, {kt.bits_per_weight} bits/weight, 256-weight super-blocks of "
                f"{kt.sub_block}-weight sub-blocks (rows not a multiple of 256: {kt.fallback})")


class _KQuantColumns(ColumnGrid):
    """The layer's sub-block scales d * sc and mins dmin * m, kept fixed: GPTQ only chooses the codes, which the
    two-level scales need not re-fit (kquant.fake_quantize_kquant's arithmetic, one column)."""

    def __init__(self, cfg: QuantConfig, params: Params, device: torch.device) -> None:
        self.cfg = cfg
        s, m = kquant.sub_block_grid(cfg, **params)
        self.s, self.m = s.detach().float().to(device), None if m is None else m.detach().float().to(device)

    def quantize(self, w: torch.Tensor, group: int) -> torch.Tensor:
        columns = slice(group, group + 1)
        m = None if self.m is None else self.m[:, columns]
        return kquant.on_grid(w.unsqueeze(1), self.s[:, columns], m, self.cfg).squeeze(1)
