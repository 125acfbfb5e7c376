"""The quantisation config: `QuantConfig`, the preset table `PRESETS` and their JSON form (DESIGN §4), and the
check of a --quantizer file.

A leaf (no torch): the CLI, configs and manifests read presets without building a model. `qat_lora.quant.fake_quant`
re-exports everything here, so `from qat_lora.quant.fake_quant import QuantConfig, PRESETS` stays the public spelling.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

INITS = ("rtn", "mse", "hqq", "ggml")
CODEBOOKS = ("tensor", "group")
# torchao's ZeroPointDomain: an integer zero z (Wq = s * (q - z)), a float offset m (Wq = s * q + m: llama.cpp's
# Q4_1 "min"), or none (Wq = s * q: llama.cpp's Q8_0 / Q4_0).
ZERO_DOMAINS = ("int", "float", "none")
QK_K = 256  # weights per K-quant super-block (ggml-common.h)


@dataclass(frozen=True)
class KQuantType:
    """One of llama.cpp's K-quant grids (ggml-common.h, DESIGN §9): 256-weight super-blocks with one fp16 d
    (and dmin) and sub-blocks whose scales (and mins) are integers: w = d * sc * q - dmin * m.

    `fallback` is the 32-block preset used for a tensor whose rows are not a multiple of 256 (llama.cpp's
    llama_tensor_get_type falls back too: Q2_K / Q3_K to IQ4_NL, Q4_K to Q5_0, Q6_K to Q8_0). We fall back to
    the nearest 32-block type that we train exactly: Q4_0 has IQ4_NL's 4.5 bits per weight, Q4_1 (5.0) is the
    nearest to Q5_0 (5.5), Q8_0 is llama.cpp's own choice.
    """

    ggml_type: str
    sub_block: int  # weights per sub-block (the QuantConfig.group_size)
    scale_range: tuple[int, int]  # integer sub-block scale sc
    min_max: int  # sub-block mins m in [0, min_max]; 0: no mins (symmetric codes)
    fallback: str
    bits_per_weight: float  # block bytes * 8 / 256


KQUANT_TYPES: dict[int, KQuantType] = {  # by QuantConfig.bits
    2: KQuantType("Q2_K", 16, (0, 15), 15, "q4_0", 2.625),
    3: KQuantType("Q3_K", 16, (-32, 31), 0, "q4_0", 3.4375),
    4: KQuantType("Q4_K", 32, (0, 63), 63, "q4_1", 4.5),
    6: KQuantType("Q6_K", 16, (-128, 127), 0, "q8_0", 6.5625),
}


@dataclass(frozen=True)
class SchemeRules:
    """What a config of one scheme may set (checked by QuantConfig); the grids themselves: quant/quantizer/"""

    bits: tuple[int, ...]
    zero_point: bool  # symmetric and zero_domain apply (a uniform grid); a codebook or K-quant has neither
    kquant_types: dict[int, KQuantType] | None = None  # llama.cpp's two-level grids, by bits


SCHEME_RULES: dict[str, SchemeRules] = {
    "int": SchemeRules(bits=(2, 3, 4, 8), zero_point=True),
    "lut": SchemeRules(bits=(2, 3, 4, 8), zero_point=False),
    "kquant": SchemeRules(bits=tuple(KQUANT_TYPES), zero_point=False, kquant_types=KQUANT_TYPES),
}
SCHEMES = tuple(SCHEME_RULES)


@dataclass(frozen=True)
class QuantConfig:
    """How linear weights are fake-quantised."""

    bits: int = field(default=4, metadata={"help": "bit width of the codes: 2, 3, 4 or 8 (kquant: 2, 3, 4 or 6)"})
    group_size: int | None = field(default=64, metadata={"help": "input columns per scale; None = per output channel"})
    symmetric: bool = field(default=False, metadata={"help": "int only: codes centred on 0, no zero point"})
    scheme: str = field(default="int", metadata={"help": "int (uniform grid), lut (learned 2^b codebook) or kquant "
                        "(llama.cpp's Q2_K / Q3_K / Q4_K / Q6_K by bits: quantised sub-block scales)"})
    codebook: str = field(default="tensor", metadata={"help": "lut only: one codebook per tensor or per group"})
    scale_rank: int = field(default=0, metadata={"help": "rank r of low-rank scale factors s * (1 + A @ B); 0 = none"})
    scale_bits: int = field(default=16, metadata={"help": "bits of each group scale: 16 (fp16) or 8 (int only: fp8 "
                            "E4M3 under a power-of-two exponent per tensor, as NVFP4 stores its block scales)"})
    # rtn is the default because it measured better: on SmolLM2-135M w3g64, weight-MSE clipping gave Wikipedia
    # ppl 51.9 vs 46.5 for min/max (docs/BENCHMARKS.md); clipping outlier weights costs more than it saves.
    init: str = field(default="rtn", metadata={"help": "rtn (min/max, uniform LUT; zero_domain float: the group's min as "
                      "offset), mse (clipping search, k-means LUT) "
                      "or hqq (int: half-quadratic robust fit of zero, then scale, data-free; lut: k-means, as mse) "
                      "or ggml (llama.cpp's own round-to-nearest for its block types: needs zero_domain float or none, or scheme "
                      "kquant: llama.cpp's scale and min search)"})
    zero_domain: str = field(default="int", metadata={"help": "int only: int (integer zero z, Wq = s * (q - z)), float "
                             "(fp16 offset m, Wq = s * q + m, q >= 0; as llama.cpp Q4_1) or none (Wq = s * q; symmetric)"})
    include: tuple[str, ...] = field(default=("*",), metadata={"help": "fnmatch patterns of module names to quantise"})
    exclude: tuple[str, ...] = field(default=("lm_head", "*.lm_head"),
                                     metadata={"help": "fnmatch patterns left in full precision (wins over include)"})
    overrides: tuple[tuple[str, "QuantConfig"], ...] = field(
        default=(), metadata={"help": "(pattern, QuantConfig) pairs; the first match replaces this config"})

    def __post_init__(self) -> None:
        for name, value, choices in (("scheme", self.scheme, SCHEMES), ("init", self.init, INITS),
                                     ("codebook", self.codebook, CODEBOOKS), ("zero_domain", self.zero_domain, ZERO_DOMAINS)):
            if value not in choices:
                raise ValueError(f"QuantConfig.{name}={value!r}: use one of {', '.join(choices)}")
        rules = SCHEME_RULES[self.scheme]
        if self.bits not in rules.bits:
            raise ValueError(f"QuantConfig.bits={self.bits}: use 2, 3, 4 or 8 (scheme kquant: 2, 3, 4 or 6)")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"QuantConfig.group_size={self.group_size}: use a positive size or None (per-channel)")
        if self.symmetric and not rules.zero_point and not rules.kquant_types:
            raise ValueError(f"QuantConfig.symmetric=True with scheme={self.scheme!r}: a codebook has no zero point; "
                             "drop symmetric")
        if self.zero_domain != "int" and (not rules.zero_point or self.symmetric != (self.zero_domain == "none")):
            raise ValueError(f"QuantConfig.zero_domain={self.zero_domain!r}: 'none' needs scheme='int' and symmetric=True, "
                             "'float' scheme='int' and symmetric=False")
        ggml_int = self.init == "ggml" and self.zero_domain == "int" and not rules.kquant_types
        if ggml_int:
            raise ValueError(f"QuantConfig.init={self.init!r} with zero_domain={self.zero_domain!r}: ggml needs zero_domain "
                             "float or none (or scheme kquant)")
        if rules.kquant_types:
            self._check_kquant()
        if self.scale_rank < 0:
            raise ValueError(f"QuantConfig.scale_rank={self.scale_rank}: use 0 (off) or a positive rank")
        if self.scale_bits not in (8, 16):
            raise ValueError(f"QuantConfig.scale_bits={self.scale_bits}: use 16 (fp16 scales) or 8 (fp8 E4M3)")
        if self.scale_bits == 8 and (self.scheme, self.zero_domain, self.scale_rank) != ("int", "int", 0):
            raise ValueError("QuantConfig.scale_bits=8 needs scheme='int', zero_domain='int' and scale_rank=0 (the "
                             "fp8 scales are the integer grid's)")
        if self.scale_bits == 8 and self.group_size is None:
            raise ValueError("QuantConfig.scale_bits=8 with group_size=None: per-channel scales are one per row; "
                             "keep them fp16 (scale_bits=16)")
        for item in self.overrides:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], QuantConfig)):
                raise ValueError(f"QuantConfig.overrides entry {item!r}: use (pattern, QuantConfig) pairs")

    def _check_kquant(self) -> None:
        kt = KQUANT_TYPES[self.bits]
        needed = (kt.sub_block, not kt.min_max, "int", 0)
        if (self.group_size, self.symmetric, self.zero_domain, self.scale_rank) != needed or self.init not in ("rtn", "ggml"):
            raise ValueError(f"QuantConfig(scheme='kquant', bits={self.bits}) is llama.cpp's {kt.ggml_type}: it needs "
                             f"group_size={kt.sub_block}, symmetric={not kt.min_max}, zero_domain='int', scale_rank=0 "
                             "and init rtn or ggml; use the preset " + kt.ggml_type.lower())

    @property
    def kquant(self) -> KQuantType | None:
        """The K-quant grid of a kquant config, else None."""
        types = SCHEME_RULES[self.scheme].kquant_types
        return None if types is None else types[self.bits]

    def for_width(self, in_features: int) -> "QuantConfig":
        """The config a layer with `in_features` input columns uses: a K-quant one whose rows are not a multiple
        of 256 gets its 32-block fallback preset (KQuantType.fallback), so training and export share one grid."""
        if self.kquant is None or in_features % QK_K == 0:
            return self
        return replace(get_preset(KQUANT_TYPES[self.bits].fallback), include=self.include, exclude=self.exclude)

    def for_layer(self, in_features: int) -> tuple["QuantConfig", int]:
        """The config and group size a layer with `in_features` input columns uses (for_width; per channel: a group
        of in_features); the group size may not divide in_features (callers refuse that layer)."""
        cfg = self.for_width(in_features)
        return cfg, in_features if cfg.group_size is None else cfg.group_size

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1)) if self.symmetric else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2**self.bits - 1

    def for_module(self, name: str) -> "QuantConfig | None":
        """The config that applies to module `name` (an override, or self), or None if it stays full precision."""
        if any(fnmatch.fnmatchcase(name, p) for p in self.exclude):
            return None
        for pattern, override in self.overrides:
            if fnmatch.fnmatchcase(name, pattern):
                return override.for_module(name)
        return self if any(fnmatch.fnmatchcase(name, p) for p in self.include) else None


# The one preset table every CLI reads. int presets are asymmetric (scale + zero), as the RTN baselines we
# report; `l*` presets are 2^b-entry LUTs (one k-means codebook per tensor) with per-group absmax scales.
PRESETS: dict[str, QuantConfig] = {
    # At 2 bits min/max collapses (ppl 1e4-4e5) and the clipping search removes 0.75-2.3 nats of it; at 3-4 bits it
    # hurts except with groups of 32 at 3 bits (docs/BENCHMARKS.md, "PTQ perplexity"), so each preset carries the
    # init that measured better on SmolLM2-135M.
    "w2g32": QuantConfig(bits=2, group_size=32, init="mse"),
    "w2g64": QuantConfig(bits=2, group_size=64, init="mse"),
    "w3g32": QuantConfig(bits=3, group_size=32, init="mse"),
    "w3g64": QuantConfig(bits=3, group_size=64),
    "w4g32": QuantConfig(bits=4, group_size=32),
    "w4g64": QuantConfig(bits=4, group_size=64),
    "w4pc": QuantConfig(bits=4, group_size=None),
    # The same grids with each group's zero an fp16 offset m (Wq = s * q + m, llama.cpp Q4_1's "min") instead of an
    # integer: 16 bits per group where the integer zero takes the codes' width, and QAT (--preset qat / weight-qat)
    # moves m continuously where an integer zero moves by whole grid steps. A data-aware init searches the integer
    # zero, then stores it as m = s * (qmin - z) (inits.int_scale_zero); rtn is the group's min/max. Measured on
    # SmolLM2 w3g64 at cpu-small: no gain (qat from one GPTQ start: 23.73 ppl against 22.18 with integer zeros;
    # docs/RESULTS.md).
    "w2g64f": QuantConfig(bits=2, group_size=64, zero_domain="float", init="mse"),
    "w3g64f": QuantConfig(bits=3, group_size=64, zero_domain="float"),
    "w4g64f": QuantConfig(bits=4, group_size=64, zero_domain="float"),
    "w8pc": QuantConfig(bits=8, group_size=None),
    # Mixed precision by measured sensitivity (llama.cpp's Q4_K_M likewise keeps attn_v at more bits): on SmolLM2-135M
    # w4g64 GPTQ, restoring v_proj alone to full precision closes 49 % of the gap to the teacher on the training
    # text, down_proj 23 %, q/k/o none (docs/RESULTS.md, "Where the 4-bit student loses"). v_proj at 8 bits per
    # channel costs 3 % of the weights 3.6 more bits; q/o at 3 bits pay for it.
    "w4g64-v8": QuantConfig(bits=4, group_size=64, overrides=(("*.v_proj", QuantConfig(bits=8, group_size=None)),)),
    "w4g64-qo3-v8": QuantConfig(bits=4, group_size=64, overrides=(
        ("*.v_proj", QuantConfig(bits=8, group_size=None)), ("*.q_proj", QuantConfig(bits=3, group_size=64)),
        ("*.o_proj", QuantConfig(bits=3, group_size=64)))),
    "w3g64-v8": QuantConfig(bits=3, group_size=64, overrides=(("*.v_proj", QuantConfig(bits=8, group_size=None)),)),
    "w2g64-v8": QuantConfig(bits=2, group_size=64, init="mse", overrides=(
        ("*.v_proj", QuantConfig(bits=8, group_size=None)),)),
    # Groups of 32 at the bits of groups of 64: each group scale in fp8 (E4M3 under a power-of-two exponent per tensor,
    # NVFP4's block-scale format) instead of fp16 pays for twice the groups (w3g32: 3 + (8 + 3) / 32 = 3.34 bits,
    # against w3g64's 3.30), and the v_proj mix stays under 3.5 and 2.5 bits on SmolLM2 (3.49, 2.49).
    "w3g32-v8": QuantConfig(bits=3, group_size=32, init="mse", scale_bits=8, overrides=(
        ("*.v_proj", QuantConfig(bits=8, group_size=None)),)),
    "w2g32-v8": QuantConfig(bits=2, group_size=32, init="mse", scale_bits=8, overrides=(
        ("*.v_proj", QuantConfig(bits=8, group_size=None)),)),
    # Bits moved from attention to the MLP: in the trained w3g32-v8 student (SmolLM2, training text) putting every
    # attention linear back to full precision gains nothing, the MLP 79 % of the gap, down_proj the most
    # (docs/results/w3g32v8_qat_sensitivity_train.json). q/k/o at 2 bits pay for down_proj at 4: 3.48 bits. Measured
    # worse, kept to reproduce that row: `qat` at cpu-medium 19.47 against w3g32-v8's 18.32 (GPTQ 24.22 against
    # 21.37): 2-bit attention costs more than training wins back (RESULTS.md, "Where the trained 3-bit student loses").
    "w3g32-qko2-d4-v8": QuantConfig(bits=3, group_size=32, init="mse", scale_bits=8, overrides=(
        ("*.v_proj", QuantConfig(bits=8, group_size=None)),
        *((f"*.{m}", QuantConfig(bits=2, group_size=32, init="mse", scale_bits=8))
          for m in ("q_proj", "k_proj", "o_proj")),
        ("*.down_proj", QuantConfig(bits=4, group_size=64, scale_bits=8)))),
    # Rank-1 scale factors (Wq = s (1 + a b^T) * (q - z) per group): each layer's grid gets its own per-input- and
    # per-output-channel step, which no group-wise scale can give, for fp16 (out + in) numbers a layer: +0.04 bits
    # on SmolLM2, so w3g64-v8 stays under 3.5 (3.49). Measured with `qat` at cpu-medium: a tie with the plain mixes
    # (18.64 against 18.55 at 3 bits, 46.65 against 46.69 at 2; their median change under 1 %; RESULTS.md).
    "w3g64-v8-sr1": QuantConfig(bits=3, group_size=64, scale_rank=1, overrides=(
        ("*.v_proj", QuantConfig(bits=8, group_size=None)),)),
    # At 2 bits the factors go on the MLP's linears only (2.49 bits; on q/k/o too it would be 2.505).
    "w2g64-v8-sr1": QuantConfig(bits=2, group_size=64, init="mse", overrides=(
        ("*.v_proj", QuantConfig(bits=8, group_size=None)),
        ("*.mlp.*", QuantConfig(bits=2, group_size=64, init="mse", scale_rank=1)))),
    # llama.cpp's block types (ggml-quants.c): trained on exactly the grid the GGUF export stores, so that export is
    # bit-exact. Q8_0: w = d * q, q in [-128, 127]; Q4_0: w = d * (c - 8), c in [0, 15]; Q4_1: w = d * c + m; fp16 d, m.
    "q8_0": QuantConfig(bits=8, group_size=32, symmetric=True, zero_domain="none", init="ggml"),
    "q4_0": QuantConfig(bits=4, group_size=32, symmetric=True, zero_domain="none", init="ggml"),
    "q4_1": QuantConfig(bits=4, group_size=32, zero_domain="float", init="ggml"),
    # K-quants (two-level: the sub-block scales and mins are integers under an fp16 super-block scale, trained
    # through the same STE); bits per weight 2.625, 3.4375, 4.5, 6.5625. Rows not a multiple of 256 fall back.
    # init rtn (min/max) measured better than llama.cpp's search (init="ggml", lower weight MSE): SmolLM2-135M PTQ
    # ppl q2_k 103.0 vs 135.1, q3_k 19.14 vs 19.25, q6_k 13.61 vs 13.62, q4_k equal (docs/BENCHMARKS.md).
    "q2_k": QuantConfig(bits=2, group_size=16, scheme="kquant"),
    "q3_k": QuantConfig(bits=3, group_size=16, symmetric=True, scheme="kquant"),
    "q4_k": QuantConfig(bits=4, group_size=32, scheme="kquant"),
    "q6_k": QuantConfig(bits=6, group_size=16, symmetric=True, scheme="kquant"),
    "lut2g32": QuantConfig(bits=2, group_size=32, scheme="lut", init="mse"),  # k-means codebook
    "lut3g64": QuantConfig(bits=3, group_size=64, scheme="lut", init="mse"),
    "lut4g64": QuantConfig(bits=4, group_size=64, scheme="lut", init="mse"),
}


def get_preset(name: str) -> QuantConfig:
    """Return the preset called `name`; unknown names raise a ValueError listing the choices."""
    if name not in PRESETS:
        raise ValueError(f"unknown quantisation preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


def quant_config_dict(cfg: QuantConfig) -> dict:
    """JSON-friendly form of a QuantConfig (for run configs, manifests and the export header)."""
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    out["include"], out["exclude"] = list(cfg.include), list(cfg.exclude)
    out["overrides"] = [[pattern, quant_config_dict(c)] for pattern, c in cfg.overrides]
    if cfg.scale_bits == 16:  # the default, left out: configs (and the digests of them) from before the field agree
        del out["scale_bits"]
    return out


def quant_config_from_dict(data: dict) -> QuantConfig:
    """Inverse of `quant_config_dict`."""
    data = dict(data)
    data["include"] = tuple(data.get("include", ("*",)))
    data["exclude"] = tuple(data.get("exclude", ()))
    data["overrides"] = tuple((p, quant_config_from_dict(c)) for p, c in data.get("overrides", ()))
    return replace(QuantConfig(), **data)



def check_quantizer_file(path: str) -> None:
    """--quantizer is an intact safetensors file (its header read, not its tensors)."""
    from safetensors import SafetensorError, safe_open  # imported here: the presets stay a leaf

    from qat_lora.runtime.files import first_line

    if path and not Path(path).is_file():
        raise ValueError(f"--quantizer {path}: no such file; pass a qat run's quantizer.safetensors")
    try:
        if path:
            safe_open(path, "pt").keys()  # the header only: a cut-short file fails here
    except SafetensorError as e:
        raise ValueError(f"--quantizer {path}: damaged or truncated ({first_line(e)}); use the run's intact copy or "
                         "rerun the stage that wrote it") from None
