"""The student and training configs: `StudentSpec` (model + quantisation preset + trained quantiser, shared by
every command that builds a student), `TrainConfig` (`qat-lora train`, flags 1:1) with its presets, and the checks
of a LoRA start and of a PEFT adapter folder.

Every field carries its help text (what `--help` prints) and every config validates itself in `__post_init__`, so a
bad value fails in one line before any model is loaded or any folder is touched. The other commands' configs:
data/config.py, cache/config.py, export/config.py, commands/config.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qat_lora.data import models
from qat_lora.runtime.options import (MAX_LR, MAX_LR_RATIO, MAX_TEMPERATURE, DeviceInput, PrecisionInput,
                                      paths_as_flags, refuse_unused_flags, require_at_most, require_non_negative,
                                      require_positive, require_seed)
from qat_lora.runtime.files import read_record
from qat_lora.train.loss import KDLossConfig
from qat_lora.quant.config import check_quantizer_file
from qat_lora.quant.fake_quant import get_preset
from qat_lora.runtime.runs import recorded_quant
from qat_lora.train.adapter import (ADAPTER_WEIGHTS, check_adapter,  # noqa: F401 (imported by the other configs)
                                    resolve_adapter_base)

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
COMPILE_MODES = ("auto", "on", "off", "graphs")
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
class StudentSpec:
    """The quantised student: a full-precision model, a quantisation preset, and optionally a qat run's
    trained quantiser. Train, eval and export share these flags and their checks."""

    model: str = field(default="", metadata={"help": "full-precision model (transformers folder, .gguf, hub name, or "
                                                     "a fetch-assets teacher: smollm2-135m, gemma3-270m)",
                                             "required": True})
    quant: str = field(default="w3g64", metadata={"help": "quantisation preset (see `qat-lora presets`)"})
    quantizer: str = field(default="", metadata={"help": "a qat run's quantizer.safetensors (its trained scales, "
                                                          "zeros, codebooks); the student must use the same --quant "
                                                          "(default with an adapter: the one it was trained over)"})

    def __post_init__(self) -> None:
        paths_as_flags(self)
        if not self.model:
            raise ValueError("--model is required: the full-precision model folder, .gguf file or hub name")
        self.quant_from_run()  # every command: a quantiser or adapter is refused under another preset than its run's
        if self.quant:
            get_preset(self.quant)
        if self.quantizer and not self.quant:
            raise ValueError("--quantizer needs --quant: it belongs to a quantised student (pass the run's --quant)")
        models.check_model(self.model)  # a missing folder or a damaged config.json, in milliseconds
        if self.quant and models.is_packed_export(self.model):
            raise ValueError(f"--model {self.model} is a packed export, which holds its grid and quantiser: drop "
                             "--quant and --quantizer")

    def _check_quantizer_file(self) -> None:
        check_quantizer_file(self.quantizer)

    def quant_from_run(self) -> None:
        """The student's base from the runs that wrote its adapter and --quantizer (not re-typed): an empty --quant
        or --quantizer becomes the adapter's base (resolve_adapter_base), a different one is refused (the student
        would silently be another)."""
        self._check_quantizer_file()  # a typo in the path is the error to report, not the --quant it would give
        for flag, adapter in self.adapter_flags() if self.model else ():  # no --model: __post_init__ says so
            self.quant, self.quantizer = resolve_adapter_base(flag, adapter, self.model, self.quant, self.quantizer)
        found = recorded_quant(self.quantizer) if self.quantizer else None
        if found is None:
            return
        quant, record = found
        if not self.quant:
            self.quant = quant
        elif self.quant != quant:
            raise ValueError(f"--quant {self.quant}: --quantizer {self.quantizer} was trained with --quant {quant} "
                             f"({record}); drop --quant or pass --quant {quant}")

    def adapter_flags(self) -> list[tuple[str, str]]:
        """(flag, folder) of the adapters the student is built with: its base is theirs."""
        adapter = getattr(self, "adapter", "")
        return [("--adapter", adapter)] if adapter else []

    def student_spec(self) -> "StudentSpec":
        """Just the student part of a command's config."""
        return StudentSpec(self.model, self.quant, self.quantizer)


