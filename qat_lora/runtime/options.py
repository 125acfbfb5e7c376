"""What every command's config shares: the generic checks its `__post_init__` runs (value ranges, seeds, device
and precision names, a results file), the --device / --precision flags that several configs declare
(`DeviceInput`, `PrecisionInput`), the refusal of typed flags that do nothing under the chosen options
(`flags_given`, `refuse_unused_flags`), the fields a caller chose (`explicit_fields`), and a config's defaults
and command line (`field_defaults`, `to_argv`).

A mistake is one line in milliseconds, before any model loads, instead of a traceback or an error after minutes.
The checks that read a stage's own files live beside that stage's config (data/config.py, cache/config.py,
quant/config.py, train/config.py, export/config.py, commands/config.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from qat_lora.runtime.device import DEVICE_CHOICES
from qat_lora.runtime.files import owned_by
from qat_lora.runtime.precision import MATMUL_PRECISIONS, PRECISIONS


def require_positive(cfg, *names: str, finite: bool = False) -> None:
    """One-line errors for flags that must be > 0 (NaN included: `not x > 0`); `finite` also refuses inf, which
    passes `> 0` but makes a learning rate or a temperature NaN a step later."""
    for name in names:
        value = getattr(cfg, name)
        if not value > 0 or (finite and not math.isfinite(value)):
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be positive" + " and finite" * finite)


def require_non_negative(cfg, *names: str, note: str = "", finite: bool = False) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not value >= 0 or (finite and not math.isfinite(value)):
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be >= 0" + " and finite" * finite + note)


# Upper bounds past which a value is a typo, not a setting: AdamW moves each weight by about lr per step, so an lr
# above 1 erases the model (and 1e308 overflows float32 in the update); T**2 scales the loss (1e308 overflows).
MAX_LR, MAX_LR_RATIO, MAX_TEMPERATURE = 1.0, 1000.0, 100.0


def require_at_most(cfg, **limits: float) -> None:
    """One-line errors for flags above their limit (`require_at_most(cfg, lr=MAX_LR)`)."""
    for name, limit in limits.items():
        if getattr(cfg, name) > limit:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be at most {limit:g}")


SEED_LIMIT = 2 ** 32  # numpy and torch_xla take uint32 seeds; the cache's batch order multiplies it by ~1e6 in int64


def require_seed(seed: int) -> None:
    """--seed in [0, 2**32): torch alone takes negatives, while other consumers fail deep inside a run."""
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"--seed {seed}: must be in [0, {SEED_LIMIT - 1}]")


def require_device(device: str) -> None:
    """The same check as device.resolve_device, made before a recipe's first stage rather than at its device."""
    if device not in DEVICE_CHOICES:
        raise ValueError(f"--device {device!r}: choose one of {', '.join(DEVICE_CHOICES)}")


def require_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")


def require_matmul_precision(precision: str) -> None:
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"--matmul-precision {precision!r}: choose one of {', '.join(MATMUL_PRECISIONS)}")


def check_output_file(path: str, flag: str, kind: str) -> None:
    """A results file must be writable where it is named, and replace only an earlier result of `qat-lora kind`
    (a file stamped `owner_stamp(kind)`): found now, not after the results were computed."""
    if not path:
        return
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: is a folder; pass a file name")
    if Path(path).exists() and not owned_by(path, kind, legacy_keys=("config",)):
        raise ValueError(f"{flag} {path}: exists and is not an earlier `qat-lora {kind}` result; pass a new file name")
    blocker = next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{flag} {path}: {blocker} is a file, not a folder; pass another path")


# The mixins below hold the shared flags' declarations and checks. A config declares each field itself, where it
# stands among its flags (`device: str = DeviceInput.device_field()`): a dataclass base's fields would come first,
# and field order is the order of the CLI's flags, of to_argv and of a saved config.json.

class DeviceInput:
    """A config whose command runs a model on a device: --device and, for XLA, --xla-cache-dir."""

    device: str

    @staticmethod
    def device_field(note: str = "") -> dataclasses.Field:
        """The --device field; `note` adds what this command does on a device to the help."""
        return dataclasses.field(default="auto", metadata={"help": "auto, cpu, cuda, xla or tpu" + note})

    @staticmethod
    def xla_cache_dir_field() -> dataclasses.Field:
        return dataclasses.field(default="auto", metadata={"help": "persistent XLA compile cache folder (XLA devices "
                                                                   "only): auto (~/.cache/qat-lora/xla), off, or a "
                                                                   "folder"})

    def check_device(self) -> None:
        require_device(self.device)


