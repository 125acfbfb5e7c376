"""The quantiser interface (`Quantizer`, GPTQ's `ColumnGrid`) and what the group-scaled grids share: one scale per
group of input columns, optionally times low-rank factors."""
from __future__ import annotations

import math
from typing import ClassVar

import torch

from qat_lora.quant import inits as quant_init
from qat_lora.quant.config import QuantConfig

GGUF_BLOCK = 32  # weights per block of llama.cpp's Q8_0 / Q4_0 / Q4_1
FP8_EXPONENT_BITS = 8  # an fp8-scaled layer's power-of-two exponent, stored as an int8
Params = dict[str, torch.Tensor]


class Quantizer:
    """A grid: what its parameters are, how W maps onto it (with STE gradients), its integer codes and their
    decoding, GPTQ's column rounding, its storage cost and what each export format can hold of it."""

    #: the scheme's name in a QuantConfig
    scheme: ClassVar[str]

    def __init__(self, cfg: QuantConfig, group_size: int | None) -> None:
        self.cfg, self.group_size = cfg, group_size  # group_size None: per channel of a width not yet known

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"

    @property
    def clip_search(self) -> bool:
        """Whether the data-aware inits (GPTQ, the activation-weighted init) may fit its group scales by the
        clipping search (init mse)."""
        return True

    @property
    def reconstructable(self) -> bool:
        """Whether block-wise reconstruction can train it and snap it back onto an fp16-exact grid."""
        return True

    @property
    def gptq_fits_groups(self) -> bool:
        """Whether GPTQ fits each group's parameters itself, row by row (`column_grid` needs no parameters): the
        layers fed the same input (q/k/v, gate/up) can then be solved as one stacked matrix, exactly."""
        return False

    @property
    def name(self) -> str:
        """e.g. int3-g64, lut3-g64-group: block-wise reconstruction resumes saved blocks only onto the same grid."""
        cfg = self.cfg
        return (f"{cfg.scheme}{cfg.bits}-g{self.group_size}" + ("-sym" if cfg.symmetric else "")
                + ("-fp8s" if cfg.scale_bits == 8 else ""))

    # -- parameters ------------------------------------------------------------------------------------------
    def parameter_shapes(self, out_features: int, in_features: int) -> dict[str, tuple[int, ...]]:
        """The quantiser's parameters by attribute name and shape, for a layer [out_features, in_features]."""
        raise NotImplementedError

    def init_parameters(self, weight: torch.Tensor, importance: torch.Tensor | None = None) -> Params:
        """Initial parameters (cfg.init) of weight [out, in] fp32 on the CPU; importance: [in] column weights."""
        raise NotImplementedError

    def stored_parameters(self, params: Params) -> Params:
        """The parameters as the forward uses them, exact in fp16 (what an export stores), by parameter name."""
        return {k: p.detach() for k, p in params.items()}

    def packed_parameters(self, stored: Params) -> Params:
        """`stored_parameters` as the packed export writes them: as they are, unless the grid stores one in a
        narrower float (then in that dtype, plus what decodes it; `unpacked_parameters` inverts it exactly)."""
        return stored

    def unpacked_parameters(self, parts: Params) -> Params:
        """The inverse of `packed_parameters` on what a packed file holds."""
        return parts

    def snapped_parameters(self, params: Params) -> Params:
        """Values to copy into the parameters so that they hold exactly what the forward uses (Wq unchanged)."""
        return {k: quant_init.snap_fp16(p.detach()) for k, p in params.items()}

    @torch.no_grad()
    def constrain_(self, params: Params) -> None:
        """Keep trained parameters in the grid's domain, in place, after an optimizer step (no host read)."""

    # -- the grid ----------------------------------------------------------------------------------------------
    def fake_quantize(self, weight: torch.Tensor, params: Params, hold_codes: bool = False) -> torch.Tensor:
        """Wq [out, in] of weight on the grid, in weight's dtype, differentiable as the training forward needs.
        `hold_codes`: the round's argument sees the parameters detached (fake_quant.py: d Wq / d s = the code)."""
        raise NotImplementedError

    def codes(self, weight: torch.Tensor, params: Params) -> torch.Tensor:
        """Integer codes [out, in] (uint8, in [0, 2^bits)) of weight: `dequantize` maps them back to Wq."""
        raise NotImplementedError

    def dequantize(self, codes: torch.Tensor, params: Params) -> torch.Tensor:
        """Wq [out, in] float32 from codes [out, in] in [0, 2^bits), with the forward's arithmetic (bit-exact)."""
        raise NotImplementedError

    def column_grid(self, params: Params | None, out_features: int, in_features: int,
                    device: torch.device) -> "ColumnGrid":
        """GPTQ's view of the grid (gptq.py): per-group parameters and the rounding of one column."""
        raise NotImplementedError

    # -- storage and exports -----------------------------------------------------------------------------------
    def integer_parameters(self) -> dict[str, tuple[int, int]]:
        """Parameters that only take small integers, by name: (lowest value, bits). The packed export stores each
        as value - lowest in that many bits (0 bits: always the lowest value, not stored); the others are fp16."""
        return {}

    def storage_bits(self, out_features: int, in_features: int) -> int:
        """Bits a layer [out, in] takes as stored: codes at their width, integer parameters at theirs, fp8 scales
        at 8 (and their exponent), every other quantiser tensor at fp16."""
        widths = {"scale": self.cfg.scale_bits, **{k: bits for k, (_, bits) in self.integer_parameters().items()}}
        shapes = self.parameter_shapes(out_features, in_features)
        exponent = FP8_EXPONENT_BITS if self.cfg.scale_bits == 8 else 0
        return out_features * in_features * self.cfg.bits + exponent + sum(widths.get(k, 16) * math.prod(s)
                                                                                 for k, s in shapes.items())

    @property
    def gguf_type(self) -> str | None:
        """The llama.cpp type a layer of this grid is written as from its own codes, or None (re-quantised by
        value, losing the trained grid)."""
        return None

    @property
    def gguf_exact(self) -> bool:
        """Whether that type holds the grid bit for bit by construction."""
        return False

    @property
    def gguf_block(self) -> int:
        """Weights per llama.cpp block of the type (ggml quantises the activations per block as large)."""
        return GGUF_BLOCK

    def gguf_fields(self, weight: torch.Tensor, params: Params) -> dict | None:
        """What llama.cpp's block type stores for this layer: {"type", "q" (codes as the type stores them), "d",
        and per type "m", "sc", "dmin"} as fp32 / int tensors, or None when this layer's values do not fit one."""
        return None

    def compressed_tensors_reason(self) -> str | None:
        """Why compressed-tensors has no layout for this grid, or None."""
        return f"a {self.cfg.scheme} codebook grid"

    def describe(self) -> str:
        """One line for `qat-lora presets`: the kind of grid and its grouping."""
        raise NotImplementedError


