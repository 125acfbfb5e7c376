"""The configs of the recipe commands (flags 1:1): `eval`, `quantize` (the init stage), `recover` (init -> optional
QAT -> LoRA), `generate` / `chat` and `demo` (with its budgets, and the rates recover probes and the demo uses).
The stages' own configs: data/config.py, cache/config.py, train/config.py (StudentSpec, TrainConfig), export/config.py.
"""
from __future__ import annotations

from dataclasses import Field, dataclass, field
from types import SimpleNamespace

from qat_lora.data.config import TextInput
from qat_lora.data.models import is_packed_export, model_context
from qat_lora.data.text import list_text_files
from qat_lora.runtime.files import check_out_apart_from_inputs
from qat_lora.runtime.options import (MAX_LR, DeviceInput, PrecisionInput, check_output_file, explicit_fields,
                                      paths_as_flags, refuse_unused_flags, require_at_most, require_non_negative,
                                      require_positive, require_seed)
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.cache.encodings import encoding_from_flags
from qat_lora.commands.budget import BUDGET_PRESETS, BUDGET_RANKS, lora_probe_rates, qat_rate, rate_at_rank
from qat_lora.quant.fake_quant import get_preset
from qat_lora.train.config import StudentSpec, check_adapter, check_lora_init

EVAL_KIND = "eval"  # the stamp of an eval's --json-out: only such a file is replaced by the next eval
DATA_INITS = ("none", "act", "gptq")


@dataclass
class EvalConfig(TextInput, StudentSpec, DeviceInput, PrecisionInput):
    quant: str = field(default="", metadata={"help": "quantisation preset (default: the one the run of --adapter / "
                                                     "--quantizer recorded; with neither, or none: the model "
                                                     "unquantised)"})
    adapter: str = field(default="", metadata={"help": "PEFT adapter folder (a run's adapter/) to attach"})
    text: list[str] = field(default_factory=list, metadata={"help": "held-out text files or folders for perplexity"})
    cache: str = field(default="", metadata={"help": "KD cache whose held-out split gives KD loss and top-1"})
    seq_len: int = field(default=512, metadata={"help": "perplexity context (non-overlapping windows)"})
    max_tokens: int = field(default=20_000, metadata={"help": "perplexity token budget (0 = all)"})
    batch_size: int = field(default=4, metadata={"help": "sequences per forward"})
    device: str = DeviceInput.device_field()
    precision: str = PrecisionInput.precision_field("as in training: ")
    xla_cache_dir: str = DeviceInput.xla_cache_dir_field()
    json_out: str = field(default="", metadata={"help": "write the results here as JSON"})

    def __post_init__(self) -> None:
        paths_as_flags(self)
        if not self.text and not self.cache:
            raise ValueError("eval: pass --text (perplexity) and/or --cache (KD metrics)")
        if self.quant == "none":  # unquantised (the teacher, an export's folder); a run's files need its preset
            if self.adapter or self.quantizer:
                raise ValueError("--quant none: --adapter / --quantizer need their run's preset; leave --quant out")
            self.quant = ""
        require_positive(self, "seq_len", "batch_size")
        require_non_negative(self, "max_tokens", note=" (0 = all)")
        self.check_device()
        check_adapter(self.adapter)
        self.quant_from_run()
        if self.adapter and not self.quant and not is_packed_export(self.model):
            raise ValueError("--adapter needs --quant: it belongs to a quantised student (pass the run's --quant)")
        self.text_decoding()
        self.check_precision()
        refuse_unused_flags(self)
        super().__post_init__()
        if self.text:
            list_text_files(self.text, "--text")  # a typo in --text fails before the model loads
            limit = model_context(self.model)
            if limit is not None and self.seq_len > limit:
                raise ValueError(f"--seq-len {self.seq_len}: longer than the model's context ({limit} positions)")
        check_output_file(self.json_out, "--json-out", EVAL_KIND)
        if self.json_out:  # e.g. a file inside --model's folder, or --quantizer itself
            check_out_apart_from_inputs(self.json_out, {"--model": self.model, "--adapter": self.adapter,
                                                        "--quantizer": self.quantizer, "--cache": self.cache,
                                                        "--text": self.text}, "--json-out")

    def unused_flags(self) -> dict[str, str]:
        """{field: what it needs} for the flags that do nothing under these options (refused when typed)."""
        unused = {} if self.text else dict.fromkeys(("seq_len", "max_tokens", "text_encoding", "text_errors"),
                                                    "--text (they set how its perplexity is measured)")
        if self.device in ("cpu", "cuda"):
            unused["xla_cache_dir"] = f"an XLA device (--device xla, tpu or auto; not {self.device})"
        return unused