@dataclass
class TrainConfig(StudentSpec, DeviceInput, PrecisionInput):
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
    zero_lr_ratio: float = field(default=1.0, metadata={"help": "qat, qat+lora, weight-qat: learning rate of the "
                                                                "zero points / fp16 offsets as a fraction of the "
                                                                "quantiser's (an offset moves every weight of its "
                                                                "group at once: it may want a lower rate)"})
    train_norms: bool = field(default=False, metadata={"help": "qat, qat+lora, weight-qat: also train the "
                                                                 "normalisation weights (RMSNorm gains), at the "
                                                                 "quantiser's rate: fp16 vectors every export ships "
                                                                 "anyway, so no extra bits; saved in "
                                                                 "quantizer.safetensors with the grid"})
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
    hidden_weight: float = field(default=0.0, metadata={"help": "feature distillation: weight of the decoder layers' "
                                                                "hidden-state error against --online-teacher's "
                                                                "(relative squared error per token, mean over layers) "
                                                                "added to the KD loss; 0 = off"})
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
    device: str = DeviceInput.device_field()
    num_chips: int = field(default=0, metadata={"help": "devices to train on: TPU chips, GPUs or CPU processes; 0 = "
                                                        "every TPU chip of the host, one device elsewhere (global "
                                                        "batch = chips x --batch-size x accumulation)"})
    parallel: str = field(default="auto", metadata={"help": "with several chips: processes (one per chip), spmd (one "
                                                            "XLA process, batch sharded), fsdp (spmd with the "
                                                            "parameters sharded too: models larger than one chip) "
                                                            "or auto (spmd on XLA, processes elsewhere)"})
    storage_dtype: str = field(default="auto", metadata={"help": "frozen student weights: fp32, bf16 (Wq stored "
                                                                 "once in bf16, no fp32 latent weight; half the "
                                                                 "memory; recovery-lora) or auto (bf16 when "
                                                                 "recovery-lora computes in bf16, else fp32)"})
    compile: str = field(default="auto", metadata={"help": "torch.compile each decoder layer: on, off, auto (on "
                                                           "CUDA with bf16 storage and no activation checkpointing; "
                                                           "XLA compiles the step's graph anyway, the CPU's compile "
                                                           "time outweighs it), or graphs (on CUDA: as on, each "
                                                           "layer's forward and backward replayed as CUDA graphs, "
                                                           "for steps bound by launching kernels; elsewhere as on)"})
    precision: str = PrecisionInput.precision_field()
    matmul_precision: str = PrecisionInput.matmul_precision_field("; recorded in config.json")
    loss_chunk_size: int = field(default=-1, metadata={"help": "positions per lm_head+loss chunk, each chunk's "
                                                                  "logits freed after its gradient (-1 = auto: 128 on "
                                                                  "the CPU, 1024 on XLA and CUDA; 0 = full logits)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute each decoder layer in backward "
                                                                          "(torch_xla's checkpoint on XLA)"})
    attn_implementation: str = field(default="auto", metadata={"help": "auto (eager on XLA, sdpa elsewhere), eager, sdpa"})
    xla_cache_dir: str = DeviceInput.xla_cache_dir_field()
    dist_timeout_s: float = field(default=600.0, metadata={"help": "seconds a rank waits for the others in a "
                                                               "collective (set-up included) before giving up; the "
                                                               "launcher then names the rank that hung"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing run in --out"})

    def __post_init__(self) -> None:
        paths_as_flags(self)
        if self.loss_chunk_size < -1:
            raise ValueError(f"--loss-chunk-size {self.loss_chunk_size}: must be -1 (auto), 0 (full logits) or a "
                             "number of positions")
        self.check_precision()  # --matmul-precision, then --precision
        require_positive(self, "max_steps", "batch_size", "accumulation_steps", "log_steps")
        require_non_negative(self, "num_chips", note=" (0 = every chip of the host)")
        require_non_negative(self, "save_steps", "keep_checkpoints", "eval_steps", "warmup_steps", note=" (0 = off)")
        require_positive(self, "lr", "weight_lr_ratio", "quantizer_lr_ratio", "zero_lr_ratio", "lora_alpha", "temperature",
                         "dist_timeout_s", finite=True)
        require_at_most(self, lr=MAX_LR, temperature=MAX_TEMPERATURE, weight_lr_ratio=MAX_LR_RATIO,
                        quantizer_lr_ratio=MAX_LR_RATIO, zero_lr_ratio=MAX_LR_RATIO)
        # clip_grad_norm_ scales by max_norm / norm capped at 1: a negative norm reverses the update, 0 erases it;
        # inf is a valid "no clipping" (the factor caps at 1).
        require_positive(self, "max_grad_norm", "lora_r")
        require_non_negative(self, "weight_decay", finite=True)
        require_seed(self.seed)
        self.check_device()
        if self.dist_timeout_s > 1e9:  # a datetime.timedelta overflows past ~8.6e13 s: a traceback at set-up
            raise ValueError(f"--dist-timeout-s {self.dist_timeout_s}: at most 1e9 seconds")
        if not 0.0 < self.min_lr_ratio <= 1.0:
            # A floor of exactly 0 would also make the last step's lr a special XLA scalar (a recompile).
            raise ValueError(f"--min-lr-ratio {self.min_lr_ratio}: must be in (0, 1]")
        if self.preset not in TRAIN_PRESETS:
            raise ValueError(f"--preset {self.preset!r}: choose one of {', '.join(TRAIN_PRESETS)}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"--parallel {self.parallel!r}: choose one of {', '.join(PARALLEL_MODES)}")
        if self.storage_dtype not in ("auto", *STORAGE_DTYPES):
            raise ValueError(f"--storage-dtype {self.storage_dtype!r}: choose auto, {' or '.join(STORAGE_DTYPES)}")
        if self.storage_dtype == "bf16" and TRAIN_PRESETS.get(self.preset) != ("lora",):
            raise ValueError(f"--storage-dtype {self.storage_dtype} --preset {self.preset}: the latent weights and "
                             "quantiser train, so they stay fp32; use --preset recovery-lora or --storage-dtype fp32")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"--compile {self.compile!r}: choose one of {', '.join(COMPILE_MODES)}")
        check_lora_init(self.lora_init, folder_allowed=True)
        require_positive(self, "lora_init_sequences")
        if self.lora_init not in LORA_INITS:  # an adapter folder: its rank and alpha, before any folder is touched
            saved = read_record(Path(self.lora_init) / "adapter_config.json") or {}
            if (saved.get("r"), saved.get("lora_alpha")) != (self.lora_r, self.lora_alpha):
                raise ValueError(f"--lora-init {self.lora_init}: an adapter of rank {saved.get('r')} and alpha "
                                 f"{saved.get('lora_alpha')}; this run has --lora-r {self.lora_r} and --lora-alpha "
                                 f"{self.lora_alpha}; pass the same, or another --lora-init")
        if self.train_norms and not {"quantizer", "weights"} & set(TRAIN_PRESETS.get(self.preset, ())):
            raise ValueError(f"--train-norms --preset {self.preset}: trained norms are saved with the quantiser "
                             "(quantizer.safetensors), which that preset does not write; use qat, qat+lora or "
                             "weight-qat, or drop --train-norms")
        if self.lora_init != "zero" and "lora" not in TRAIN_PRESETS.get(self.preset, ()):
            raise ValueError(f"--lora-init {self.lora_init} --preset {self.preset}: that preset trains no LoRA; "
                             "drop --lora-init or use a LoRA preset")
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
        refuse_unused_flags(self)
        super().__post_init__()

    def unused_flags(self) -> dict[str, str]:
        """{field: what it needs} for the flags that do nothing under these options (refused when typed)."""
        trains, unused = TRAIN_PRESETS[self.preset], {}
        if "lora" not in trains:
            unused.update(dict.fromkeys(("lora_r", "lora_alpha", "lora_init", "lora_init_sequences"),
                                        f"a preset that trains LoRA (--preset recovery-lora or qat+lora, not "
                                        f"{self.preset})"))
        elif self.lora_init != "calibrated":
            unused["lora_init_sequences"] = "--lora-init calibrated (they calibrate its start)"
        if "weights" not in trains:
            unused["weight_lr_ratio"] = f"--preset weight-qat (--preset {self.preset} trains no latent weights)"
        if "quantizer" not in trains:
            unused["zero_lr_ratio"] = unused["quantizer_lr_ratio"] = (f"a preset that trains the quantiser (--preset qat, qat+lora or "
                                            f"weight-qat, not {self.preset})")
        if not self.online_teacher:
            unused["online_teacher_dtype"] = "--online-teacher (the cache's targets have no dtype to choose)"
        if self.alpha == 0:
            unused["temperature"] = "--alpha > 0 (with --alpha 0 only the hard-label CE trains)"
        if self.device in ("cpu", "cuda"):
            unused["xla_cache_dir"] = f"an XLA device (--device xla, tpu or auto; not {self.device})"
        return unused

    def adapter_flags(self) -> list[tuple[str, str]]:
        """--lora-init's adapter folder: the run starts from it, so over the base it was trained over."""
        return [] if self.lora_init in LORA_INITS else [("--lora-init", self.lora_init)]

    def _check_online_teacher(self) -> None:
        if self.online_teacher_dtype not in STORAGE_DTYPES:
            raise ValueError(f"--online-teacher-dtype {self.online_teacher_dtype!r}: choose "
                             f"{' or '.join(STORAGE_DTYPES)}")
        if not self.online_teacher:
            if self.online_teacher_dtype != "fp32":
                raise ValueError("--online-teacher-dtype needs --online-teacher (the cache's targets have no dtype "
                                 "to choose); drop it or pass --online-teacher")
            if self.hidden_weight:
                raise ValueError("--hidden-weight: needs --online-teacher (a cache holds no hidden states to match); "
                                 "drop it or pass --online-teacher")
            return
        models.check_model(self.online_teacher)  # a typo fails here, not after the student has loaded
        if self.renormalize_topk:
            raise ValueError("--renormalize-topk is a top-K baseline; --online-teacher has the whole distribution: "
                             "drop one of them")

    def loss_config(self) -> KDLossConfig:
        return KDLossConfig(self.temperature, self.alpha, self.renormalize_topk, hidden_weight=self.hidden_weight)
