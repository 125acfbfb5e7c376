"""Group-wise fake-quantised linear layers and the preset table (DESIGN §4).

`quantize_(model, config)` swaps every matching `nn.Linear` for a `FakeQuantLinear` in place. The latent
full-precision weight is kept (wrap, don't copy); the forward uses

    Wq = s * (clamp(round(W / s) + z, qmin, qmax) - z)

per group of `group_size` input columns, with a straight-through estimator for `round`, so the scales `s`
and zero points `z` receive LSQ-style gradients (Esser et al., 2020) when they are trainable.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F


@dataclass(frozen=True)
class QuantConfig:
    """How linear weights are fake-quantised.

    Attributes:
        bits: integer bit width of the codes (2, 3, 4 or 8).
        group_size: input columns sharing one scale; None means one scale per output channel.
        symmetric: codes in [-2^(b-1), 2^(b-1)-1] with z = 0; otherwise [0, 2^b-1] with a zero point.
        exclude: fnmatch patterns of module names left in full precision (lm_head by default;
            embeddings are not nn.Linear and are never touched).
    """

    bits: int = 4
    group_size: int | None = 64
    symmetric: bool = False
    exclude: tuple[str, ...] = ("lm_head", "*.lm_head")

    def __post_init__(self) -> None:
        if self.bits not in (2, 3, 4, 8):
            raise ValueError(f"QuantConfig.bits={self.bits}: use 2, 3, 4 or 8")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"QuantConfig.group_size={self.group_size}: use a positive size or None (per-channel)")

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1)) if self.symmetric else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2**self.bits - 1


# The one preset table every CLI reads. Asymmetric (scale + zero) matches the RTN baselines we report.
PRESETS: dict[str, QuantConfig] = {
    "w2g32": QuantConfig(bits=2, group_size=32),
    "w2g64": QuantConfig(bits=2, group_size=64),
    "w3g32": QuantConfig(bits=3, group_size=32),
    "w3g64": QuantConfig(bits=3, group_size=64),
    "w4g32": QuantConfig(bits=4, group_size=32),
    "w4g64": QuantConfig(bits=4, group_size=64),
    "w4pc": QuantConfig(bits=4, group_size=None),
    "w8pc": QuantConfig(bits=8, group_size=None),
}


def get_preset(name: str) -> QuantConfig:
    """Return the preset called `name`; unknown names raise a ValueError listing the choices."""
    if name not in PRESETS:
        raise ValueError(f"unknown quantisation preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    # Forward: round; backward: identity (straight-through estimator).
    return x + (torch.round(x) - x).detach()


def rtn_scale_zero(weight: torch.Tensor, cfg: QuantConfig, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest initialisation: min/max per group.

    Args:
        weight: [out, in] full-precision weight.
    Returns:
        scale, zero: [out, in // group_size] each (zero is all 0 when symmetric).
    """
    w = weight.detach().float().reshape(weight.shape[0], -1, group_size)  # [out, groups, G]
    if cfg.symmetric:
        scale = w.abs().amax(-1) / ((cfg.qmax - cfg.qmin) / 2)
        zero = torch.zeros_like(scale)
    else:
        wmin = w.amin(-1).clamp(max=0)
        wmax = w.amax(-1).clamp(min=0)
        scale = (wmax - wmin) / (cfg.qmax - cfg.qmin)
        zero = torch.round(-wmin / scale.clamp(min=1e-12)).clamp(cfg.qmin, cfg.qmax)
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny * 1e6)  # all-zero groups stay finite
    return scale, zero


