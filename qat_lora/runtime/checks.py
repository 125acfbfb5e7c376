"""The checks the config dataclasses (config.py, config_data.py) run in `__post_init__`: value ranges, and the
files a flag names, read without loading a model (headers, config.json), so a mistake is one line in
milliseconds instead of a traceback or an error after minutes of model loading."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

from safetensors import SafetensorError, safe_open

from qat_lora.data import models
from qat_lora.runtime.device import DEVICE_CHOICES, PRECISIONS
from qat_lora.runtime.files import first_line, owned_by


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


def check_quantizer_file(path: str) -> None:
    """--quantizer is an intact safetensors file (its header read, not its tensors)."""
    if path and not Path(path).is_file():
        raise ValueError(f"--quantizer {path}: no such file; pass a qat run's quantizer.safetensors")
    try:
        if path:
            safe_open(path, "pt").keys()  # the header only: a cut-short file fails here
    except SafetensorError as e:
        raise ValueError(f"--quantizer {path}: damaged or truncated ({first_line(e)}); use the run's intact copy or "
                         "rerun the stage that wrote it") from None


ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's file name


def check_adapter(adapter: str) -> None:
    """--adapter is a PEFT folder with intact files: checked now, not once the model has loaded."""
    if not adapter:
        return
    config = Path(adapter) / "adapter_config.json"
    if not config.is_file():
        raise ValueError(f"--adapter {adapter}: no adapter_config.json; pass a run's adapter/ folder")
    try:
        record = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"--adapter {adapter}: {config} is not valid JSON (truncated?); use the run's intact "
                         "adapter/ or a checkpoint's") from None
    if not isinstance(record, dict) or record.get("peft_type") != "LORA" or not isinstance(record.get("r"), int):
        raise ValueError(f"--adapter {adapter}: {config} is not a PEFT LoRA config (peft_type LORA, an integer r); "
                         "use the run's intact adapter/ or a checkpoint's")
    weights = Path(adapter) / ADAPTER_WEIGHTS
    if not weights.is_file():  # PEFT would look for it on the hub instead: a download, never what was meant
        raise ValueError(f"--adapter {adapter}: no {ADAPTER_WEIGHTS}; pass a run's adapter/ folder (qat-lora never "
                         "loads pickled adapter_model.bin)")
    try:
        safe_open(str(weights), "pt").keys()  # the header only: a cut-short file fails here
    except SafetensorError as e:  # the message lora.load_recovery_lora gives once the model has loaded
        raise ValueError(f"--adapter {adapter}: its weights are damaged or truncated ({e}); use the run's intact "
                         "adapter/ or a checkpoint's") from None


EVAL_KIND = "eval"  # the stamp of an eval's --json-out: only such a file is replaced by the next eval


def check_output_file(path: str, flag: str) -> None:
    """A results file must be writable where it is named, and replace only an earlier result: found now, not
    after the metrics were computed."""
    if not path:
        return
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: is a folder; pass a file name")
    if Path(path).exists() and not owned_by(path, EVAL_KIND, legacy_keys=("config",)):
        raise ValueError(f"{flag} {path}: exists and is not an earlier `qat-lora eval` result; pass a new file name")
    blocker = next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{flag} {path}: {blocker} is a file, not a folder; pass another path")


def model_context(model: str) -> int | None:
    """max_position_embeddings from the model's config.json (a packed export's inside base_config), if known."""
    config = models.read_model_config(model) or {}
    limit = config.get("base_config", config).get("max_position_embeddings")
    return limit if isinstance(limit, int) else None


def check_gguf_export(model: str) -> None:
    """What the GGUF writer would refuse once the student is built: no gguf package, or an architecture it does
    not write (from config.json; a .gguf --model is checked against its own metadata later)."""
    import importlib.util

    from qat_lora.export.gguf.arch import gguf_architecture

    if importlib.util.find_spec("gguf") is None:
        raise ValueError("--format gguf needs the gguf package: pip install 'qat-lora[gguf]'")
    config = models.read_model_config(model)
    if config is not None:
        gguf_architecture(SimpleNamespace(**config))