class ColumnGrid:
    """GPTQ's per-group grid parameters, filled in as GPTQ reaches each group (`refits`) or fixed up front."""

    refits = False
    #: a refitting grid that needs every group fitted once on the original weights first (then `fix_range_`)
    fixes_range = False

    def fit_(self, group: int, w: torch.Tensor, importance: torch.Tensor) -> None:
        """Fit group `group` on its current weights w [out, G], weighted by importance [G] (diag H)."""

    def quantize(self, w: torch.Tensor, group: int) -> torch.Tensor:
        """Grid value [out] of a column of group `group` holding w [out] (the forward's arithmetic, one column)."""
        raise NotImplementedError

    def parameters(self) -> Params:
        """The parameters GPTQ chose (written into the layer), by name; empty when they stayed fixed."""
        return {}

    def fix_range_(self) -> None:
        """Called once every group has been fitted on the original weights, before the column loop."""

    def block_inputs(self) -> list[torch.Tensor]:
        """Tensors a block's column loop reads besides its columns (a CUDA graph copies them in on replay)."""
        return []

    def for_block(self, groups: int) -> "ColumnGrid":
        """A fresh grid of the same kind over `groups` groups, filled by one block of columns (refitting grids:
        GPTQ replays one block's column loop as a CUDA graph on block-local parameters)."""
        raise NotImplementedError(f"{type(self).__name__} fits no groups per block")

    def block_key(self) -> tuple:
        """Equal for grids whose block loops are the same ops (one CUDA graph serves them all)."""
        raise NotImplementedError(f"{type(self).__name__} fits no groups per block")


