"""`qat-lora recover --budget-bits B`: the quantisation preset and LoRA rank whose student ships within B bits per
quantised weight (the base plus its unmerged adapter), counted on the model's own linear shapes.

    choice = choose_budget(4.3, models.linear_shapes("smollm2-135m"))   # from the config: no weight loads
    choice.preset, choice.lora_r, choice.total_bits                      # "w3g64", 16, 4.2361...

The two counts are the toolkit's own, from shapes instead of a built model: the base's is each quantised linear's
`quantizer_for(cfg, group).storage_bits(out, in)` (what quant.state.bits_per_weight sums), the adapter's
train.student.lora_bits_per_weight (what adapter_bits_per_weight measures). And recover's default rates for what
was chosen: `qat_rate(preset)` (--qat-lr) and `lora_probe_rates(r)` (--lr).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from qat_lora.quant.config import get_preset
from qat_lora.quant.quantizer import quantizer_for

# The bases a budget chooses among, and the adapter ranks; each list is tried from the most bits down. Each width
# with v_proj at 8 bits too (on SmolLM2-135M at cpu-medium the better row at each width, per bit shipped:
# docs/RESULTS.md), and at 2 and 3 bits groups of 32 with fp8 scales at a few hundredths of a bit more (there
# w2g32-v8 38.93 at 2.49 bits against w2g64-v8 46.69 at 2.46, w3g32-v8 18.32 at 3.49 against 18.55 at 3.45); on a
# model with no `v_proj` the mix is the plain preset, and the plain one, listed first, wins.
BUDGET_PRESETS = ("w2g64", "w2g64-v8", "w2g32-v8", "w3g64", "w3g64-v8", "w3g32-v8", "w4g64", "w4g64-v8", "w8pc")
BUDGET_RANKS = (64, 32, 16, 8)

Shapes = dict[str, tuple[int, int]]  # {linear's module name: (out_features, in_features)}


def base_bits(preset: str, shapes: Shapes) -> tuple[float, Shapes] | None:
    """Bits per quantised weight of `preset`'s base on linears of these shapes and the shapes it quantises, each
    layer's config chosen as quantize_ chooses it (for_module, then for_width's K-quant fallback; per-channel =
    a group of in_features); None when a group does not divide a layer's width (quantize_ refuses that model)."""
    cfg, bits, quantised = get_preset(preset), 0, {}
    for name, (out_features, in_features) in shapes.items():
        layer = cfg.for_module(name)
        if layer is None:
            continue
        layer, group = layer.for_layer(in_features)
        if in_features % group:
            return None
        bits += quantizer_for(layer, group).storage_bits(out_features, in_features)
        quantised[name] = (out_features, in_features)
    weights = sum(m * n for m, n in quantised.values())
    return (bits / weights, quantised) if weights else None


@dataclass(frozen=True)
class BudgetChoice:
    """What a budget of `bits` per quantised weight ships: `preset`'s base and a rank-`lora_r` adapter (None: none)."""

    bits: float
    preset: str
    base_bits: float
    lora_r: int | None
    adapter_bits: float

    @property
    def total_bits(self) -> float:
        return self.base_bits + self.adapter_bits

    def record(self) -> dict:
        """recover.json's "budget" entry."""
        return {**asdict(self), "total_bits": self.total_bits}

    def describe(self) -> str:
        adapter = f"LoRA r{self.lora_r} {self.adapter_bits:.4f}" if self.lora_r else f"no LoRA {self.adapter_bits:.4f}"
        return (f"budget {self.bits:g} bits per weight: {self.preset} {self.base_bits:.4f} + {adapter} = "
                f"{self.total_bits:.4f}")


