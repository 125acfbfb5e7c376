"""The data stage's configs: how a command decodes the text files it reads (`TextInput`, a part of every config
that reads text) and `generate-data` (a corpus written by the teacher). The CLI maps every field to a flag 1:1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from qat_lora.data.text import TextDecoding
from qat_lora.runtime.options import (DeviceInput, PrecisionInput, paths_as_flags, refuse_unused_flags,
                                      require_positive, require_seed)


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
class GenerateDataConfig(TextInput, DeviceInput, PrecisionInput):
    """A corpus sampled from the teacher (data/teacher_text.py): continuations of corpus passages or of prompts."""

    model: str = field(default="", metadata={"help": "teacher: transformers folder (it writes the text)",
                                             "required": True})
    out: str = field(default="data/self", metadata={"help": "output folder: part-*.jsonl + generate.json"})
    data: list[str] = field(default_factory=list, metadata={"help": "corpus whose passages' first tokens are the "
                                                                    "prompts (training text, never eval text)"})
    prompts: str = field(default="", metadata={"help": "text file, one prompt per line (instead of --data)"})
    raw_prompts: bool = field(default=False, metadata={"help": "--prompts as plain text, without the chat template"})
    unconditional: bool = field(default=False, metadata={"help": "no prompts (instead of --data / --prompts): every "
                                                                 "sample starts from the teacher's BOS token alone, "
                                                                 "so the text follows the teacher's own distribution"})
    prefix_tokens: int = field(default=32, metadata={"help": "--data: prompt tokens taken from each passage"})
    stride: int = field(default=256, metadata={"help": "--data: tokens between the passages prompts are taken from"})
    tokens: int = field(default=100_000, metadata={"help": "generated tokens to write (prompts not counted); "
                                                           "sampling goes on until the budget is met"})
    max_new_tokens: int = field(default=224, metadata={"help": "tokens sampled per prompt"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (1 = the teacher's own "
                                                              "distribution, which KD matches)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1 = off)"})
    batch_size: int = field(default=16, metadata={"help": "prompts per generate call"})
    shard_samples: int = field(default=64, metadata={"help": "samples per part-*.jsonl (the unit of resume)"})
    seed: int = field(default=0, metadata={"help": "sampling seed (each shard derives its own)"})
    device: str = DeviceInput.device_field(": where the teacher samples (CUDA and XLA: a static KV cache, prompts "
                                           "padded to a multiple of 32 tokens, so each cache size compiles once)")
    precision: str = field(default="auto", metadata={"help": "the teacher's weights while it samples: auto (bf16 on "
                                                             "CUDA and TPU, fp32 on the CPU), fp32 or bf16"})
    overwrite: bool = field(default=False, metadata={"help": "replace an earlier corpus in --out (its shards and "
                                                             "generate.json) instead of continuing it"})

    def __post_init__(self) -> None:
        paths_as_flags(self)
        if not self.model:
            raise ValueError("--model is required: the teacher that writes the corpus")
        if self.unconditional and (self.data or self.prompts):
            raise ValueError("--unconditional samples from the BOS token alone; drop --data / --prompts")
        if not self.unconditional and bool(self.data) == bool(self.prompts):
            raise ValueError("pass exactly one of --data (corpus passages as prompts), --prompts (a file) or "
                             "--unconditional (no prompts)")
        require_positive(self, "prefix_tokens", "stride", "tokens", "max_new_tokens", "batch_size", "shard_samples")
        require_positive(self, "temperature", finite=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.shard_samples > 1000:  # batch seeds are seed + 1000 * shard + batch start: keep them distinct
            raise ValueError(f"--shard-samples {self.shard_samples}: at most 1000")
        if self.batch_size > self.shard_samples:  # a generate call never spans two shards: it would be capped
            raise ValueError(f"--batch-size {self.batch_size}: larger than --shard-samples {self.shard_samples}, "
                             f"which caps each generate call; pass --shard-samples {self.batch_size} (or more) too")
        require_seed(self.seed)
        self.check_precision()
        self.text_decoding()
        refuse_unused_flags(self)

    def unused_flags(self) -> dict[str, str]:
        """{field: what it needs} for the flags that do nothing under these options (refused when typed)."""
        if self.unconditional:
            return dict.fromkeys(("prefix_tokens", "stride", "raw_prompts"), "--data / --prompts (--unconditional "
                                                                             "has no prompt)")
        if self.prompts:
            return dict.fromkeys(("prefix_tokens", "stride"), "--data (--prompts are used whole)")
        return {"raw_prompts": "--prompts (--data passages are plain text already)"}
