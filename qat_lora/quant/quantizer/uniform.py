"""Uniform integer grids: an integer zero point (or none: llama.cpp's Q8_0 / Q4_0) and an fp16 offset (Q4_1)."""
from __future__ import annotations

from typing import Callable

import torch

from qat_lora.quant import inits as quant_init
from qat_lora.quant.quantizer.base import GGUF_BLOCK, ColumnGrid, Params, Quantizer, _GroupScaled, _grouping


class IntQuantizer(_GroupScaled):
    """Uniform integer grid with an integer zero point z (zero_domain int), or none (zero_domain none: Wq = s * q,
    llama.cpp's Q8_0 / Q4_0; the zero parameter stays 0, its gradient exactly 0)."""

    scheme = "int"

    @property
    def reconstructable(self) -> bool:  # Q8_0 / Q4_0's scale can be negative (ggml init): block-wise keeps s > 0
        return self.cfg.zero_domain == "int"

    def _own_shapes(self, out_features: int, groups: int) -> dict[str, tuple[int, ...]]:
        return {"zero": (out_features, groups)}

    def _init_own(self, weight: torch.Tensor, importance: torch.Tensor | None) -> Params:
        cfg = self.cfg
        scale, zero = quant_init.int_scale_zero(weight, cfg.bits, cfg.symmetric, self.group_size, cfg.init,
                                                cfg.zero_domain, importance)
        if cfg.scale_bits == 8:
            scale, zero = self._fp8_fit(scale, zero, quant_init.fp8_exponent(scale))
        return {"scale": scale, "zero": zero}

    def _fp8_fit(self, scale: torch.Tensor, zero: torch.Tensor, exponent: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """A fitted (scale, zero) moved onto fp8 scales: each scale up to the next grid value (the group's fitted
        range stays covered: at most 1/8 wider), its zero refitted to the same low end (-z s = -z' s')."""
        on_grid = quant_init.fp8_scale(scale, exponent, up=True)
        zero = torch.clamp(torch.round(zero * scale / on_grid), self.cfg.qmin, self.cfg.qmax)
        return on_grid, zero

    def _zero(self, zero: torch.Tensor) -> torch.Tensor:
        """round(z) through an STE, kept on the code range [qmin, qmax] (so that it is stored as one code:
        storage_bits), or 0 (none): zero * 0 gives the parameter a gradient of exactly 0, so it stays 0 under
        AdamW too."""
        if self.cfg.zero_domain == "none":
            return zero * 0.0
        return torch.clamp(quant_init.round_ste(zero), self.cfg.qmin, self.cfg.qmax)

    # An integer zero stays live in the codes' argument: shifting it shifts the codes, and Wq does not change.
    _zero_held = False

    def _levels(self, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, rounding) -> torch.Tensor:
        """The unclamped integer level of each weight, rounded by `rounding` (torch.round, or the STE's)."""
        return rounding(w / s) + z

    def _values(self, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The grid value of level q."""
        return (q - z) * s

    @torch.no_grad()
    def constrain_(self, params: Params) -> None:
        """As every group scale, at least SCALE_FLOOR in size; a grid with no zero point (Q4_0 / Q8_0) keeps its
        sign, as llama.cpp's d may be negative (its code qmin then holds the group's largest weight)."""
        if self.cfg.zero_domain != "none":
            return super().constrain_(params)
        scale = params["scale"]
        floor = torch.full_like(scale, quant_init.SCALE_FLOOR)
        scale.copy_(torch.where(scale.abs() < quant_init.SCALE_FLOOR, torch.copysign(floor, scale), scale))

    def stored_parameters(self, params: Params) -> Params:
        out = super().stored_parameters(params)
        # the zero the grid uses: round(z) (fp16(z) can round the other way than z near k + 0.5), or 0 (none)
        out["zero"] = self._zero(out["zero"])
        out["scale"] = self._stored_scale(out["scale"])
        return out

    def snapped_parameters(self, params: Params) -> Params:
        return {"scale": self._stored_scale(params["scale"].detach()), "zero": self._zero(params["zero"].detach())}

    def _stored_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """The group scales the forward uses: fp16, or fp8 under the tensor's exponent (then fp16-exact too)."""
        if self.cfg.scale_bits == 8:
            scale = quant_init.fp8_scale(scale, quant_init.fp8_exponent(scale))
        return quant_init.snap_fp16(scale)

    def packed_parameters(self, stored: Params) -> Params:
        """fp8 scales as the packed export writes them: E4M3 bytes and the tensor's exponent (int8), exactly the
        stored values (`unpacked_parameters` inverts it bit for bit)."""
        if self.cfg.scale_bits != 8:
            return stored
        scale = stored["scale"].float()
        exponent = quant_init.fp8_exponent(scale)
        codes = (scale / quant_init.power_of_two(exponent)).to(torch.float8_e4m3fn)
        if not torch.equal(codes.float() * quant_init.power_of_two(exponent), scale):
            raise ValueError("fp8 group scales off their grid: re-snap the quantiser (a bug if it came from training)")
        return {**stored, "scale": codes, "scale_exp": exponent.to(torch.int8)}

    def unpacked_parameters(self, parts: Params) -> Params:
        if "scale_exp" not in parts:
            return parts
        parts = dict(parts)
        exponent = parts.pop("scale_exp").float()
        return {**parts, "scale": parts["scale"].float() * quant_init.power_of_two(exponent)}

    def fake_quantize(self, weight: torch.Tensor, params: Params, hold_codes: bool = False) -> torch.Tensor:
        out_features, in_features = weight.shape
        s = self._scale(params)
        z = self._zero(params["zero"]).unsqueeze(-1)
        w = weight.reshape(out_features, s.shape[1], in_features // s.shape[1])
        s_in, z_in = (s.detach(), z.detach() if self._zero_held else z) if hold_codes else (s, z)
        q = torch.clamp(self._levels(w, s_in, z_in, quant_init.round_ste), self.cfg.qmin, self.cfg.qmax)
        return self._values(q, s, z).reshape(out_features, in_features).to(weight.dtype)

    def codes(self, weight: torch.Tensor, params: Params) -> torch.Tensor:
        out_features, in_features = weight.shape
        w = weight.float().reshape(out_features, -1, self.group_size)
        z = self._zero(params["zero"]).unsqueeze(-1)
        q = torch.clamp(self._levels(w, self._scale(params), z, torch.round), self.cfg.qmin, self.cfg.qmax)
        return (q - self.cfg.qmin).reshape(out_features, in_features).to(torch.uint8)

    def dequantize(self, codes: torch.Tensor, params: Params) -> torch.Tensor:
        params = {k: v.float() for k, v in params.items()}
        out_features, in_features = codes.shape
        c = codes.long().reshape(out_features, -1, self.group_size)
        z = self._zero(params["zero"]).unsqueeze(-1)
        return self._values((c + self.cfg.qmin).float(), self._scale(params), z).reshape(out_features, in_features)

    gptq_fits_groups = True

    def column_grid(self, params: Params | None, out_features: int, in_features: int,
                    device: torch.device) -> ColumnGrid:
        return _RefitColumns(self, out_features, in_features // self.group_size, device)

    def integer_parameters(self) -> dict[str, tuple[int, int]]:
        """An integer zero is one code of the grid (the forward keeps it on [qmin, qmax]), stored at the codes'
        width as compressed-tensors and GPTQ checkpoints store it; Q8_0 / Q4_0 store none (always 0)."""
        return {"zero": (self.cfg.qmin, self.cfg.bits) if self.cfg.zero_domain == "int" else (0, 0)}

    def _fit_group(self, w: torch.Tensor, importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        init = cfg.init if cfg.init in ("mse", "ggml") else "rtn"  # hqq's fit is for whole layers, not groups
        return quant_init.int_scale_zero(w, cfg.bits, cfg.symmetric, w.shape[1], init, cfg.zero_domain, importance)

    def _column_rounding(self, s: torch.Tensor, z: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """GPTQ's rounding of a column of one group (scale s, zero z [out]): the forward's arithmetic, no STE. With
        an integer zero, (clamp(round(w/s) + z, qmin, qmax) - z) s == clamp(round(w/s), qmin - z, qmax - z) s
        exactly (small integers are exact in float): four ops per column instead of six, the bounds made once
        per group (on a GPU the column loop is bound by launching its ops)."""
        low, high = self.cfg.qmin - z, self.cfg.qmax - z
        return lambda w: torch.div(w, s).round_().clamp_(low, high).mul_(s)

    def _block_grid(self) -> bool:
        cfg = self.cfg
        return not cfg.scale_rank and cfg.scale_bits == 16 and self.group_size == GGUF_BLOCK and cfg.bits in (4, 8)

    @property
    def gguf_type(self) -> str | None:
        if self._block_grid() and self.cfg.zero_domain == "none":
            return "Q8_0" if self.cfg.bits == 8 else "Q4_0"
        # 4-bit groups of 32 with an integer zero: the same codes as Q4_1 (gguf_fields)
        return "Q4_1" if self._block_grid() and self.cfg.bits == 4 else None

    @property
    def gguf_exact(self) -> bool:
        return self._block_grid() and self.cfg.zero_domain == "none"

    def gguf_fields(self, weight: torch.Tensor, params: Params) -> dict | None:
        if not self._block_grid():
            return None
        cfg, codes = self.cfg, self.codes(weight, params)
        # symmetric layers qualify only while every zero rounds to 0 (zero_domain none keeps it 0 by design)
        z = self._zero(params["zero"].detach()).float()  # the zero the forward uses
        if cfg.symmetric and (cfg.zero_domain == "none" or not z.any()):
            if cfg.bits == 8:
                return {"type": "Q8_0", "q": codes.to(torch.int16) + cfg.qmin, "d": params["scale"].detach().float()}
            return {"type": "Q4_0", "q": codes.to(torch.int16), "d": params["scale"].detach().float()}
        if cfg.bits != 4:
            return None
        # the same codes c = q - qmin: Wq = d * (q - z) = d * c - d * (z - qmin); only that offset m is rounded
        # to fp16 as Q4_1 stores it
        d = quant_init.snap_fp16(params["scale"].detach().float())
        return {"type": "Q4_1", "q": codes.to(torch.int16), "d": d, "m": -d * (z - cfg.qmin)}

    def compressed_tensors_reason(self) -> str | None:
        if self.cfg.scale_rank:
            return "low-rank scales"
        if self.cfg.scale_bits == 8:
            return "fp8 group scales (its layouts store fp16 / bf16 / fp32 scales)"
        if self.cfg.bits not in (2, 4, 8):
            return f"{self.cfg.bits}-bit codes (compressed-tensors layouts agree on 2, 4 and 8 bits only)"
        return None

    def describe(self) -> str:
        cfg = self.cfg
        kind = f"int{cfg.bits}, {'symmetric' if cfg.symmetric else 'asymmetric'}"
        if cfg.zero_domain != "int":
            kind += f", zero point {cfg.zero_domain}" + (f" (llama.cpp {self.gguf_type})" if self.gguf_exact else "")
        return f"{kind}, {_grouping(self.group_size)}" + (", fp8 scales" if cfg.scale_bits == 8 else "")


class OffsetQuantizer(IntQuantizer):
    """Uniform grid with an fp16 offset m instead of an integer zero (llama.cpp's Q4_1 "min"): Wq = s * q + m,
    q >= 0. Init rtn / ggml: the group's min/max (llama.cpp's); mse / hqq: the integer grid's search, its zero
    stored as the offset s * (qmin - z). Training moves m continuously, where an integer zero moves by whole steps
    (an fp16 offset per group: (16 - b) bits more than an integer zero, stored at the codes' width)."""

    reconstructable = False

    @property
    def clip_search(self) -> bool:  # llama.cpp's own init (q4_1) stays; an integer search converts (inits.py)
        return self.cfg.init != "ggml"

    def _zero(self, zero: torch.Tensor) -> torch.Tensor:
        return quant_init.fp16_ste(zero)

    # Under held codes the offset leaves the codes' argument too: d Wq / d m = 1 (fake_quant.py's docstring).
    _zero_held = True

    def _levels(self, w: torch.Tensor, s: torch.Tensor, m: torch.Tensor, rounding) -> torch.Tensor:
        return rounding((w - m) / s)

    def _values(self, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return q * s + m  # d * q, then + m, in that order: what gguf's dequantiser computes, so bit-exact

    def _column_rounding(self, s: torch.Tensor, m: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        qmin, qmax = self.cfg.qmin, self.cfg.qmax  # a float offset: the forward's own formula
        return lambda w: self._values(torch.clamp(self._levels(w, s, m, torch.round), qmin, qmax), s, m)

    def integer_parameters(self) -> dict[str, tuple[int, int]]:
        return {}  # the offset is an fp16 value

    def stored_parameters(self, params: Params) -> Params:
        return Quantizer.stored_parameters(self, params)

    def snapped_parameters(self, params: Params) -> Params:
        return Quantizer.snapped_parameters(self, params)

    @property
    def gguf_type(self) -> str | None:
        return "Q4_1" if self.gguf_exact else None

    @property
    def gguf_exact(self) -> bool:
        return self._block_grid() and self.cfg.bits == 4

    def gguf_fields(self, weight: torch.Tensor, params: Params) -> dict | None:
        if not self.gguf_exact:
            return None
        return {"type": "Q4_1", "q": self.codes(weight, params).to(torch.int16),
                "d": params["scale"].detach().float(), "m": params["zero"].detach().float()}

    def compressed_tensors_reason(self) -> str | None:
        return "low-rank scales" if self.cfg.scale_rank else "a float zero offset (llama.cpp Q4_1)"


class _RefitColumns(ColumnGrid):
    """int / offset grids: each group's scale and zero fitted on its error-compensated weights (paper §4)."""

    refits = True

    def __init__(self, quantizer: IntQuantizer, out_features: int, groups: int, device: torch.device) -> None:
        self.quantizer = quantizer
        self.scale = torch.zeros(out_features, groups, device=device)
        self.zero = torch.zeros(out_features, groups, device=device)
        self._group, self._rounding = -1, None
        # fp8 scales: the exponent, fixed before the column loop (fix_range_) so that every group's scale, fitted
        # as GPTQ reaches it, lands on the grid the forward uses
        self.exponent: torch.Tensor | None = None

    @property
    def fixes_range(self) -> bool:
        return self.quantizer.cfg.scale_bits == 8

    def fit_(self, group: int, w: torch.Tensor, importance: torch.Tensor) -> None:
        s, z = self.quantizer._fit_group(w, importance)
        if self.exponent is not None:
            s, z = self.quantizer._fp8_fit(s, z, self.exponent)
        self.scale[:, group], self.zero[:, group] = s[:, 0], z[:, 0]
        self._group = -1  # the rounding set up for a group reads its parameters as they were

    def fix_range_(self) -> None:
        """After every group was fitted on the original weights: the fp8 exponent, one octave above what those
        fits need (error compensation can widen a later group's range: the forward's own exponent, from the final
        scales, is then this one or lower, whose grid holds every value of this one), those fits moved onto it.
        q/k/v solved as one stacked matrix share it: each layer's own is again this one or lower."""
        if not self.fixes_range:
            return
        self.exponent = quant_init.fp8_exponent(self.scale) + 1.0
        self.scale, self.zero = self.quantizer._fp8_fit(self.scale, self.zero, self.exponent)

    def block_inputs(self) -> list[torch.Tensor]:
        return [] if self.exponent is None else [self.exponent]

    def quantize(self, w: torch.Tensor, group: int) -> torch.Tensor:
        if group != self._group:  # set up once per group, not once per column (fit_ precedes a group's columns)
            self._group = group
            self._rounding = self.quantizer._column_rounding(self.scale[:, group], self.zero[:, group])
        return self._rounding(w)

    def parameters(self) -> Params:
        return {"scale": self.scale, "zero": self.zero}

    def for_block(self, groups: int) -> "_RefitColumns":
        grid = _RefitColumns(self.quantizer, self.scale.shape[0], groups, self.scale.device)
        grid.exponent = None if self.exponent is None else self.exponent.clone()
        return grid

    def block_key(self) -> tuple:
        return type(self).__name__, repr(self.quantizer.cfg), self.quantizer.group_size