# --- group-scaled grids (int, offset, LUT) ---------------------------------------------------------------------

LOW_RANK_FACTORS = ("scale_a", "scale_b")  # the [out, r] and [r, in] factors of s * (1 + A @ B)


def effective_scale(scale: torch.Tensor, scale_a: torch.Tensor | None, scale_b: torch.Tensor | None,
                    group_size: int, scale_bits: int = 16) -> torch.Tensor:
    """Per-group scales (fp16, or fp8 under a per-tensor exponent), optionally times low-rank factors; the one
    formula training and export share.

    Args:
        scale: [out, groups]; scale_a: [out, r] or None; scale_b: [r, in] or None; scale_bits: 16 or 8.
    Returns:
        [out, groups, 1] (no low-rank factors) or [out, groups, G].
    """
    if scale_bits == 8:  # on the E4M3 grid: fp16-exact too (every value >= SCALE_FLOOR), so the fp16 step is a no-op
        scale = quant_init.fp8_scale_ste(scale)
    s = quant_init.fp16_ste(scale).unsqueeze(-1)
    if scale_a is None:
        return s
    low_rank = quant_init.fp16_ste(scale_a) @ quant_init.fp16_ste(scale_b)  # [out, in]: one small matmul, not r big ones
    return s * (1.0 + low_rank.reshape(s.shape[0], s.shape[1], group_size))


class _GroupScaled(Quantizer):
    """Grids with one scale per group (and optional low-rank scale factors)."""

    def parameter_shapes(self, out_features: int, in_features: int) -> dict[str, tuple[int, ...]]:
        groups = in_features // self.group_size
        shapes = {"scale": (out_features, groups), **self._own_shapes(out_features, groups)}
        if self.cfg.scale_rank:
            shapes.update(scale_a=(out_features, self.cfg.scale_rank), scale_b=(self.cfg.scale_rank, in_features))
        return shapes

    def _own_shapes(self, out_features: int, groups: int) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def init_parameters(self, weight: torch.Tensor, importance: torch.Tensor | None = None) -> Params:
        values = self._init_own(weight, importance)
        rank = self.cfg.scale_rank
        if rank:  # B zero: starts at s exactly, and B gets a gradient at once (as LoRA)
            # A of order 1, so each factor moves by about the rate per step as Adam moves B (with A ~0.01 it moved
            # 100x less): its first column 1, B's first row then a per-input-channel factor (1 + b_j) on every
            # group's step; the others random, or they would get the same gradient and stay rank 1.
            generator = torch.Generator().manual_seed(0)
            a = torch.randn(weight.shape[0], rank, generator=generator)
            a[:, 0] = 1.0
            values["scale_a"] = quant_init.snap_fp16(a)
            values["scale_b"] = torch.zeros(rank, weight.shape[1])
        return values

    def _init_own(self, weight: torch.Tensor, importance: torch.Tensor | None) -> Params:
        raise NotImplementedError

    @torch.no_grad()
    def constrain_(self, params: Params) -> None:
        """A group's scale stays at least SCALE_FLOOR: Adam moves it by about its rate per step whatever its size,
        so a small scale can cross 0 (its group's codes would flip sign) or land below fp16's smallest normal,
        where the forward's fp16 value is 0 and w / s divides by it (a NaN by step 280 of a 2-bit run at 1e-3)."""
        params["scale"].clamp_(min=quant_init.SCALE_FLOOR)

    def _scale(self, params: Params) -> torch.Tensor:
        return effective_scale(params["scale"], params.get("scale_a"), params.get("scale_b"), self.group_size,
                               self.cfg.scale_bits)


def _grouping(group_size: int | None) -> str:
    return "per-channel" if group_size is None else f"groups of {group_size}"
