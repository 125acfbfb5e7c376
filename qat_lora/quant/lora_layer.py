"""PEFT's LoRA over a FakeQuantLinear (DESIGN §5, "Merging through PEFT's API"): the training forward is PEFT's
own, the merges know that the base serves Wq, not its latent weight.

PEFT's stock `lora.Linear.merge` adds dW to `base_layer.weight.data`: over a FakeQuantLinear that is the latent
weight W, so the layer would serve Q(W + dW), neither the adapted student nor the export's merge, and the write
through `.data` is invisible to the cached Wq. `QuantLoraLinear` is registered for FakeQuantLinear through PEFT's
custom-module dispatch (`register_quant_lora`: `add_recovery_lora_` and `load_recovery_lora` do it), and the two
merges the export offers are these functions, shared with export/merge.py:

    dense_merge(base, dW) -> nn.Linear     Wq + dW in full precision   (export --merge-fp, merge())
    requantize_(base, dW)                  latent := Wq + dW, so Q(..)  (export --merge-adapter, merge(grid=True))

Imports PEFT at load: import it only where PEFT is needed anyway (train/lora.py inside its functions, export/).
"""
from __future__ import annotations

import torch
from torch import nn
from peft import LoraConfig
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import check_adapters_to_merge

from qat_lora.quant.fake_quant import FakeQuantLinear


def lora_delta(module: LoraLinear, adapter_names: list[str] | None = None) -> torch.Tensor:
    """dW = sum over `adapter_names` (None: the active ones) of scaling · B A, [out, in], in the base's dtype."""
    names = module.active_adapters if adapter_names is None else adapter_names
    dtype = module.get_base_layer().weight.dtype
    return sum(module.get_delta_weight(a).to(dtype) for a in names if a in module.lora_A)


@torch.no_grad()
def dense_merge(base: FakeQuantLinear, delta: torch.Tensor) -> nn.Linear:
    """A plain nn.Linear serving Wq + delta in full precision (exact; as many bytes as the unquantised layer),
    trainable or frozen as `base`'s weight."""
    linear = base.to_linear().requires_grad_(base.weight.requires_grad)
    linear.weight.data = base.quantized_weight() + delta
    return linear


@torch.no_grad()
def requantize_(base: FakeQuantLinear, delta: torch.Tensor) -> torch.Tensor:
    """Merge `delta` into `base` on its grid: the latent weight becomes Wq + delta under the same quantiser, so the
    layer serves Q(Wq + delta), which can snap most of a small delta back (DESIGN §5), and a re-snap stage starts
    from Wq + delta. Returns that target, Wq + delta [out, in]."""
    target = base.quantized_weight() + delta
    base.weight.data = target.clone()
    if base._stores_wq:  # its weight is what it serves: put the target on the grid
        base.weight.data = base._fake_quantize().to(base.weight.dtype)
    base.invalidate_cache()
    return target


class QuantLoraLinear(LoraLinear):
    """PEFT's LoRA `Linear` over a FakeQuantLinear: training (forward, gradients, saved files) is PEFT's own, bit
    for bit; merges act on what the base serves, Wq, never on its latent weight.

    A merge cannot be both exact and on the grid in general (the grid cannot hold Wq + dW), so:
      - `merge()` (and so PeftModel's `merge_adapter()` / `merge_and_unload()`) is exact: the base becomes a plain
        nn.Linear holding Wq + dW in full precision (`dense_merge`, what `export --merge-fp` writes), so a merged
        forward equals the adapted one to float rounding; the FakeQuantLinear is held aside, untouched.
        A layer that claims to be on the grid while serving an off-grid weight would mislead every exporter.
      - `unmerge()` puts the held FakeQuantLinear back: the same object, Wq bit for bit.
      - `merge(grid=True)` merges into the grid instead (`requantize_`, what `export --merge-adapter` does): the
        layer stays a FakeQuantLinear serving Q(Wq + dW); `unmerge()` restores the latent weight bit for bit.
    `safe_merge` checks the merged weight is finite first, as PEFT's. DoRA and other variants, and `lora_bias`,
    are not merged here (the recovery adapters use none of them).
    """

    @torch.no_grad()  # dW from the trainable A and B: no graph
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None, grid: bool = False) -> None:
        """Merge the adapters `adapter_names` (None: the active ones) into the base, exactly or (`grid`) on the grid.

        Raises:
            ValueError: a LoRA variant or lora_bias, a grid merge over an exact one (or the reverse), or (safe_merge) a
                non-finite merged weight.
        """
        names = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A]
        if not names:
            return
        if any(a in self.lora_variant or self.lora_bias[a] for a in names):
            raise ValueError(f"QuantLoraLinear.merge: adapter {names[0]!r} is a LoRA variant (DoRA, ...) or has a "
                             "bias; only plain LoRA merges over a quantised base")
        held_base, held_latent = self.__dict__.get("_held_base"), self.__dict__.get("_held_latent")
        if (grid and held_base is not None) or (not grid and held_latent is not None):
            raise ValueError(f"QuantLoraLinear.merge(grid={grid}): adapters {self.merged_adapters} are already merged "
                             f"{'exactly' if grid else 'on the grid'}; unmerge() first")
        delta = lora_delta(self, names)
        base = self.get_base_layer()
        if safe_merge:
            merged = base.weight + delta if held_base is not None else base.quantized_weight() + delta
            if not torch.isfinite(merged).all():
                raise ValueError(f"QuantLoraLinear.merge: the merged weight of adapter(s) {names} is not finite; the "
                                 "adapter is broken")
        if grid:
            if held_latent is None:
                self.__dict__["_held_latent"] = base.weight.detach().clone()
            requantize_(base, delta)
        elif held_base is None:
            self.__dict__["_held_base"] = base  # a plain attribute: not a submodule, so not in the state dict
            self.base_layer = dense_merge(base, delta)
        else:  # another adapter over an exact merge: the dense weight takes its dW too
            base.weight += delta
        self.merged_adapters.extend(names)

    def unmerge(self) -> None:
        """Undo every merge: the held FakeQuantLinear (exact merge) or latent weight (grid merge), bit for bit."""
        if not self.merged:
            super().unmerge()  # PEFT's "Already unmerged" warning
            return
        held_base, held_latent = self.__dict__.pop("_held_base", None), self.__dict__.pop("_held_latent", None)
        if held_base is not None:
            self.base_layer = held_base
        if held_latent is not None:
            base = self.get_base_layer()
            base.weight.data = held_latent
            base.invalidate_cache()
        self.merged_adapters.clear()

    def _apply(self, fn, recurse=True):
        # .to() while merged moves what unmerge() will put back too
        held_base, held_latent = self.__dict__.get("_held_base"), self.__dict__.get("_held_latent")
        if held_base is not None:
            held_base._apply(fn, recurse)
        if held_latent is not None:
            self.__dict__["_held_latent"] = fn(held_latent)
        return super()._apply(fn, recurse)


def register_quant_lora(config: LoraConfig) -> LoraConfig:
    """`config` with QuantLoraLinear registered for FakeQuantLinear (PEFT's custom-module dispatch, which the
    adapter's files do not record: pass the config to `get_peft_model` or `PeftModel.from_pretrained(config=)`)."""
    config._register_custom_module({FakeQuantLinear: QuantLoraLinear})
    return config
