"""The config of `build-cache` (the KD cache): the teacher, the text it reads, the targets it writes and how the
chips share the build, and what must match for --resume. The CLI maps every field to a flag 1:1.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace

from qat_lora.data.config import TextInput
from qat_lora.runtime.options import (DeviceInput, PrecisionInput, paths_as_flags, refuse_unused_flags,
                                      require_non_negative, require_positive)
from qat_lora.cache.encodings import SampledEncoding, TopKEncoding, encoding_from_flags

TEACHER_DTYPES = ("fp32", "bf16")
# Build flags added after caches existed, at the value that reproduces those caches: left out of the
# fingerprint at that value, so an interrupted build from before them still resumes.
BUILD_PARALLEL_MODES = ("auto", "processes", "spmd", "fsdp")
_LATER_BUILD_FIELDS = {"dtype": "fp32", "matmul_precision": "default", "num_chips": 1, "text_encoding": "utf-8",
                       "text_errors": "strict"}

# The other encoding's flags change nothing in a cache: fingerprinted at their defaults from before sampled
# became the default encoding (when --num-samples was 50; --seed, which top-K never reads, at 0), so a build from
# then resumes and they never matter.
_UNUSED_BY_ENCODING = {"topk": {"num_samples": 50, "seed": 0}, "sampled": {"top_k": 64, "value_bits": 16}}
# Each encoding's own flags: typed under the other encoding they would change nothing, and are refused.
_ENCODING_FLAGS = {"topk": ("top_k", "value_bits"), "sampled": ("num_samples", "seed")}
# The target defaults before then: a build begun under them and resumed by the same command line is told the flag.
_EARLIER_TARGET_DEFAULTS = ({"encoding": "topk"}, {"num_samples": 50})


@dataclass
class CacheBuildConfig(TextInput, DeviceInput, PrecisionInput):
    teacher: str = field(default="", metadata={"help": "teacher: transformers folder, .gguf file or hub name",
                                               "required": True})
    data: list[str] = field(default_factory=list, metadata={"help": "text files or folders (.txt, .jsonl, datasets "
                                                                    "on disk)", "required": True})
    out: str = field(default="caches/kd", metadata={"help": "output folder"})
    seq_len: int = field(default=512, metadata={"help": "tokens per packed sequence"})
    # Sampled is the default since issue 30: better than top-32 + tail at 0.56-0.69x the bytes and the same step
    # time, at two budgets and both bit widths (docs/RESULTS.md, "What the cache costs"; only the online teacher,
    # which needs no cache but 1.4x the step time, closed more).
    encoding: str = field(default="sampled", metadata={"help": "sampled (RS-KD: N teacher draws per position) or "
                                                                "topk (the K largest log-probs + the tail mass)"})
    top_k: int = field(default=64, metadata={"help": "topk: teacher log-probs kept per position"})
    value_bits: int = field(default=16, metadata={"help": "topk: 32 (exact), 16 or 8 bits per log-prob"})
    num_samples: int = field(default=64, metadata={"help": "sampled: draws per position"})
    max_tokens: int = field(default=1_000_000, metadata={"help": "token budget over both splits (0 = all)"})
    batch_size: int = field(default=8, metadata={"help": "sequences per teacher forward"})
    holdout_fraction: float = field(default=0.02, metadata={"help": "fraction of documents held out, by hash"})
    device: str = DeviceInput.device_field()  # checked where the teacher loads (runtime/device.resolve_device)
    dtype: str = field(default="fp32", metadata={"help": "teacher weights and activations: fp32 or bf16 (the "
                                                         "log-softmax is fp32 either way)"})
    matmul_precision: str = PrecisionInput.matmul_precision_field()
    text_field: str = field(default="text", metadata={"help": "text key of .jsonl records and datasets"})
    chat: bool = field(default=False, metadata={"help": "records hold `messages`: render them with the chat template"})
    shard_sequences: int = field(default=1024, metadata={"help": "sequences per shard file"})
    seed: int = field(default=0, metadata={"help": "sampled: seed of the draws"})
    rank: int = field(default=0, metadata={"help": "this builder's rank (builds sequences = rank mod world size)"})
    world_size: int = field(default=1, metadata={"help": "number of builders (torchrun: from RANK, WORLD_SIZE)"})
    num_chips: int = field(default=0, metadata={"help": "builders on this host, one per chip (TPU: torch_xla.launch; "
                                                        "else one process each), ranks --rank x N + i of "
                                                        "--world-size x N; 0 = every TPU chip, one device elsewhere"})
    parallel: str = field(default="auto", metadata={
        "help": "with several chips: spmd (one process, each batch split over the chips; auto on XLA: one teacher "
                "load, fingerprint and tokenisation per host), processes (one builder per chip, each holding the "
                "whole teacher; auto elsewhere) or fsdp (spmd with the teacher's weights split too: a teacher "
                "larger than one chip)"})
    xla_cache_dir: str = DeviceInput.xla_cache_dir_field()
    resume: bool = field(default=False, metadata={"help": "continue an interrupted build in --out"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing cache in --out"})

    def __post_init__(self) -> None:
        paths_as_flags(self)
        if self.parallel not in BUILD_PARALLEL_MODES:
            raise ValueError(f"--parallel {self.parallel!r}: choose one of {', '.join(BUILD_PARALLEL_MODES)}")
        if not self.teacher:
            raise ValueError("--teacher is required: the teacher's transformers folder, .gguf file or hub name")
        if not self.data:
            raise ValueError("--data is required: the text files or folders to cache (.txt, .jsonl)")
        require_positive(self, "seq_len", "batch_size", "shard_sequences", "world_size")
        require_non_negative(self, "num_chips", note=" (0 = every chip of the host)")
        if self.max_tokens < 0:
            raise ValueError(f"--max-tokens {self.max_tokens}: must be >= 0 (0 = the whole corpus)")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"--holdout-fraction {self.holdout_fraction}: must be in [0, 1)")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"--rank {self.rank}: must be in [0, --world-size {self.world_size})")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite exclude each other")
        if self.dtype not in TEACHER_DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: choose {' or '.join(TEACHER_DTYPES)}")
        self.check_precision()
        self.target_encoding()
        self.text_decoding()
        refuse_unused_flags(self)

    def unused_flags(self) -> dict[str, str]:
        """{field: what it needs} for the flags that do nothing under these options (refused when typed: an old
        command line with --top-k and no --encoding would otherwise build a sampled cache without a word)."""
        unused = {name: f"--encoding {encoding} (this build is --encoding {self.encoding})"
                  for encoding, names in _ENCODING_FLAGS.items() if encoding != self.encoding for name in names}
        if self.device in ("cpu", "cuda"):
            unused["xla_cache_dir"] = f"an XLA device (--device xla, tpu or auto; not {self.device})"
        return unused

    def target_encoding(self) -> TopKEncoding | SampledEncoding:
        return encoding_from_flags(self.encoding, self.top_k, self.value_bits, self.num_samples)

    def fingerprint(self) -> str:
        """What must match for --resume to continue a build (everything but resume/overwrite/device)."""
        # How the chips share the work changes nothing in the shards (tests/test_cache_spmd.py).
        args = {k: v for k, v in asdict(self).items() if k not in ("resume", "overwrite", "device", "parallel",
                                                                    "xla_cache_dir")}
        for name, default in _LATER_BUILD_FIELDS.items():  # builds started before these existed still resume
            if args[name] == default:
                del args[name]
        args.update(_UNUSED_BY_ENCODING.get(self.encoding, {}))
        return hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()

    def earlier_default_hint(self, fingerprint: str | None) -> str:
        """" (... add --encoding topk)" when `fingerprint` is these flags under an earlier default, else ""."""
        for earlier in _EARLIER_TARGET_DEFAULTS:
            if replace(self, **earlier).fingerprint() == fingerprint:
                flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in earlier.items())
                return f" (it began under an earlier default: add {flags})"
        return ""
