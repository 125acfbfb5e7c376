"""Fake-quantised linear layers and `quantize_` (DESIGN §4); the config and presets live in config.py, the grids'
arithmetic (Wq, codes, dequantisation) in grid.py.

`quantize_(model, config)` swaps every matching `nn.Linear` for a `FakeQuantLinear` in place. The latent
full-precision weight is kept (wrap, don't copy). Every scheme materialises Wq once per forward and then runs ONE
matmul; when nothing of a layer trains, Wq is computed once and reused.

A layer whose latent weight was loaded from integer codes (a GPTQ, block-wise or weight-qat start) sits exactly on
its grid, where LSQ's scale gradient round(W/s) - W/s is identically 0 and, once s moves, takes the sign of
s - s0: it cannot train. Such a layer has `hold_codes` set: the round's argument sees the quantiser parameters
detached, so they get the forward's exact derivative with the codes held (d Wq / d s = q - z), and the latent
weight keeps its straight-through gradient.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator

import torch
from torch import nn
import torch.nn.functional as F

from qat_lora.quant import kquant

from qat_lora.quant import inits as quant_init
from qat_lora.quant.config import (CODEBOOKS, INITS, PRESETS, SCHEMES, ZERO_DOMAINS, QuantConfig,  # noqa: F401 (re-exported)
                           get_preset, quant_config_dict, quant_config_from_dict)
from qat_lora.quant.quantizer import quantizer_for


QUANT_PARAMETERS = ("scale", "zero", "codebook", "scale_a", "scale_b", *kquant.PARAMETERS)  # every scheme's names


class FakeQuantLinear(nn.Linear):
    """An nn.Linear whose forward uses the fake-quantised weight (int or LUT scheme).

    It stays an nn.Linear subclass, so anything that takes a Linear takes it; PEFT's LoRA wraps it in
    quant/lora_layer.QuantLoraLinear (registered by train/lora.py), whose merges know the weight is Wq. `weight` is
    the latent full-precision weight; `scale` ([out, groups]) and, per scheme, `zero` ([out, groups]), `codebook`
    ([1, 1, 2^b] or [out, groups, 2^b]), `scale_a`/`scale_b` ([out, r], [r, in]) are parameters. When none
    requires grad (the recovery-LoRA preset), Wq is computed once and reused until one of them changes: an in-place
    op on one (its `_version`: `copy_`, `load_state_dict`), a new storage (`weight.data = w`), `.to()`. A write
    in place through `.data` (`weight.data += d`) is invisible to both, by PyTorch's design of `.data` (a tensor
    with a version counter of its own): call `invalidate_cache()` after one.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: QuantConfig, group_size: int,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.cfg = cfg
        self.group_size = group_size
        self.quantizer = quantizer_for(cfg, group_size)  # the grid: every scheme-specific step asks it
        for name, shape in self.quantizer.parameter_shapes(out_features, in_features).items():
            fill = torch.ones if name == "scale" else torch.zeros  # a unit group scale until init_quantizer_
            setattr(self, name, nn.Parameter(fill(*shape, device=device, dtype=torch.float32)))
        self._cached_wq: torch.Tensor | None = None
        self._cache_key: tuple | None = None
        self._cache_storages: tuple[weakref.ref, ...] = ()  # the storages the cached Wq was computed from
        self._step_wq: torch.Tensor | None = None  # set inside quantized_weights_once_per_step
        self._step_leaf: torch.Tensor | None = None
        self._stores_wq = False  # `weight` holds Wq itself (store_quantized_weight_), not the latent weight
        # The latent weight was set from codes (load_quantizer_state_): the quantiser's gradient holds the codes.
        self.hold_codes = False
        # Lays the cached Wq out like `weight` (FSDP sets it: runtime/sharding.py); None elsewhere, where the
        # compiler's propagation would leave a frozen layer's cached Wq in whatever layout it chose.
        self.wq_layout: Callable[[torch.Tensor], None] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, cfg: QuantConfig, name: str = "",
                    importance: torch.Tensor | None = None) -> "FakeQuantLinear":
        """Wrap `linear` (sharing its weight and bias tensors), initialised by `cfg.init`.

        Args:
            importance: optional [in] per-column weights for the data-aware initialisation.
        """
        cfg, group_size = cfg.for_layer(linear.in_features)  # a K-quant on rows not a multiple of 256: its fallback
        if linear.in_features % group_size:
            raise ValueError(f"group size {group_size} does not divide in_features={linear.in_features} of layer "
                             f"{name or repr(linear)}; pick a group size that divides it or per-channel (group_size=None)")
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, cfg, group_size,
                  device="meta")  # no throw-away allocation: every tensor is replaced below
        new.weight = linear.weight
        new.bias = linear.bias
        new.init_quantizer_(importance)
        return new

    def quant_parameters(self) -> dict[str, nn.Parameter]:
        """The quantiser's own parameters by attribute name (scale, zero | codebook, scale_a, scale_b; kquant:
        kquant.PARAMETERS)."""
        return {n: getattr(self, n) for n in QUANT_PARAMETERS if isinstance(getattr(self, n, None), nn.Parameter)}

    @torch.no_grad()
    def stored_quant_parameters(self) -> dict[str, torch.Tensor]:
        """The quantiser parameters as the forward uses them, exact in fp16 (what an export stores): an integer
        zero rounded, a K-quant's sub-block scales and mins rounded and clamped to their ranges. A QAT-trained
        latent is fractional, and fp16(z) can round the other way than z within fp16 precision of k + 0.5."""
        return self.quantizer.stored_parameters(self.quant_parameters())

    @torch.no_grad()
    def init_quantizer_(self, importance: torch.Tensor | None = None) -> None:
        """(Re)initialise the quantiser from the latent weight, frozen; runs on the CPU, once, before training
        (it replaces the parameter objects: build the optimizer afterwards)."""
        imp = None if importance is None else importance.detach().cpu()
        values = self.quantizer.init_parameters(self.weight.detach().cpu().float(), imp)
        for name, value in values.items():
            setattr(self, name, nn.Parameter(value.to(self.weight.device), requires_grad=False))
        self.invalidate_cache()

    def _fake_quantize(self) -> torch.Tensor:
        return self.quantizer.fake_quantize(self.weight, self.quant_parameters(), self.hold_codes)

    def trains(self) -> bool:
        """Whether Wq depends on a trained tensor (the latent weight or a quantiser parameter)."""
        return any(p.requires_grad for p in (self.weight, *self.quant_parameters().values()))

    def quantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The [out, in] fake-quantised weight used by forward. `dtype`: a frozen layer's cached Wq is kept in
        that dtype (forward passes autocast's compute dtype: the cast autocast would make on every forward, made
        once; the same values); a trained Wq is returned as computed (its gradient flows through the cast)."""
        if self._stores_wq:
            return self.weight
        if self._step_leaf is not None:
            return self._step_leaf
        if self.trains():
            self._cached_wq = None
            return self._fake_quantize()
        sources = (self.weight, *self.quant_parameters().values())
        key = (*(p._version for p in sources), self.weight.device, self.weight.dtype, dtype)
        # The storages too: `.data = w` keeps `_version`; weak references, so a freed storage whose address is
        # reused cannot pass for the old one (a data_ptr could).
        if (self._cached_wq is None or key != self._cache_key
                or any(ref() is not p.untyped_storage() for ref, p in zip(self._cache_storages, sources, strict=True))):
            with torch.no_grad():
                wq = self._fake_quantize()
                self._cached_wq = wq if dtype is None else wq.to(dtype)
                if self.wq_layout is not None:
                    self.wq_layout(self._cached_wq)
            self._cache_key = key
            self._cache_storages = tuple(weakref.ref(p.untyped_storage()) for p in sources)
        return self._cached_wq

    def invalidate_cache(self) -> None:
        """Recompute Wq at the next forward: for a write the cache cannot see, one through `.data` in place."""
        self._cached_wq, self._cache_key, self._cache_storages = None, None, ()

    @torch.no_grad()
    def codes(self) -> torch.Tensor:
        """Integer codes [out, in] (uint8, in [0, 2^bits)) that `dequantize` maps back to `quantized_weight()`."""
        return self.quantizer.codes(self.weight, self.quant_parameters())

    @torch.no_grad()
    def dequantize_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """The [out, in] weight that integer `codes` stand for under this layer's quantiser (the inverse of
        `codes()`): set as the latent weight, it makes `quantized_weight()` equal it exactly."""
        parts = {k: p.detach() for k, p in self.quant_parameters().items()}
        return self.quantizer.dequantize(codes, parts).to(self.weight.dtype)

    @torch.no_grad()
    def store_quantized_weight_(self, dtype: torch.dtype) -> None:
        """Replace the latent weight by Wq in `dtype` (the compute dtype, e.g. bf16), computed once in fp32:
        one weight tensor at half the bytes instead of an fp32 latent weight plus a cached Wq. Only for a frozen
        quantiser (recovery LoRA): nothing reads the latent weight again, and nothing could train it.

        Raises:
            ValueError: the latent weight or a quantiser parameter trains.
        """
        if self.trains():
            raise ValueError("store_quantized_weight_: this layer's weight or quantiser trains; only a frozen "
                             "quantiser can drop its latent weight")
        wq = self._fake_quantize().to(dtype)
        self.weight = nn.Parameter(wq, requires_grad=False)
        self._stores_wq = True
        self.invalidate_cache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        kind = x.device.type
        if torch.is_autocast_enabled(kind):  # autocast casts the weight to its dtype: a frozen Wq is cached so
            return F.linear(x, self.quantized_weight(torch.get_autocast_dtype(kind)), bias)
        return F.linear(x, self.quantized_weight().to(x.dtype), bias)

    def __getstate__(self) -> dict:
        # pickled (torch.save, spawned ranks) without the cache: its storages' weak references cannot be pickled
        return {**self.__dict__, "_cached_wq": None, "_cache_key": None, "_cache_storages": ()}

    def _apply(self, fn, recurse=True):
        self.invalidate_cache()  # .to()/.cuda() must not keep a stale copy on the old device
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
        cfg = self.cfg
        return (f"{super().extra_repr()}, {type(self.quantizer).__name__}, scheme={cfg.scheme}, bits={cfg.bits}, group_size={self.group_size}, "
                f"symmetric={cfg.symmetric}, scale_rank={cfg.scale_rank}")


@contextlib.contextmanager
def quantized_weights_once_per_step(model: nn.Module, enabled: bool = True) -> Iterator[Callable[[], None]]:
    """Build each trainable quantiser's Wq once for a step of several micro-batches, not once per micro-batch.

    Inside the block every FakeQuantLinear whose quantiser or latent weight trains returns one detached leaf
    copy of its Wq, in which the micro-batches' backward passes accumulate dL/dWq; the yielded function (call
    it after the last micro-batch's backward, before gradients are read) then backpropagates that sum once
    through the quantiser: J^T (sum_i g_i) = sum_i J^T g_i, so the gradients equal the per-micro-batch ones up
    to float summation order, and the fake-quant forward and backward run once per step. Layers whose
    quantiser is frozen are skipped (their Wq is already cached across steps).
    """
    layers = []
    if enabled:
        for module in model.modules():
            if isinstance(module, FakeQuantLinear) and module.trains():
                wq = module._fake_quantize()
                module._step_wq, module._step_leaf = wq, wq.detach().requires_grad_()
                layers.append(module)

    def backward_quantizers() -> None:
        pairs = [(m._step_wq, m._step_leaf.grad) for m in layers if m._step_leaf.grad is not None]
        if pairs:
            torch.autograd.backward([wq for wq, _ in pairs], [g for _, g in pairs])
        for m in layers:
            m._step_leaf.grad = None

    try:
        yield backward_quantizers
    finally:
        for m in layers:
            m._step_wq = m._step_leaf = None


def quantize_(model: nn.Module, config: QuantConfig | str,
              importance: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Replace every nn.Linear of `model` selected by `config` (include/exclude/overrides) by a
    FakeQuantLinear, in place. Works on any transformers causal LM made of nn.Linear.

    Args:
        config: a QuantConfig or a preset name.
        importance: optional {module name: [in] column weights} for data-aware init
            (`calibration.activation_importance`).
    Raises:
        ValueError: unknown preset name, or a group size that does not divide a layer's width (names the layer).
    """
    cfg = get_preset(config) if isinstance(config, str) else config
    targets = [(name, module, cfg.for_module(name)) for name, module in model.named_modules()
               if type(module) is nn.Linear]
    targets = [t for t in targets if t[2] is not None]
    if not targets:
        raise ValueError("quantize_ found no nn.Linear to quantise (all excluded, or already quantised)")
    for name, linear, layer_cfg in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        imp = None if importance is None else importance.get(name)
        setattr(parent, child, FakeQuantLinear.from_linear(linear, layer_cfg, name, imp))
    return model


