"""The configuration of every command, one dataclass each; CLI flags map 1:1 to their fields.

Every field carries its help text (what `--help` prints) and every config validates itself in
`__post_init__`, so a bad value fails in one line before any model is loaded or any folder is touched.
The student (model + quantisation preset + trained quantiser) is one spec, `StudentSpec`, shared by the
train, eval and export configs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from qat_lora.data import models
from qat_lora.runtime.checks import (MAX_LR, MAX_LR_RATIO, MAX_TEMPERATURE, check_adapter, check_gguf_export, check_output_file,
                            check_quantizer_file, model_context, require_at_most, require_device, require_non_negative,
                            require_positive, require_precision, require_seed)
from qat_lora.data.text import TextDecoding, list_text_files
from qat_lora.runtime.device import MATMUL_PRECISIONS
from qat_lora.runtime.files import check_out_apart_from_inputs, read_record
from qat_lora.train.loss import KDLossConfig
from qat_lora.quant.fake_quant import get_preset
from qat_lora.runtime.runs import recorded_quant

# The names config_data.py imports.
_require_positive, _require_non_negative = require_positive, require_non_negative

# What each training preset trains: LoRA adapters over the frozen quantised base, the quantiser's own
# parameters (scales, zeros, codebooks, low-rank scale factors; LSQ-style), the latent weights themselves
# (straight-through estimator: the codes move; ParetoQ / EfficientQAT), or a combination.
TRAIN_PRESETS: dict[str, tuple[str, ...]] = {
    "recovery-lora": ("lora",),
    "qat": ("quantizer",),
    "qat+lora": ("lora", "quantizer"),
    "weight-qat": ("weights", "quantizer"),
}
PARALLEL_MODES = ("auto", "processes", "spmd", "fsdp")
STORAGE_DTYPES = ("fp32", "bf16")
REPORT_TO = ("none", "tensorboard", "wandb")
LORA_INITS = ("zero", "calibrated")


def check_lora_init(value: str, folder_allowed: bool) -> None:
    """--lora-init: zero, calibrated, or (train only) a PEFT adapter folder to start from."""
    if value in LORA_INITS or (folder_allowed and (Path(value) / "adapter_config.json").is_file()):
        return
    choices = "zero, calibrated or an adapter folder (with adapter_config.json)" if folder_allowed else \
        "zero or calibrated"
    raise ValueError(f"--lora-init {value!r}: choose {choices}")


@dataclass
class TextInput:
    """How a command decodes the text files it reads: a non-UTF-8 corpus is named, or decoded as the user says."""

    text_encoding: str = field(default="utf-8", metadata={"help": "encoding of the text files read (e.g. latin-1, "
                                                                  "cp1252)"})
    text_errors: str = field(default="strict", metadata={"help": "bytes that do not decode: strict (stop, naming the "
                                                                 "file), replace or ignore"})

    def text_decoding(self) -> TextDecoding:
        """Raises ValueError naming --text-encoding / --text-errors when Python knows no such codec or handler."""
        return TextDecoding(self.text_encoding, self.text_errors)


@dataclass
class StudentSpec:
    """The quantised student: a full-precision model, a quantisation preset, and optionally a qat run's
    trained quantiser. Train, eval and export share these flags and their checks."""

    model: str = field(default="", metadata={"help": "full-precision model (transformers folder, .gguf, hub name, or "
                                                     "a fetch-assets teacher: smollm2-135m, gemma3-270m)",
                                             "required": True})
    quant: str = field(default="w3g64", metadata={"help": "quantisation preset (see `qat-lora presets`)"})
    quantizer: str = field(default="", metadata={"help": "a qat run's quantizer.safetensors (its trained scales, "
                                                          "zeros, codebooks); the student must use the same --quant"})

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("--model is required: the full-precision model folder, .gguf file or hub name")
        self.quant_from_run()  # every command: a quantiser or adapter is refused under another preset than its run's
        if self.quant:
            get_preset(self.quant)
        if self.quantizer and not self.quant:
            raise ValueError("--quantizer needs --quant: it belongs to a quantised student (pass the run's --quant)")
        models.check_model(self.model)  # a missing folder or a damaged config.json, in milliseconds

    def _check_quantizer_file(self) -> None:
        check_quantizer_file(self.quantizer)

    def quant_from_run(self) -> None:
        """Eval and export read --quant from the run that wrote --adapter / --quantizer (not re-typed): an empty
        --quant becomes the run's; a different one is refused (the student would silently be another)."""
        self._check_quantizer_file()  # a typo in the path is the error to report, not the --quant it would give
        for flag, path in (("--adapter", getattr(self, "adapter", "")), ("--quantizer", self.quantizer)):
            found = recorded_quant(path) if path else None
            if found is None:
                continue
            quant, record = found
            if not self.quant:
                self.quant = quant
            elif self.quant != quant:
                raise ValueError(f"--quant {self.quant}: {flag} {path} was trained with --quant {quant} ({record}); "
                                 f"drop --quant or pass --quant {quant}")

    def student_spec(self) -> "StudentSpec":
        """Just the student part of a command's config."""
        return StudentSpec(self.model, self.quant, self.quantizer)