class PrecisionInput:
    """A config that sets the arithmetic of its model: --precision (autocast) and/or --matmul-precision."""

    @staticmethod
    def precision_field(prefix: str = "") -> dataclasses.Field:
        """The --precision field; `prefix` says how this command's choice relates to another's."""
        return dataclasses.field(default="auto", metadata={"help": prefix + "auto (bf16 autocast on CUDA and TPU, "
                                                                            "fp32 on the CPU), fp32 or bf16"})

    @staticmethod
    def matmul_precision_field(note: str = "") -> dataclasses.Field:
        return dataclasses.field(default="default", metadata={
            "help": "fp32 matmuls: default (the backend's: one bf16 pass on TPU, full fp32 on CPU/CUDA), high "
                    "(TPU: 3 passes; CUDA: TF32) or highest (TPU: 6 passes, ~fp32)" + note})

    def check_precision(self) -> None:
        """--matmul-precision, then --precision: those of the two this config declares."""
        if hasattr(self, "matmul_precision"):
            require_matmul_precision(self.matmul_precision)
        if hasattr(self, "precision"):
            require_precision(self.precision)


def paths_as_flags(cfg) -> None:
    """Paths given from Python as the strings the flags hold: a `Path` in a str field becomes its string, and one
    path (str or Path) in a list field (`data="corpus/"`) the one-element list the CLI would collect. Configs are
    written to JSON and compared with their records as strings, and a bare string would be read as a list of
    one-letter paths."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.type in ("str", str) and isinstance(value, os.PathLike):
            setattr(cfg, f.name, os.fspath(value))
        elif f.type in ("list[str]", list[str]) and isinstance(value, (str, os.PathLike)):
            setattr(cfg, f.name, [os.fspath(value)])
        elif f.type in ("list[str]", list[str]) and isinstance(value, (list, tuple)):
            setattr(cfg, f.name, [os.fspath(v) if isinstance(v, os.PathLike) else v for v in value])


# Typed flags. A flag left at its default and one typed with the default's value look the same in a config, yet
# the second, under options where it does nothing (`--lora-r 16 --preset qat`), is a mistake the user should hear
# about. The CLI names the fields whose flags were typed while it builds a config (`flags_given`); a config built
# in Python has no typed flags: its caller sets what it means (recover and export build stage configs whose
# options ignore some of the values they pass), so nothing is refused there.
_GIVEN: ContextVar[tuple[type, frozenset[str]] | None] = ContextVar("qat_lora_given_flags", default=None)


@contextmanager
def flags_given(cls: type, names: Iterable[str]) -> Iterator[None]:
    """While a `cls` config is built from a command line: `names` are the fields whose flags were typed."""
    token = _GIVEN.set((cls, frozenset(names)))
    try:
        yield
    finally:
        _GIVEN.reset(token)


def given_flags(cfg) -> frozenset[str]:
    """The fields of `cfg` whose flags the user typed (empty for a config built in Python)."""
    current = _GIVEN.get()
    return current[1] if current is not None and type(cfg) is current[0] else frozenset()


def explicit_fields(cfg) -> frozenset[str]:
    """The fields the caller chose: the typed flags of a config built from a command line; for one built in
    Python, which has no typed flags, those that differ from their defaults (what two options that exclude each
    other, such as recover's --budget-bits and --quant, are told apart by)."""
    current = _GIVEN.get()
    if current is not None and type(cfg) is current[0]:
        return current[1]
    return frozenset(name for name, default in field_defaults(type(cfg)).items() if getattr(cfg, name) != default)


def refuse_unused_flags(cfg) -> None:
    """The typed flags that do nothing under the chosen options are refused: `cfg.unused_flags()` maps each field
    that does nothing now to what it needs.

    Raises:
        ValueError: one line naming the first such flag and what it needs.
    """
    given = given_flags(cfg)
    for name, needs in cfg.unused_flags().items():
        if name in given:
            raise ValueError(f"--{name.replace('_', '-')}: needs {needs}; with these options it does nothing, so "
                             "drop it")


def field_defaults(cls) -> dict:
    """{field name: default} of a config dataclass: what a config saved before a field existed meant by it."""
    return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for f in dataclasses.fields(cls)}


def to_argv(cfg) -> list[str]:
    """The command-line flags that rebuild `cfg` (the inverse of the CLI's parsing; defaults left out, and so are
    the fields that do nothing under its options, which the rebuilt command would refuse as typed flags)."""
    argv: list[str] = []
    unused = cfg.unused_flags() if hasattr(cfg, "unused_flags") else {}
    for name, default in field_defaults(type(cfg)).items():
        value = getattr(cfg, name)
        if value == default or name in unused:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    return argv