def quantised_layers(model: nn.Module) -> dict[str, FakeQuantLinear]:
    """Every FakeQuantLinear of `model` by its full name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, FakeQuantLinear)}


def quantizer_parameters(model: nn.Module, names: tuple[str, ...] | None = None) -> list[nn.Parameter]:
    """Every quantiser parameter of every FakeQuantLinear (scales, zeros, codebooks, low-rank factors), or only
    those named `names` (e.g. ("zero",): integer zeros and fp16 offsets)."""
    return [p for m in model.modules() if isinstance(m, FakeQuantLinear)
            for name, p in m.quant_parameters().items() if names is None or name in names]


def trained_quantised_layers(model: nn.Module) -> list[FakeQuantLinear]:
    """The FakeQuantLinears whose quantiser trains (found once per run, not once per step)."""
    return [m for m in model.modules()
            if isinstance(m, FakeQuantLinear) and any(p.requires_grad for p in m.quant_parameters().values())]


@torch.no_grad()
def constrain_quantizers_(layers: list[FakeQuantLinear]) -> None:
    """After an optimizer step: each trained quantiser back in its grid's domain (Quantizer.constrain_; a scale
    at least SCALE_FLOOR), in place, one elementwise op per layer, no host read."""
    for m in layers:
        m.quantizer.constrain_(m.quant_parameters())


def latent_weights(model: nn.Module) -> list[nn.Parameter]:
    """The latent full-precision weight of every fake-quantised linear."""
    return [m.weight for m in model.modules() if isinstance(m, FakeQuantLinear)]