def fake_quantize(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Wq = s * (clamp(round(W/s) + round(z), qmin, qmax) - round(z)), group-wise, STE on both rounds.

    Args:
        weight: [out, in]; scale, zero: [out, groups] with in % groups == 0.
    Returns:
        [out, in] fake-quantised weight in weight's dtype.
    """
    out_features, in_features = weight.shape
    groups = scale.shape[1]
    w = weight.reshape(out_features, groups, in_features // groups)
    s = scale.unsqueeze(-1)
    z = _round_ste(zero).unsqueeze(-1)
    q = torch.clamp(_round_ste(w / s) + z, qmin, qmax)
    return ((q - z) * s).reshape(out_features, in_features).to(weight.dtype)


class FakeQuantLinear(nn.Linear):
    """An nn.Linear whose forward uses the group-wise fake-quantised weight.

    It stays an nn.Linear subclass so PEFT's LoRA wraps it as it would any Linear. `weight` is the latent
    full-precision weight; `scale` and `zero` ([out, in // group_size]) are parameters. When none of the
    three requires grad (the recovery-LoRA preset), Wq is computed once and reused until one changes.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: QuantConfig, group_size: int,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.cfg = cfg
        self.group_size = group_size
        groups = in_features // group_size
        self.scale = nn.Parameter(torch.ones(out_features, groups, device=device, dtype=torch.float32))
        self.zero = nn.Parameter(torch.zeros(out_features, groups, device=device, dtype=torch.float32))
        self._cached_wq: torch.Tensor | None = None
        self._cache_key: tuple | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, cfg: QuantConfig, name: str = "") -> "FakeQuantLinear":
        """Wrap `linear` (sharing its weight and bias tensors) with RTN-initialised scales."""
        group_size = linear.in_features if cfg.group_size is None else cfg.group_size
        if linear.in_features % group_size:
            raise ValueError(f"group size {group_size} does not divide in_features={linear.in_features} of layer "
                             f"{name or repr(linear)}; pick a group size that divides it or per-channel (group_size=None)")
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, cfg, group_size,
                  device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        scale, zero = rtn_scale_zero(linear.weight, cfg, group_size)
        new.scale = nn.Parameter(scale.to(linear.weight.device), requires_grad=False)
        new.zero = nn.Parameter(zero.to(linear.weight.device), requires_grad=False)
        return new

    def quantized_weight(self) -> torch.Tensor:
        """The [out, in] fake-quantised weight used by forward."""
        if self.weight.requires_grad or self.scale.requires_grad or self.zero.requires_grad:
            self._cached_wq = None
            return fake_quantize(self.weight, self.scale, self.zero, self.cfg.qmin, self.cfg.qmax)
        key = (self.weight._version, self.scale._version, self.zero._version, self.weight.device, self.weight.dtype)
        if self._cached_wq is None or key != self._cache_key:
            with torch.no_grad():
                self._cached_wq = fake_quantize(self.weight, self.scale, self.zero, self.cfg.qmin, self.cfg.qmax)
            self._cache_key = key
        return self._cached_wq

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.quantized_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def _apply(self, fn, recurse=True):
        self._cached_wq = None  # .to()/.cuda() must not keep a stale copy on the old device
        return super()._apply(fn, recurse)

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear holding the dequantised weight (what a dense export writes)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.quantized_weight())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.cfg.bits}, group_size={self.group_size}, symmetric={self.cfg.symmetric}"


def _excluded(name: str, cfg: QuantConfig) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in cfg.exclude)


def quantize_(model: nn.Module, config: QuantConfig | str) -> nn.Module:
    """Replace every nn.Linear of `model` (not excluded by `config.exclude`) by a FakeQuantLinear, in place.

    Raises:
        ValueError: unknown preset name, or a group size that does not divide a layer's width (names the layer).
    """
    cfg = get_preset(config) if isinstance(config, str) else config
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is nn.Linear and not _excluded(name, cfg)]
    if not targets:
        raise ValueError("quantize_ found no nn.Linear to quantise (all excluded, or already quantised)")
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FakeQuantLinear.from_linear(linear, cfg, name))
    return model


def quantizer_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Scales and zero points of every FakeQuantLinear (what the `qat` preset trains)."""
    params: list[nn.Parameter] = []
    for module in model.modules():
        if isinstance(module, FakeQuantLinear):
            params += [module.scale, module.zero]
    return params


def quant_config_dict(cfg: QuantConfig) -> dict:
    """JSON-friendly form of a QuantConfig (for run configs and manifests)."""
    return {"bits": cfg.bits, "group_size": cfg.group_size, "symmetric": cfg.symmetric, "exclude": list(cfg.exclude)}
