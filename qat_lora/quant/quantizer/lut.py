"""The codebook grid: Wq = s * LUT[nearest(W / s)], a 2^b-entry codebook per tensor or per group."""
from __future__ import annotations

import torch

from qat_lora.quant import inits as quant_init
from qat_lora.quant.quantizer.base import ColumnGrid, Params, _GroupScaled, _grouping
from qat_lora.runtime import device as dev


class LutQuantizer(_GroupScaled):
    """A 2^b-entry codebook (one per tensor or per group) times per-group absmax scales."""

    scheme = "lut"

    @property
    def name(self) -> str:
        return super().name + ("-group" if self.cfg.codebook == "group" else "")

    def _own_shapes(self, out_features: int, groups: int) -> dict[str, tuple[int, ...]]:
        shape = (out_features, groups) if self.cfg.codebook == "group" else (1, 1)
        return {"codebook": (*shape, 2**self.cfg.bits)}

    def _init_own(self, weight: torch.Tensor, importance: torch.Tensor | None) -> Params:
        cfg, g = self.cfg, self.group_size
        scale = quant_init.lut_scale(weight, g)
        per_group = cfg.codebook == "group"
        codebook = (quant_init.kmeans_codebook(weight, scale, cfg.bits, g, per_group, importance) if cfg.init != "rtn"
                    else quant_init.uniform_codebook(cfg.bits, tuple(scale.shape) if per_group else None))
        return {"scale": scale, "codebook": codebook}

    def fake_quantize(self, weight: torch.Tensor, params: Params, hold_codes: bool = False) -> torch.Tensor:
        # STE passes W / s through (inside the codebook's range) to W and s
        out_features, in_features = weight.shape
        scale, codebook = self._scale(params), quant_init.fp16_ste(params["codebook"])
        v = weight.reshape(out_features, scale.shape[1], -1) / (scale.detach() if hold_codes else scale)
        values, _ = _lut_lookup(v, codebook)
        lo = codebook.detach().amin(-1, keepdim=True)
        hi = codebook.detach().amax(-1, keepdim=True)
        vc = torch.clamp(v, lo, hi)
        q = values + (vc - vc.detach())  # forward: exactly values; backward: d/dv = 1 inside the range
        return (q * scale).reshape(out_features, in_features).to(weight.dtype)

    def codes(self, weight: torch.Tensor, params: Params) -> torch.Tensor:
        out_features, in_features = weight.shape
        w = weight.float().reshape(out_features, -1, self.group_size)
        _, q = _lut_lookup(w / self._scale(params), quant_init.snap_fp16(params["codebook"]))
        return q.reshape(out_features, in_features).to(torch.uint8)

    def dequantize(self, codes: torch.Tensor, params: Params) -> torch.Tensor:
        params = {k: v.float() for k, v in params.items()}
        out_features, in_features = codes.shape
        c = codes.long().reshape(out_features, -1, self.group_size)
        wq = params["codebook"].expand(out_features, c.shape[1], -1).gather(-1, c) * self._scale(params)
        return wq.reshape(out_features, in_features)

    def column_grid(self, params: Params | None, out_features: int, in_features: int,
                    device: torch.device) -> ColumnGrid:
        if params is None or "codebook" not in params:
            raise ValueError("gptq_quantize: the lut scheme keeps the layer's scale and codebook fixed; pass "
                             "params=layer.quant_parameters()")
        return _LutColumns(params, out_features, in_features // self.group_size, device)

    def describe(self) -> str:
        return f"lut{self.cfg.bits} ({self.cfg.codebook} codebook), {_grouping(self.group_size)}"


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


class _LutColumns(ColumnGrid):
    """The layer's own scale and codebook, kept fixed: GPTQ only chooses the codes."""

    def __init__(self, params: Params, out_features: int, groups: int, device: torch.device) -> None:
        self.scale = params["scale"].detach().float().to(device)
        self._codebook = params["codebook"].detach().float().to(device)
        self.codebook = self._codebook.expand(out_features, groups, -1)

    def quantize(self, w: torch.Tensor, group: int) -> torch.Tensor:
        s, cb = self.scale[:, group], self.codebook[:, group]  # [out], [out, K]
        nearest = (w.div(s).unsqueeze(1) - cb).abs().argmin(1, keepdim=True)
        return cb.gather(1, nearest).squeeze(1) * s

    def parameters(self) -> Params:
        return {"scale": self.scale, "codebook": self._codebook}
