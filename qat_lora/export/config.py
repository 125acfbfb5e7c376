"""The configuration of the commands that use a student: export, generate / chat and the demo (config.py holds the
training and evaluation ones and the shared `StudentSpec`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from qat_lora.train.config import DATA_INITS, StudentSpec, check_lora_init, rate_at_rank
from qat_lora.runtime.checks import (MAX_LR, check_adapter, check_gguf_export, require_at_most, require_device,
                            require_non_negative, require_positive, require_seed)
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.cache.encodings import encoding_from_flags
from qat_lora.quant.fake_quant import get_preset

EXPORT_FORMATS = ("packed", "dense", "both", "gguf", "compressed-tensors")


@dataclass
class ExportConfig(StudentSpec):
    quant: str = field(default="", metadata={"help": "quantisation preset (default: the one the run of --adapter / "
                                                     "--quantizer recorded)"})
    adapter: str = field(default="", metadata={"help": "PEFT adapter folder (a run's adapter/): written beside the "
                                                       "base as OUT/adapter (PEFT format), or merged"})
    out: str = field(default="exports/student", metadata={"help": "output folder (packed/, dense/, gguf/, adapter/, "
                                                                  "merged-fp/, export.json)"})
    format: str = field(default="both", metadata={"help": "packed, dense, both, gguf (gguf/model.gguf for llama.cpp; "
                                                          "q8_0 / q4_0 / q4_1 / q2_k / q3_k / q4_k / q6_k presets bit-exact, "
                                                          "others re-quantised) or "
                                                          "compressed-tensors (vLLM, transformers; int 2/4/8-bit)"})
    merge_adapter: bool = field(default=False, metadata={"help": "merge --adapter into the weights and re-quantise "
                                                                 "onto the grid (reports how much recovery it kept)"})
    merge_fp: bool = field(default=False, metadata={"help": "also write merged-fp/: base + adapter merged in full "
                                                            "precision (exact; NOT smaller than the original model)"})
    cache: str = field(default="", metadata={"help": "KD cache: held-out KL and perplexity of the student, its base "
                                                     "and each merge"})
    resnap_steps: int = field(default=0, metadata={"help": "after --merge-adapter, QAT steps of the merged weights "
                                                            "against --cache so the grid keeps the recovery (0 = off)"})
    resnap_preset: str = field(default="weight-qat", metadata={"help": "what the re-snap trains: weight-qat (weights + "
                                                                       "scales) or qat (scales, zeros)"})
    resnap_lr: float = field(default=5e-4, metadata={"help": "peak learning rate of the re-snap stage"})
    batch_size: int = field(default=4, metadata={"help": "sequences per forward (held-out report, re-snap)"})
    overwrite: bool = field(default=False, metadata={"help": "replace an earlier export in --out"})

    def __post_init__(self) -> None:
        if self.format not in EXPORT_FORMATS:
            raise ValueError(f"--format {self.format}: use one of {', '.join(EXPORT_FORMATS)}")
        if self.resnap_steps and not (self.merge_adapter and self.cache):
            raise ValueError("--resnap-steps needs --merge-adapter and --cache (it trains the merged weights on it)")
        if self.resnap_preset not in ("weight-qat", "qat"):
            raise ValueError(f"--resnap-preset {self.resnap_preset!r}: choose weight-qat or qat")
        require_non_negative(self, "resnap_steps", note=" (0 = off)")
        require_positive(self, "batch_size")
        require_positive(self, "resnap_lr", finite=True)
        require_at_most(self, resnap_lr=MAX_LR)
        for flag in ("merge_adapter", "merge_fp", "cache"):
            if getattr(self, flag) and not self.adapter:
                raise ValueError(f"--{flag.replace('_', '-')} needs --adapter (the run's adapter/ folder)")
        if not self.model:
            raise ValueError("--model is required: the full-precision model folder, .gguf file or hub name")
        check_adapter(self.adapter)
        self.quant_from_run()
        if not self.quant:
            raise ValueError("--quant is required for export: the preset the student was trained with (read from "
                             "the run when --adapter or --quantizer comes from one)")
        super().__post_init__()
        self._check_format()
        if self.cache:
            from qat_lora.cache.reader import KDCache

            KDCache(self.cache)  # its manifest: a wrong folder fails now, not after the student is built

    def _check_format(self) -> None:
        """What the writers would refuse once the student is built, found from the flags and config.json."""
        if self.format == "compressed-tensors":
            from qat_lora.export.compressed_tensors import check_supported

            check_supported(get_preset(self.quant), self.quant)
        if self.format == "gguf":
            check_gguf_export(self.model)


@dataclass
class GenerateConfig(StudentSpec):
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
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, xla or tpu (XLA: static KV cache)"})

    def __post_init__(self) -> None:
        require_positive(self, "max_new_tokens")
        require_non_negative(self, "temperature", finite=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p {self.top_p}: must be in (0, 1]")
        require_seed(self.seed)
        require_device(self.device)
        check_adapter(self.adapter)
        super().__post_init__()


def default_lora_lr(teacher: str, lora_r: int) -> float:
    """The demo's and the notebooks' LoRA rate for a fetch-assets teacher at rank `lora_r`: its measured rank-16
    rate (TeacherAsset.lora_lr) times 16 / r."""
    from qat_lora.data.teachers import teacher_asset  # imported here, as in DemoConfig: no import cycle through models

    return rate_at_rank(teacher_asset(teacher).lora_lr, lora_r)


@dataclass
class DemoConfig:
    assets_dir: str = field(default="", metadata={"help": "asset folder (default: ~/.cache/qat-lora/assets)"})
    teacher: str = field(default="smollm2-135m", metadata={"help": "the teacher fetch-assets prepares: smollm2-135m "
                                                                  "or gemma3-270m"})
    work_dir: str = field(default="runs/demo", metadata={"help": "where the cache, run and results go"})
    quant: str = field(default="w3g64", metadata={"help": "quantisation preset of the student"})
    seq_len: int = field(default=256, metadata={"help": "sequence length for cache, training and eval"})
    encoding: str = field(default="sampled", metadata={"help": "cache targets: sampled (RS-KD) or topk (+ tail)"})
    num_samples: int = field(default=64, metadata={"help": "sampled: teacher draws per position"})
    top_k: int = field(default=64, metadata={"help": "topk: teacher log-probs kept per position"})
    cache_tokens: int = field(default=56_000, metadata={"help": "teacher tokens to cache (train + held-out)"})
    eval_tokens: int = field(default=8_192, metadata={"help": "Wikipedia tokens for perplexity"})
    max_steps: int = field(default=50, metadata={"help": "optimizer steps (one pass over the cached tokens)"})
    batch_size: int = field(default=4, metadata={"help": "sequences per step"})
    lr: float = field(default=0.0, metadata={"help": "peak learning rate (0 = the rate measured best for --teacher "
                                                      "at rank 16, times 16 / --lora-r: 2e-3 for smollm2-135m, "
                                                      "5e-4 for gemma3-270m)"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    init: str = field(default="gptq", metadata={"help": "data-aware init before the LoRA: gptq, act or none "
                                                        "(docs/RESULTS.md: w3g64 GPTQ + LoRA 21.9 ppl, RTN + LoRA 25.0)"})
    calib_sequences: int = field(default=128, metadata={"help": "calibration sequences for --init and --lora-init"})
    lora_init: str = field(default="calibrated", metadata={
        "help": "LoRA start: calibrated (each adapter the best rank-r correction of its layer's quantisation error; "
                "docs/RESULTS.md: w3g64 21.1 ppl against 22.1 from zero) or zero"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, xla or tpu"})

    def __post_init__(self) -> None:
        from qat_lora.data.teachers import teacher_asset

        teacher_asset(self.teacher)  # an unknown name is refused before anything downloads
        get_preset(self.quant)
        if self.init not in DATA_INITS:
            raise ValueError(f"--init {self.init!r}: choose one of {', '.join(DATA_INITS)}")
        check_lora_init(self.lora_init, folder_allowed=False)
        # The cache's own checks, before anything downloads (the demo keeps build-cache's --value-bits).
        encoding_from_flags(self.encoding, self.top_k, CacheBuildConfig.value_bits, self.num_samples)
        require_positive(self, "seq_len", "top_k", "cache_tokens", "eval_tokens", "max_steps", "batch_size",
                         "lora_r", "calib_sequences")
        if self.lr == 0:  # resolved here, so demo.json and the run's name carry the rate used
            self.lr = default_lora_lr(self.teacher, self.lora_r)
        require_positive(self, "lr", finite=True)
        require_at_most(self, lr=MAX_LR)
        require_device(self.device)