def choose_budget(budget_bits: float, shapes: Shapes, presets: tuple[str, ...] = BUDGET_PRESETS,
                  ranks: tuple[int, ...] = BUDGET_RANKS) -> BudgetChoice:
    """The base: the preset with the most bits per weight within the budget, as at equal bytes more code bits won
    (SmolLM2-135M: w4g64 GPTQ, 15.56 ppl at 4.31 bits, beat every adapter row up to 6.24 bits; docs/RESULTS.md, the
    frontier). Then the largest rank whose unmerged adapter fits in what is left, among ranks no larger than every
    quantised layer's smaller side (past it a rank adds bits, not capacity, and the calibrated start cannot fill
    it). No rank fits: no adapter, and recover trains the grid's scales and zeros instead (`qat`: from GPTQ at
    4.31 bits 15.24 against 15.83 at cpu-medium, w4g64-v8 14.49 at 4.43; at cpu-small it beat weight-qat side by
    side at 3 and 4 bits, 22.18 against 22.32 and 15.36 against 16.34, with 3 % of the trainable parameters;
    docs/RESULTS.md).

    Raises:
        ValueError: a budget below every preset's base on this model, in one line naming the smallest.
    """
    bases = {preset: found for preset in presets if (found := base_bits(preset, shapes)) is not None}
    if not bases:
        raise ValueError(f"--budget-bits: none of {', '.join(presets)} divides this model's layers into groups")
    fitting = {preset: found for preset, found in bases.items() if found[0] <= budget_bits}
    if not fitting:
        smallest = min(bases, key=lambda preset: bases[preset][0])
        least = math.ceil(bases[smallest][0] * 1e4) / 1e4  # rounded up, so that passing it fits
        raise ValueError(f"--budget-bits {budget_bits:g}: below the smallest this model ships at, {smallest}'s "
                         f"{bases[smallest][0]:.4f} bits per weight; pass --budget-bits {least:g} or more")
    preset = max(fitting, key=lambda p: fitting[p][0])  # the first of equals, in `presets` order
    base, quantised = fitting[preset]
    # Imported here: the CLI's parser imports this module (through commands/config.py), and train.student brings
    # PEFT, which commands that train nothing (qat-lora plot) must not load.
    from qat_lora.train.student import lora_bits_per_weight

    narrowest = min(min(shape) for shape in quantised.values())
    for r in sorted(ranks, reverse=True):
        adapter = lora_bits_per_weight(quantised.values(), r)
        if r <= narrowest and base + adapter <= budget_bits:
            return BudgetChoice(budget_bits, preset, base, r, adapter)
    return BudgetChoice(budget_bits, preset, base, None, 0.0)


# recover's default --qat-lr, by the width of the preset's own grid: the rate that suited `qat` (scales and zeros
# from the GPTQ start) fell as the start got better. SmolLM2 at cpu-medium: 2 bits 1e-3 (w2g64-v8 46.69 against
# 49.08 at 5e-4), 3 bits 5e-4 (w3g64-v8 18.55 against 19.63 at 1e-3 and 18.74 at 2e-4), 4 bits 2e-4 (w4g64-v8
# 14.49; at cpu-small 14.79 against 15.06 at 5e-4); docs/RESULTS.md, "v_proj at 8 bits".
QAT_LR_BY_BITS = {2: 1e-3, 3: 5e-4, 4: 2e-4}


def qat_rate(quant: str) -> float:
    """recover's default --qat-lr for a preset: QAT_LR_BY_BITS at its base grid's width (2 or fewer bits as 2,
    4 or more as 4)."""
    return QAT_LR_BY_BITS[min(max(get_preset(quant).bits, 2), 4)]


# recover's default --lr probe at LoRA rank 16. With alpha = 2 r an adapter's update grows with its rank, and the
# best measured rates fell as 16 / r: SmolLM2 w3g64 2e-3 at r16 -> 5e-4 at r64 (cpu-medium), Gemma 3 w3g64 5e-4 at
# r16 -> 1.25e-4 at r64 (cpu-small, both from the calibrated start; docs/RESULTS.md).
LR_PROBE_AT_RANK_16 = (5e-4, 1e-3, 2e-3)


def rate_at_rank(lr_at_rank_16: float, lora_r: int) -> float:
    """A LoRA rate measured at rank 16, moved to rank `lora_r` (times 16 / r, 3 significant digits)."""
    return float(f"{lr_at_rank_16 * 16 / lora_r:.3g}")


def lora_probe_rates(lora_r: int) -> list[float]:
    """recover's default --lr: LR_PROBE_AT_RANK_16 at rank lora_r."""
    return [rate_at_rank(lr, lora_r) for lr in LR_PROBE_AT_RANK_16]
