"""The config of `qat-lora export` (flags 1:1): the student, its adapter, the formats written and the checks of
what each format's writer would refuse, made from the flags and config.json before the student is built."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from types import SimpleNamespace

from qat_lora.data import models
from qat_lora.runtime.options import (MAX_LR, DeviceInput, PrecisionInput, paths_as_flags, refuse_unused_flags,
                                      require_at_most, require_non_negative, require_positive)
from qat_lora.train.config import StudentSpec, check_adapter
from qat_lora.quant.fake_quant import get_preset

EXPORT_FORMATS = ("packed", "dense", "both", "gguf", "compressed-tensors")


def check_gguf_export(model: str) -> None:
    """What the GGUF writer would refuse once the student is built: no gguf package, or an architecture it does
    not write (from config.json; a .gguf --model is checked against its own metadata later)."""
    from qat_lora.export.gguf.arch import gguf_architecture

    if importlib.util.find_spec("gguf") is None:
        raise ValueError("--format gguf needs the gguf package: pip install 'qat-lora[gguf]'")
    config = models.read_model_config(model)
    if config is not None:
        gguf_architecture(SimpleNamespace(**config))


def check_gguf_grid(quant: str, requantize: bool) -> None:
    """A preset llama.cpp has no type for is written re-quantised by value (writer._layer_blocks): refused unless
    --gguf-requantize asks for it, naming the formats and presets that keep a trained grid."""
    from qat_lora.export.compressed_tensors import unsupported_reason
    from qat_lora.export.gguf.writer import BLOCK_BITS, EXACT_PRESETS, requantised_type

    qtype = requantised_type(get_preset(quant))
    if qtype is None or requantize:
        return
    keep = "packed or dense" if unsupported_reason(get_preset(quant)) else "packed, dense or compressed-tensors"
    raise ValueError(f"--format gguf --quant {quant}: llama.cpp has no type for this grid, so the file would be "
                     f"re-quantised to {qtype} ({BLOCK_BITS[qtype]} bits per weight, the trained grid lost); keep "
                     f"the grid with --format {keep}, or train a preset llama.cpp stores exactly "
                     f"({', '.join(EXACT_PRESETS)}), or pass --gguf-requantize to write the lossy file")


@dataclass
class ExportConfig(StudentSpec, DeviceInput, PrecisionInput):
    quant: str = field(default="", metadata={"help": "quantisation preset (default: the one the run of --adapter / "
                                                     "--quantizer recorded)"})
    adapter: str = field(default="", metadata={"help": "PEFT adapter folder (a run's adapter/): written beside the "
                                                       "base as OUT/adapter (PEFT format), or merged"})
    out: str = field(default="exports/student", metadata={"help": "output folder (packed/, dense/, gguf/, adapter/, "
                                                                  "merged-fp/, export.json)"})
    format: str = field(default="both", metadata={"help": "packed, dense, both, gguf (gguf/model.gguf for llama.cpp; "
                                                          "q8_0 / q4_0 / q4_1 / q2_k / q3_k / q4_k / q6_k presets bit-exact, "
                                                          "w4g32 as Q4_1 from its codes, others only with "
                                                          "--gguf-requantize) or "
                                                          "compressed-tensors (vLLM, transformers; int 2/4/8-bit)"})
    gguf_requantize: bool = field(default=False, metadata={"help": "--format gguf of a preset llama.cpp has no type "
                                                                   "for (w2g64, w3g32, lut3g64, ...): write it "
                                                                   "re-quantised to Q8_0 (8.5 bits per weight, lossy) "
                                                                   "instead of refusing"})
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
    # Only the forwards and the re-snap's steps go there: the model is back on the host before anything is packed
    # or written, so the files are the same bytes on every device.
    device: str = DeviceInput.device_field(": where the held-out report and the re-snap run (files are packed and "
                                           "written on the host)")
    precision: str = PrecisionInput.precision_field("held-out report and re-snap, as in training: ")
    overwrite: bool = field(default=False, metadata={"help": "replace an earlier export in --out"})

    def __post_init__(self) -> None:
        paths_as_flags(self)
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
        self.check_device()
        self.check_precision()
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
        refuse_unused_flags(self)
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
            check_gguf_grid(self.quant, self.gguf_requantize)

    def unused_flags(self) -> dict[str, str]:
        """{field: what it needs} for the flags that do nothing under these options (refused when typed)."""
        unused = {} if self.resnap_steps else dict.fromkeys(("resnap_preset", "resnap_lr"), "--resnap-steps > 0")
        if not self.cache:
            unused["batch_size"] = "--cache (the held-out report and the re-snap run in batches)"
            unused["device"] = ("--cache (only the held-out report and the re-snap run on a device; files are "
                                "packed and written on the host)")
            unused["precision"] = "--cache (it sets the arithmetic of the held-out report and the re-snap)"
        if self.format != "gguf":
            unused["gguf_requantize"] = f"--format gguf (not {self.format})"
        return unused