def _own_init(config: StudentSpec, purpose: str, instead: str) -> None:
    """quantize and recover build their own init from --quant: the preset is required, --quantizer refused."""
    if not config.quant:
        raise ValueError(f"--quant is required: the quantisation preset to {purpose}")
    if config.quantizer:
        raise ValueError(f"--quantizer: {instead}")


@dataclass
class QuantizeConfig(StudentSpec, DeviceInput):
    init: str = field(default="gptq", metadata={"help": "data-aware initialisation on top of the preset's own: gptq "
                                                        "(Hessian-aware rounding, weights move), act (clipping search "
                                                        "weighted by activations) or none"})
    cache: str = field(default="", metadata={"help": "KD cache whose training split calibrates the init (required "
                                                     "for act and gptq)"})
    calib_sequences: int = field(default=128, metadata={"help": "calibration sequences from the cache's training split"})
    batch_size: int = field(default=8, metadata={"help": "calibration sequences per forward"})
    damp: float = field(default=0.01, metadata={"help": "gptq: damping, as a fraction of the mean Hessian diagonal"})
    act_order: bool = field(default=False, metadata={"help": "gptq: quantise columns by decreasing activation energy"})
    blockwise_steps: int = field(default=0, metadata={"help": "block-wise reconstruction after the init: optimizer "
                                                              "steps per decoder block (0 = off)"})
    blockwise_lr: float = field(default=1e-3, metadata={"help": "block-wise: learning rate of the latent weights"})
    blockwise_quant_lr: float = field(default=1e-4, metadata={"help": "block-wise: learning rate of scales, zeros"})
    out: str = field(default="runs/init", metadata={"help": "folder for quantizer.safetensors, quantize.json and "
                                                            "blocks/ (block-wise progress)"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing init in --out"})
    device: str = DeviceInput.device_field(": each decoder layer runs there in turn while the model stays on the host "
                                           "(GPTQ's column loop: on CUDA there, else on the host; block-wise "
                                           "reconstruction's steps there too)")

    def __post_init__(self) -> None:
        paths_as_flags(self)
        self.check_device()
        if self.init not in DATA_INITS:
            raise ValueError(f"--init {self.init!r}: choose one of {', '.join(DATA_INITS)}")
        if self.init != "none" and not self.cache:
            raise ValueError(f"--init {self.init} needs --cache: its training split calibrates the init")
        if self.blockwise_steps and not self.cache:
            raise ValueError("--blockwise-steps needs --cache: the blocks are fitted on its training split")
        require_positive(self, "calib_sequences", "batch_size")
        require_positive(self, "blockwise_lr", "blockwise_quant_lr", finite=True)
        require_at_most(self, blockwise_lr=MAX_LR, blockwise_quant_lr=MAX_LR)
        require_non_negative(self, "blockwise_steps")
        if self.blockwise_steps and self.batch_size > self.calib_sequences:
            raise ValueError(f"--batch-size {self.batch_size}: block-wise steps draw batches from the "
                             f"{self.calib_sequences} --calib-sequences; use at most that many")
        if not 0.0 < self.damp < 1.0:
            raise ValueError(f"--damp {self.damp}: must be in (0, 1)")
        _own_init(self, "initialise", "quantize builds a new init from the preset; pass its output to train, eval "
                  "or export instead")
        refuse_unused_flags(self)
        super().__post_init__()

    def unused_flags(self) -> dict[str, str]:
        """{field: what it needs} for the flags that do nothing under these options (refused when typed)."""
        unused = {} if self.init == "gptq" else dict.fromkeys(("damp", "act_order"), f"--init gptq (not {self.init})")
        if not self.blockwise_steps:
            unused.update(dict.fromkeys(("blockwise_lr", "blockwise_quant_lr"), "--blockwise-steps > 0"))
            if self.init == "none":  # nothing reads the cache: no calibration, no block-wise steps
                unused.update(dict.fromkeys(("cache", "calib_sequences", "batch_size"),
                                            "--init act or gptq, or --blockwise-steps > 0 (--init none calibrates "
                                            "nothing)"))
        return unused


QAT_STAGES = ("none", "weight-qat", "qat")

@dataclass
class RecoverConfig(StudentSpec, DeviceInput):
    """The whole recovery recipe: init (-> block-wise) -> end-to-end QAT (off by default) -> recovery LoRA, each
    stage in its own sub-folder."""

    cache: str = field(default="caches/kd", metadata={"help": "KD cache: targets for every stage, and calibration"})
    out: str = field(default="runs/recover", metadata={"help": "run folder: init/, qat/, lora/ and recover.json"})
    # Chosen on the model's own shapes before stage 1 (commands/budget.py: choose_budget) and recorded in
    # recover.json; the chosen --quant, --lora-r, --lora-steps and --qat then run as if typed.
    budget_bits: float = field(default=0.0, metadata={
        "help": "ship within this many bits per quantised weight, base + unmerged adapter, counted on --model: "
                f"--quant is the one of {' '.join(BUDGET_PRESETS)} with the most bits that fit, --lora-r the "
                f"largest of {' '.join(map(str, BUDGET_RANKS))} that fits beside it; when none fits, no adapter "
                "and --qat qat (0 = off: --quant and --lora-r as given)"})
    init: str = field(default="gptq", metadata={"help": "stage 1, data-aware init: gptq, act or none"})
    # 128: 512 and 1,024 sequences were no better on the held-out split, on the corpus or on teacher text, at 3-6x
    # the time (SmolLM2 w3g64; docs/RESULTS.md, "GPTQ calibration size").
    calib_sequences: int = field(default=128, metadata={"help": "stage 1: calibration sequences of the cache"})
    blockwise_steps: int = field(default=0, metadata={"help": "stage 1b, block-wise reconstruction after the init: "
                                                              "optimizer steps per decoder block (0 = skip)"})
    blockwise_lr: float = field(default=1e-3, metadata={"help": "stage 1b: learning rate of the latent weights"})
    blockwise_quant_lr: float = field(default=1e-4, metadata={"help": "stage 1b: learning rate of scales and zeros"})
    # Default "none": at cpu-small (w3g64, GPTQ start) weight-qat then LoRA measured 22.35 ppl against 21.88 for
    # LoRA alone on half the tokens (docs/RESULTS.md); the stage stays one flag away for on-grid deployments.
    qat: str = field(default="none", metadata={"help": "stage 2, end-to-end KD of the quantised weights: "
                                                       "none (measured best before LoRA), weight-qat (weights + "
                                                       "scales/zeros, left on the grid) or qat (scales/zeros)"})
    qat_steps: int = field(default=200, metadata={"help": "stage 2: optimizer steps"})
    qat_lr: float = field(default=0.0, metadata={"help": "stage 2: peak learning rate of scales and zeros (0 = by "
                                                         "the preset's width: 1e-3 at 2 bits, 5e-4 at 3, 2e-4 at 4 "
                                                         "or more, as measured best on SmolLM2)"})
    weight_lr: float = field(default=2e-3, metadata={"help": "stage 2 (weight-qat): peak learning rate of the weights"})
    lora_steps: int = field(default=200, metadata={"help": "stage 3, recovery LoRA over the stage-2 student: "
                                                           "optimizer steps (0 = no LoRA: the result is on the grid)"})
    # Several rates = a probe: each trains --lr-probe-steps steps from the same init and the lowest held-out KD
    # loss of the cache wins (never the eval text). SmolLM2's 2e-3 lost to its own init on Gemma 3 at w4g64, where
    # 5e-4 won: one fixed rate does not transfer between models (docs/RESULTS.md). Empty = LR_PROBE_AT_RANK_16
    # scaled to --lora-r (lora_probe_rates).
    lr: list[float] = field(default_factory=list, metadata={
        "help": "stage 3: peak learning rate of LoRA; several = a short probe of each on the cache's held-out split "
                "chooses one (one value: no probe) (default: 5e-4 1e-3 2e-3 times 16 / --lora-r, e.g. 1.25e-4 "
                "2.5e-4 5e-4 at rank 64)"})
    lr_probe_steps: int = field(default=0, metadata={"help": "stage 3: optimizer steps of each --lr probe run "
                                                             "(0 = a fifth of --lora-steps, 4 to 20)"})
    lora_r: int = field(default=16, metadata={"help": "stage 3: LoRA rank (alpha = 2 r)"})
    # Default calibrated: from the same GPTQ start, at cpu-small, it beat B = 0 on SmolLM2 w3g64 (21.08 vs 22.05
    # ppl) and w2g64 (72.88 vs 88.24) and on Gemma 3 270M w3g64 (20.34 vs 21.67); docs/RESULTS.md.
    lora_init: str = field(default="calibrated", metadata={
        "help": "stage 3: LoRA start, calibrated (each pair the best rank-r correction of its layer's quantisation "
                "error on --calib-sequences of the cache; computed once into lora-init/) or zero (B = 0)"})
    batch_size: int = field(default=4, metadata={"help": "sequences per micro-step (per chip)"})
    accumulation_steps: int = field(default=1, metadata={"help": "micro-steps per optimizer step"})
    save_steps: int = field(default=50, metadata={"help": "checkpoint every N steps in each training stage"})
    seed: int = field(default=0, metadata={"help": "seed for LoRA init and data order"})
    device: str = DeviceInput.device_field()

    def __post_init__(self) -> None:
        paths_as_flags(self)
        if self.init not in DATA_INITS:
            raise ValueError(f"--init {self.init!r}: choose one of {', '.join(DATA_INITS)}")
        if self.qat not in QAT_STAGES:
            raise ValueError(f"--qat {self.qat!r}: choose one of {', '.join(QAT_STAGES)}")
        check_lora_init(self.lora_init, folder_allowed=False)
        require_positive(self, "calib_sequences", "qat_steps", "lora_r", "batch_size", "accumulation_steps")
        require_non_negative(self, "lora_steps", "save_steps", "blockwise_steps")
        if isinstance(self.lr, (int, float)):  # RecoverConfig(lr=1e-3) from Python: one rate, no probe
            self.lr = [float(self.lr)]
        # Resolved here, so recover.json and a rerun see the rates that were probed; with --budget-bits once the
        # budget has chosen the rank (recover resolves it into a config of its own).
        if not self.lr and not self.budget_bits:
            self.lr = lora_probe_rates(self.lora_r)
        if len(set(self.lr)) != len(self.lr):
            raise ValueError(f"--lr {' '.join(f'{x:g}' for x in self.lr)}: a rate is repeated; list each once")
        require_non_negative(self, "qat_lr", finite=True, note=" (0 = by the preset's width)")
        if not self.qat_lr and self.quant and not self.budget_bits:  # a budget: once it has chosen the preset
            self.qat_lr = qat_rate(self.quant)
        rates = ("weight_lr", "blockwise_lr", "blockwise_quant_lr")
        for lr in self.lr:  # each checked like a single rate, named by the flag
            require_positive(SimpleNamespace(lr=lr), "lr", finite=True)
            require_at_most(SimpleNamespace(lr=lr), lr=MAX_LR)
        require_positive(self, *rates, finite=True)
        require_at_most(self, **dict.fromkeys(("qat_lr", *rates), MAX_LR))
        require_non_negative(self, "lr_probe_steps")
        require_non_negative(self, "budget_bits", finite=True, note=" (0 = off)")
        both = sorted(explicit_fields(self) & {"quant", "lora_r"})
        if self.budget_bits and both:
            raise ValueError(f"--budget-bits with --{both[0].replace('_', '-')}: pass --budget-bits or "
                             "--quant/--lora-r, not both")
        require_seed(self.seed)
        self.check_device()  # it reaches the device only in stage 2, after the init has run
        _own_init(self, "recover", "recover builds its own init; to start from a trained quantiser use qat-lora "
                  "train --quantizer")
        refuse_unused_flags(self)
        super().__post_init__()

    def unused_flags(self) -> dict[str, str]:
        """{field: what it needs} for the flags that do nothing under these options (refused when typed)."""
        unused = {}
        if not self.blockwise_steps:
            unused.update(dict.fromkeys(("blockwise_lr", "blockwise_quant_lr"), "--blockwise-steps > 0"))
        # A budget with no room for an adapter runs --qat qat, so its flags may be used.
        qat = "qat" if self.qat == "none" and self.budget_bits else self.qat
        if qat == "none":
            unused.update(dict.fromkeys(("qat_steps", "qat_lr", "weight_lr"), "--qat weight-qat or qat (stage 2)"))
        elif qat != "weight-qat":
            unused["weight_lr"] = f"--qat weight-qat (--qat {self.qat} trains no weights)"
        if not self.lora_steps:
            unused.update(dict.fromkeys(("lr", "lr_probe_steps", "lora_r", "lora_init"),
                                        "--lora-steps > 0 (stage 3, the LoRA)"))
        elif len(self.lr) == 1:
            unused["lr_probe_steps"] = "several --lr rates (one rate is not probed)"
        calibrated_lora = self.lora_steps and self.lora_init == "calibrated"
        if self.init == "none" and not self.blockwise_steps and not calibrated_lora:
            unused["calib_sequences"] = "--init act or gptq, --blockwise-steps > 0 or --lora-init calibrated"
        return unused


@dataclass
class GenerateConfig(StudentSpec, DeviceInput):
    quant: str = field(default="", metadata={"help": "quantisation preset of a student built from a full-precision "
                                                    "--model (empty: --model is used as it is, e.g. an export)"})
    adapter: str = field(default="", metadata={"help": "recovery adapter folder (a run's or an export's adapter/)"})
    prompt: str = field(default="", metadata={"help": "generate: the user message (required)"})
    system: str = field(default="", metadata={"help": "chat: a system message opening the conversation"})
    raw: bool = field(default=False, metadata={"help": "send the prompt as plain text, not in the chat template"})
    max_new_tokens: int = field(default=256, metadata={"help": "tokens to generate per reply"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; > 0 samples at this temperature"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (with --temperature > 0)"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    device: str = DeviceInput.device_field(" (XLA: static KV cache)")

    def __post_init__(self) -> None:
        paths_as_flags(self)
        require_positive(self, "max_new_tokens")
        require_non_negative(self, "temperature", finite=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p {self.top_p}: must be in (0, 1]")
        require_seed(self.seed)
        self.check_device()
        check_adapter(self.adapter)
        refuse_unused_flags(self)
        super().__post_init__()

    def unused_flags(self) -> dict[str, str]:
        """{field: what it needs} for the flags that do nothing under these options (refused when typed)."""
        unused = {} if self.temperature > 0 else dict.fromkeys(
            ("top_p", "seed"), "--temperature > 0 (--temperature 0 decodes greedily: nothing is sampled)")
        if self.prompt:  # generate: one user message; only chat opens with a system message
            unused["system"] = "qat-lora chat (generate sends --prompt alone)"
        return unused


def default_lora_lr(teacher: str, lora_r: int) -> float:
    """The demo's and the notebooks' LoRA rate for a fetch-assets teacher at rank `lora_r`: its measured rank-16
    rate (TeacherAsset.lora_lr) times 16 / r."""
    from qat_lora.data.teachers import teacher_asset  # imported here, as in DemoConfig: no import cycle through models

    return rate_at_rank(teacher_asset(teacher).lora_lr, lora_r)


# What --budget sets, for each flag left at 0. default: about 12 minutes on an idle 2-core CPU (README); quick:
# under 5 minutes there, a first look whose recovered perplexity is worse (docs/BENCHMARKS.md, the demo). GPTQ
# and the calibrated start cost about 2 s per decoder layer whatever the calibration size: the steps, cache and
# eval tokens are what a budget trims.
DEMO_BUDGETS = {"default": {"cache_tokens": 56_000, "calib_sequences": 128, "max_steps": 50, "eval_tokens": 8_192},
                "quick": {"cache_tokens": 13_000, "calib_sequences": 32, "max_steps": 12, "eval_tokens": 2_048}}
# Each budget's default --lr as a fraction of the teacher's rate, which was measured over 50 steps: 15 steps from
# SmolLM2's calibrated w3g64 start at its 2e-3 ended worse than their GPTQ init (56.0 ppl against 31.8), at 5e-4
# they reached 25.1 (docs/BENCHMARKS.md, the demo).
DEMO_LR_FACTORS = {"default": 1.0, "quick": 0.25}


def _budget_field(name: str, help_text: str) -> Field:
    """A flag whose 0 means --budget's value; its help names every budget's."""
    values = ", ".join(f"{budget[name]:,} {key}" for key, budget in DEMO_BUDGETS.items())
    return field(default=0, metadata={"help": f"{help_text} (0 = --budget's: {values})"})


@dataclass
class DemoConfig(DeviceInput):
    assets_dir: str = field(default="", metadata={"help": "asset folder (default: ~/.cache/qat-lora/assets)"})
    teacher: str = field(default="smollm2-135m", metadata={"help": "the teacher fetch-assets prepares: smollm2-135m "
                                                                  "or gemma3-270m"})
    work_dir: str = field(default="runs/demo", metadata={"help": "where the cache, run and results go"})
    quant: str = field(default="w3g64", metadata={"help": "quantisation preset of the student"})
    seq_len: int = field(default=256, metadata={"help": "sequence length for cache, training and eval"})
    encoding: str = field(default="sampled", metadata={"help": "cache targets: sampled (RS-KD) or topk (+ tail)"})
    num_samples: int = field(default=64, metadata={"help": "sampled: teacher draws per position"})
    top_k: int = field(default=64, metadata={"help": "topk: teacher log-probs kept per position"})
    budget: str = field(default="default", metadata={"help": "the time the demo takes: default (about 12 min on a "
                                                             "2-core CPU) or quick (under 5 min, a coarser result); "
                                                             "the four flags below override it"})
    cache_tokens: int = _budget_field("cache_tokens", "teacher tokens to cache (train + held-out)")
    eval_tokens: int = _budget_field("eval_tokens", "Wikipedia tokens for perplexity")
    max_steps: int = _budget_field("max_steps", "optimizer steps (one pass over the cached tokens)")
    batch_size: int = field(default=4, metadata={"help": "sequences per step"})
    lr: float = field(default=0.0, metadata={"help": "peak learning rate (0 = the rate measured best for --teacher "
                                                      "at rank 16, times 16 / --lora-r: 2e-3 for smollm2-135m, "
                                                      "5e-4 for gemma3-270m; a quarter of it for --budget quick's "
                                                      "fewer steps)"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    init: str = field(default="gptq", metadata={"help": "data-aware init before the LoRA: gptq, act or none "
                                                        "(docs/RESULTS.md: w3g64 GPTQ + LoRA 21.9 ppl, RTN + LoRA 25.0)"})
    calib_sequences: int = _budget_field("calib_sequences", "calibration sequences for --init and --lora-init")
    lora_init: str = field(default="calibrated", metadata={
        "help": "LoRA start: calibrated (each adapter the best rank-r correction of its layer's quantisation error; "
                "docs/RESULTS.md: w3g64 21.1 ppl against 22.1 from zero) or zero"})
    device: str = DeviceInput.device_field()

    def __post_init__(self) -> None:
        paths_as_flags(self)
        from qat_lora.data.teachers import teacher_asset

        teacher_asset(self.teacher)  # an unknown name is refused before anything downloads
        get_preset(self.quant)
        if self.budget not in DEMO_BUDGETS:
            raise ValueError(f"--budget {self.budget!r}: choose one of {', '.join(DEMO_BUDGETS)}")
        for name, value in DEMO_BUDGETS[self.budget].items():  # resolved here, so demo.json records what ran
            if getattr(self, name) == 0:
                setattr(self, name, value)
        if self.init not in DATA_INITS:
            raise ValueError(f"--init {self.init!r}: choose one of {', '.join(DATA_INITS)}")
        check_lora_init(self.lora_init, folder_allowed=False)
        # The cache's own checks, before anything downloads (the demo keeps build-cache's --value-bits).
        encoding_from_flags(self.encoding, self.top_k, CacheBuildConfig.value_bits, self.num_samples)
        require_positive(self, "seq_len", "top_k", "cache_tokens", "eval_tokens", "max_steps", "batch_size",
                         "lora_r", "calib_sequences")
        if self.lr == 0:  # resolved here, so demo.json and the run's name carry the rate used
            self.lr = float(f"{default_lora_lr(self.teacher, self.lora_r) * DEMO_LR_FACTORS[self.budget]:.3g}")
        require_positive(self, "lr", finite=True)
        require_at_most(self, lr=MAX_LR)
        self.check_device()
        refuse_unused_flags(self)

    def unused_flags(self) -> dict[str, str]:
        """{field: what it needs} for the flags that do nothing under these options (refused when typed)."""
        unused = {"num_samples": "--encoding sampled"} if self.encoding == "topk" else {"top_k": "--encoding topk"}
        if self.init == "none" and self.lora_init != "calibrated":
            unused["calib_sequences"] = "--init act or gptq, or --lora-init calibrated"
        return unused