@dataclass
class TrainConfig(StudentSpec):
    cache: str = field(default="caches/kd", metadata={"help": "KD cache folder from build-cache"})
    preset: str = field(default="recovery-lora", metadata={"help": "what trains: recovery-lora, qat (quantiser "
                                                                    "scales/zeros), qat+lora, or weight-qat (the "
                                                                    "latent weights and the quantiser)"})
    out: str = field(default="runs/recovery", metadata={"help": "run folder (adapters, metrics, config)"})
    max_steps: int = field(default=200, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=4, metadata={"help": "sequences per micro-step (per chip)"})
    accumulation_steps: int = field(default=1, metadata={"help": "micro-steps per optimizer step"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (AdamW)"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warm-up steps"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine floor as a fraction of --lr"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (never applied to latent weights)"})
    weight_lr_ratio: float = field(default=0.1, metadata={"help": "weight-qat: learning rate of the latent weights "
                                                                  "as a fraction of --lr"})
    quantizer_lr_ratio: float = field(default=1.0, metadata={"help": "qat, qat+lora, weight-qat: learning rate of the "
                                                                     "quantiser's scales and zeros as a fraction of "
                                                                     "--lr (qat+lora: the adapter keeps --lr)"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm (inf: no clipping)"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (scale = alpha / r)"})
    lora_init: str = field(default="zero", metadata={
        "help": "LoRA start: zero (B = 0: the quantised student), calibrated (each pair the best rank-r "
                "correction of its layer's quantisation error on --lora-init-sequences of the cache's training "
                "text; needs --model's full-precision weights) or a PEFT adapter folder (same rank and modules)"})
    lora_init_sequences: int = field(default=128, metadata={"help": "--lora-init calibrated: calibration sequences "
                                                                          "(the first of the cache's training split; "
                                                                          "all of them if it holds fewer)"})
    temperature: float = field(default=1.0, metadata={"help": "KD temperature"})
    alpha: float = field(default=1.0, metadata={"help": "weight of the KD term; 1 - alpha on hard-label CE"})
    renormalize_topk: bool = field(default=False, metadata={"help": "baseline only: renormalise teacher and student "
                                                                     "over the K ids, dropping the tail (biased)"})
    online_teacher: str = field(default="", metadata={"help": "a teacher run inside each step instead of the cache's "
                                                              "targets: its whole distribution over the vocabulary is "
                                                              "the target (--cache then gives the token sequences and "
                                                              "the held-out split); same tokenizer as --model"})
    online_teacher_dtype: str = field(default="fp32", metadata={"help": "--online-teacher weights and activations: "
                                                                        "fp32 or bf16 (half the memory; the loss is "
                                                                        "fp32 either way)"})
    save_steps: int = field(default=0, metadata={"help": "checkpoint every N steps (0 = only on SIGTERM/SIGINT)"})
    keep_checkpoints: int = field(default=3, metadata={"help": "keep the newest K checkpoints (0 = all)"})
    resume: str = field(default="", metadata={"help": "auto (newest checkpoint in --out, if any) or a "
                                                      "checkpoint-N folder"})
    eval_steps: int = field(default=0, metadata={"help": "held-out KD eval every N steps and at the end; keeps "
                                                         "best/ (0 = off)"})
    log_steps: int = field(default=10, metadata={"help": "read and write metrics every N steps"})
    report_to: str = field(default="none", metadata={"help": "also send metrics to tensorboard (OUT/tensorboard) "
                                                            "or wandb (OUT/wandb; offline unless WANDB_MODE / "
                                                            "WANDB_API_KEY say online), master rank only; none"})
    tensorboard: bool = field(default=False, metadata={"help": "the same as --report-to tensorboard"})
    seed: int = field(default=0, metadata={"help": "seed for LoRA init and data order"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, xla or tpu"})
    num_chips: int = field(default=0, metadata={"help": "devices to train on: TPU chips, GPUs or CPU processes; 0 = "
                                                        "every TPU chip of the host, one device elsewhere (global "
                                                        "batch = chips x --batch-size x accumulation)"})
    parallel: str = field(default="auto", metadata={"help": "with several chips: processes (one per chip), spmd (one "
                                                            "XLA process, batch sharded), fsdp (spmd with the "
                                                            "parameters sharded too: models larger than one chip) "
                                                            "or auto"})
    storage_dtype: str = field(default="fp32", metadata={"help": "frozen student weights: fp32, or bf16 (recovery-lora: "
                                                                 "Wq stored once in bf16, no fp32 latent weight; "
                                                                 "half the memory)"})
    precision: str = field(default="auto", metadata={"help": "auto (bf16 autocast on CUDA and TPU, fp32 on the CPU), "
                                                             "fp32 or bf16"})
    matmul_precision: str = field(default="default", metadata={
        "help": "fp32 matmuls: default (the backend's: one bf16 pass on TPU), high (TPU: 3 passes; CUDA: TF32) or "
                "highest (TPU: 6 passes, ~fp32); recorded in config.json"})
    loss_chunk_size: int = field(default=-1, metadata={"help": "positions per lm_head+loss chunk, each chunk's "
                                                                  "logits freed after its gradient (-1 = auto: 128 on "
                                                                  "the CPU, 1024 on XLA and CUDA; 0 = full logits)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute each decoder layer in backward "
                                                                          "(torch_xla's checkpoint on XLA)"})
    attn_implementation: str = field(default="auto", metadata={"help": "auto (eager on XLA, sdpa elsewhere), eager, sdpa"})
    xla_cache_dir: str = field(default="auto", metadata={"help": "persistent XLA compile cache folder (XLA devices "
                                                               "only): auto (~/.cache/qat-lora/xla), off, or a folder"})
    dist_timeout_s: float = field(default=600.0, metadata={"help": "seconds a rank waits for the others in a "
                                                               "collective (set-up included) before giving up; the "
                                                               "launcher then names the rank that hung"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing run in --out"})

    def __post_init__(self) -> None:
        if self.loss_chunk_size < -1:
            raise ValueError(f"--loss-chunk-size {self.loss_chunk_size}: must be -1 (auto), 0 (full logits) or a "
                             "number of positions")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"--matmul-precision {self.matmul_precision!r}: choose one of {', '.join(MATMUL_PRECISIONS)}")
        require_precision(self.precision)
        require_positive(self, "max_steps", "batch_size", "accumulation_steps", "log_steps")
        require_non_negative(self, "num_chips", note=" (0 = every chip of the host)")
        require_non_negative(self, "save_steps", "keep_checkpoints", "eval_steps", "warmup_steps", note=" (0 = off)")
        require_positive(self, "lr", "weight_lr_ratio", "quantizer_lr_ratio", "lora_alpha", "temperature",
                         "dist_timeout_s", finite=True)
        require_at_most(self, lr=MAX_LR, temperature=MAX_TEMPERATURE, weight_lr_ratio=MAX_LR_RATIO,
                        quantizer_lr_ratio=MAX_LR_RATIO)
        # clip_grad_norm_ scales by max_norm / norm capped at 1: a negative norm reverses the update, 0 erases it;
        # inf is a valid "no clipping" (the factor caps at 1).
        require_positive(self, "max_grad_norm", "lora_r")
        require_non_negative(self, "weight_decay", finite=True)
        require_seed(self.seed)
        require_device(self.device)
        if self.dist_timeout_s > 1e9:  # a datetime.timedelta overflows past ~8.6e13 s: a traceback at set-up
            raise ValueError(f"--dist-timeout-s {self.dist_timeout_s}: at most 1e9 seconds")
        if not 0.0 < self.min_lr_ratio <= 1.0:
            # A floor of exactly 0 would also make the last step's lr a special XLA scalar (a recompile).
            raise ValueError(f"--min-lr-ratio {self.min_lr_ratio}: must be in (0, 1]")
        if self.preset not in TRAIN_PRESETS:
            raise ValueError(f"--preset {self.preset!r}: choose one of {', '.join(TRAIN_PRESETS)}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"--parallel {self.parallel!r}: choose one of {', '.join(PARALLEL_MODES)}")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"--storage-dtype {self.storage_dtype!r}: choose {' or '.join(STORAGE_DTYPES)}")
        if self.storage_dtype != "fp32" and TRAIN_PRESETS.get(self.preset) != ("lora",):
            raise ValueError(f"--storage-dtype {self.storage_dtype} --preset {self.preset}: the latent weights and "
                             "quantiser train, so they stay fp32; use --preset recovery-lora or --storage-dtype fp32")
        check_lora_init(self.lora_init, folder_allowed=True)
        require_positive(self, "lora_init_sequences")
        if self.lora_init not in LORA_INITS:  # an adapter folder: its rank and alpha, before any folder is touched
            saved = read_record(Path(self.lora_init) / "adapter_config.json") or {}
            if (saved.get("r"), saved.get("lora_alpha")) != (self.lora_r, self.lora_alpha):
                raise ValueError(f"--lora-init {self.lora_init}: an adapter of rank {saved.get('r')} and alpha "
                                 f"{saved.get('lora_alpha')}; this run has --lora-r {self.lora_r} and --lora-alpha "
                                 f"{self.lora_alpha}; pass the same, or another --lora-init")
        if self.lora_init != "zero" and "lora" not in TRAIN_PRESETS.get(self.preset, ()):
            raise ValueError(f"--lora-init {self.lora_init} --preset {self.preset}: that preset trains no LoRA; "
                             "use --lora-init zero or a LoRA preset")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite exclude each other")
        if not self.quant:
            raise ValueError("--quant is required for training: a quantisation preset (see `qat-lora presets`)")
        self.loss_config()
        self._check_online_teacher()
        if self.tensorboard and self.report_to not in ("none", "tensorboard"):
            raise ValueError(f"--tensorboard means --report-to tensorboard; drop it or --report-to {self.report_to}")
        self.report_to = "tensorboard" if self.tensorboard else self.report_to
        if self.report_to not in REPORT_TO:
            raise ValueError(f"--report-to {self.report_to!r}: choose one of {', '.join(REPORT_TO)}")
        if self.report_to != "none":
            import importlib.util

            if importlib.util.find_spec(self.report_to) is None:
                raise ValueError(f"--report-to {self.report_to}: the {self.report_to} package is not installed; pip "
                                 f"install {self.report_to} (or 'qat-lora[{self.report_to}]')")
        super().__post_init__()

    def _check_online_teacher(self) -> None:
        if self.online_teacher_dtype not in STORAGE_DTYPES:
            raise ValueError(f"--online-teacher-dtype {self.online_teacher_dtype!r}: choose "
                             f"{' or '.join(STORAGE_DTYPES)}")
        if not self.online_teacher:
            if self.online_teacher_dtype != "fp32":
                raise ValueError("--online-teacher-dtype needs --online-teacher (the cache's targets have no dtype "
                                 "to choose); drop it or pass --online-teacher")
            return
        models.check_model(self.online_teacher)  # a typo fails here, not after the student has loaded
        if self.renormalize_topk:
            raise ValueError("--renormalize-topk is a top-K baseline; --online-teacher has the whole distribution: "
                             "drop one of them")

    def loss_config(self) -> KDLossConfig:
        return KDLossConfig(self.temperature, self.alpha, self.renormalize_topk)


@dataclass
class EvalConfig(TextInput, StudentSpec):
    quant: str = field(default="", metadata={"help": "quantisation preset (default: the one the run of --adapter / "
                                                     "--quantizer recorded; none: the model unquantised)"})
    adapter: str = field(default="", metadata={"help": "PEFT adapter folder (a run's adapter/) to attach"})
    text: list[str] = field(default_factory=list, metadata={"help": "held-out text files or folders for perplexity"})
    cache: str = field(default="", metadata={"help": "KD cache whose held-out split gives KD loss and top-1"})
    seq_len: int = field(default=512, metadata={"help": "perplexity context (non-overlapping windows)"})
    max_tokens: int = field(default=20_000, metadata={"help": "perplexity token budget (0 = all)"})
    batch_size: int = field(default=4, metadata={"help": "sequences per forward"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, xla or tpu"})
    precision: str = field(default="auto", metadata={"help": "autocast as in training: auto (bf16 on CUDA and TPU, "
                                                             "fp32 on the CPU), fp32 or bf16"})
    xla_cache_dir: str = field(default="auto", metadata={"help": "persistent XLA compile cache folder (XLA devices "
                                                               "only): auto (~/.cache/qat-lora/xla), off, or a folder"})
    json_out: str = field(default="", metadata={"help": "write the results here as JSON"})

    def __post_init__(self) -> None:
        if not self.text and not self.cache:
            raise ValueError("eval: pass --text (perplexity) and/or --cache (KD metrics)")
        require_positive(self, "seq_len", "batch_size")
        require_non_negative(self, "max_tokens", note=" (0 = all)")
        require_device(self.device)
        check_adapter(self.adapter)
        self.quant_from_run()
        if self.adapter and not self.quant:
            raise ValueError("--adapter needs --quant: it belongs to a quantised student (pass the run's --quant)")
        self.text_decoding()
        require_precision(self.precision)
        super().__post_init__()
        if self.text:
            list_text_files(self.text, "--text")  # a typo in --text fails before the model loads
            limit = model_context(self.model)
            if limit is not None and self.seq_len > limit:
                raise ValueError(f"--seq-len {self.seq_len}: longer than the model's context ({limit} positions)")
        check_output_file(self.json_out, "--json-out")
        if self.json_out:  # e.g. a file inside --model's folder, or --quantizer itself
            check_out_apart_from_inputs(self.json_out, {"--model": self.model, "--adapter": self.adapter,
                                                        "--quantizer": self.quantizer, "--cache": self.cache,
                                                        "--text": self.text}, "--json-out")


DATA_INITS = ("none", "act", "gptq")


@dataclass
class QuantizeConfig(StudentSpec):
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

    def __post_init__(self) -> None:
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
        if not self.quant:
            raise ValueError("--quant is required: the quantisation preset to initialise")
        if self.quantizer:
            raise ValueError("--quantizer: quantize builds a new init from the preset; pass its output to train, "
                             "eval or export instead")
        super().__post_init__()


QAT_STAGES = ("none", "weight-qat", "qat")

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


@dataclass
class RecoverConfig(StudentSpec):
    """The whole recovery recipe: init (-> block-wise) -> end-to-end QAT -> recovery LoRA, each stage in its own
    sub-folder."""

    cache: str = field(default="caches/kd", metadata={"help": "KD cache: targets for every stage, and calibration"})
    out: str = field(default="runs/recover", metadata={"help": "run folder: init/, qat/, lora/ and recover.json"})
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
    qat_lr: float = field(default=5e-4, metadata={"help": "stage 2: peak learning rate of scales and zeros"})
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
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, xla or tpu"})

    def __post_init__(self) -> None:
        if self.init not in DATA_INITS:
            raise ValueError(f"--init {self.init!r}: choose one of {', '.join(DATA_INITS)}")
        if self.qat not in QAT_STAGES:
            raise ValueError(f"--qat {self.qat!r}: choose one of {', '.join(QAT_STAGES)}")
        check_lora_init(self.lora_init, folder_allowed=False)
        require_positive(self, "calib_sequences", "qat_steps", "lora_r", "batch_size", "accumulation_steps")
        require_non_negative(self, "lora_steps", "save_steps", "blockwise_steps")
        if isinstance(self.lr, (int, float)):  # RecoverConfig(lr=1e-3) from Python: one rate, no probe
            self.lr = [float(self.lr)]
        if not self.lr:  # resolved here, so recover.json and a rerun see the rates that were probed
            self.lr = lora_probe_rates(self.lora_r)
        if len(set(self.lr)) != len(self.lr):
            raise ValueError(f"--lr {' '.join(f'{x:g}' for x in self.lr)}: a rate is repeated; list each once")
        rates = ("qat_lr", "weight_lr", "blockwise_lr", "blockwise_quant_lr")
        for lr in self.lr:  # each checked like a single rate, named by the flag
            require_positive(SimpleNamespace(lr=lr), "lr", finite=True)
            require_at_most(SimpleNamespace(lr=lr), lr=MAX_LR)
        require_positive(self, *rates, finite=True)
        require_at_most(self, **dict.fromkeys(rates, MAX_LR))
        require_non_negative(self, "lr_probe_steps")
        require_seed(self.seed)
        require_device(self.device)  # it reaches the device only in stage 2, after the init has run
        if not self.quant:
            raise ValueError("--quant is required: the quantisation preset to recover")
        if self.quantizer:
            raise ValueError("--quantizer: recover builds its own init; to start from a trained quantiser use "
                             "qat-lora train --quantizer")
        super().__post_init__()


def field_defaults(cls) -> dict:
    """{field name: default} of a config dataclass: what a config saved before a field existed meant by it."""
    return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for f in dataclasses.fields(cls)}


def to_argv(cfg) -> list[str]:
    """The command-line flags that rebuild `cfg` (the inverse of the CLI's parsing; defaults left out)."""
    argv: list[str] = []
    for name, default in field_defaults(type(cfg)).items():
        value = getattr(cfg, name)
        if value == default:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    return argv
