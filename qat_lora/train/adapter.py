"""The PEFT adapter folder as a part of the student: the check of its files (`check_adapter`), its own record
(`ADAPTER_RECORD`: the signature of the model its base was made from, and the base itself, `base_record`), the
check that an adapter or quantiser was made from --model's weights (`check_made_from`) and the resolution of the
base an adapter was trained over (`resolve_adapter_base`).

A student is its base (preset + quantiser) and its adapter: an adapter over another base loads without an error
and answers garbage, so whatever loads an adapter loads the base it was trained over, or refuses. StudentSpec
(train/config.py) resolves it for every command's flags, the student loader (train/student.py) for its callers.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError, safe_open

from qat_lora.data import identities, models
from qat_lora.quant.state import MODEL_SIGNATURE_KEY
from qat_lora.runtime.files import first_line, owned_by, read_record, sha256_file
from qat_lora.runtime.runs import CONFIG_FILE, QUANTIZER_FILE, RUN_KIND, RUN_LEGACY_KEYS, recorded_quant

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


# An adapter's own record, beside its PEFT files: the signature of the model its base was made from
# (quant.state.MODEL_SIGNATURE_KEY) and, under BASE_KEY, that base: the preset and the quantiser file the adapter was
# trained over. Whatever loads the adapter loads that base, or refuses (an adapter over another base loads without
# an error and answers garbage).
ADAPTER_RECORD, BASE_KEY = "qat_lora.json", "base"
# The one training preset (config.TRAIN_PRESETS) whose adapter sits over the quantiser the run started from; every
# other LoRA preset trains the quantiser too, and its adapter sits over the run's own quantizer.safetensors.
LORA_ONLY_PRESET = "recovery-lora"


ADAPTER_CARD = "README.md"  # PEFT writes its empty model-card template here, naming the fp model as the base


def adapter_card(model: str, base: dict | None, rank: int, parameters: int) -> str:
    """The adapter folder's README.md: what the adapter is and the quantised base it belongs to (`base`:
    base_record's entry; None: not recorded, as for an export's adapter beside its exported base), in place of
    PEFT's template, which calls the full-precision `model` its base: over that model alone it answers garbage."""
    intro = (f"# Recovery LoRA adapter (qat-lora)\n\nA rank-{rank} LoRA adapter ({parameters:,} parameters) trained "
             "by knowledge distillation to recover the quality of a low-bit model; over the full-precision model "
             "alone it makes that model worse, not better. ")
    if base is None:
        return intro + ("Its base is the quantised model exported beside it (packed/, dense/ or gguf/): "
                        "`PeftModel.from_pretrained(<that base, loaded>, <this folder>)`.\n")
    quantizer = base["quantizer"]
    flags = (f"--model {model} --quant {base['quant']}" + (f" --quantizer {quantizer['absolute']}" if quantizer
                                                          else "") + " --adapter <this folder>")
    return intro + (f"Its base is `{model}` quantised with the `{base['quant']}` preset and "
                    + (f"the quantiser `{quantizer['absolute']}` (sha256 `{quantizer['sha256']}`)" if quantizer
                       else "the preset's own init (no quantiser file)")
                    + f"; `{ADAPTER_RECORD}` records it, and qat-lora refuses another.\n\n```bash\nqat-lora chat "
                    f"{flags}\nqat-lora export {flags} --format dense --out exports/student   # transformers + "
                    "this adapter\n```\n")


@functools.lru_cache(maxsize=32)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, read once per version of it (a config and the loader check the same quantiser)."""
    stat = Path(path).stat()
    return _sha256_of(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


def base_record(quant: str, quantizer: str, adapter_dir: str | Path) -> dict:
    """The `base` entry of the record of an adapter saved in `adapter_dir`: its preset and the quantiser file it
    was trained over (None: the preset's own init), by its path relative to the adapter (a run copied whole keeps
    it), its absolute path and its sha256 (a copy of the same bytes is the same base)."""
    if not quantizer:
        return {"quant": quant, "quantizer": None}
    file = Path(quantizer).resolve()
    try:
        relative = os.path.relpath(file, Path(adapter_dir).resolve())
    except ValueError:  # another drive: the absolute path only
        relative = None
    return {"quant": quant, "quantizer": {"path": relative, "absolute": str(file), "sha256": file_sha256(file)}}


@dataclass(frozen=True)
class AdapterBase:
    """The base an adapter's records name: its preset and whether a quantiser file was trained over (`trained`;
    False: the preset's own init), where that file may be (`candidates`, first intact one wins), its sha256 when
    recorded, how the record names it (`named`) and the record itself."""

    quant: str
    trained: bool
    candidates: tuple[Path, ...] = ()
    sha256: str | None = None
    named: str = ""
    record: Path = Path()


def adapter_record(folder: str | Path) -> dict:
    """An adapter folder's own record (qat_lora.json): {} when it has none (an adapter from elsewhere).

    Raises:
        ValueError: the record is there but damaged (cut short, not JSON, a folder, a looping link): what it
            records (the model and base the adapter was trained on) would go unchecked.
    """
    path = Path(folder) / ADAPTER_RECORD
    if not os.path.lexists(path):
        return {}
    record = read_record(path)
    if record is None:
        raise ValueError(f"--adapter {folder}: its {ADAPTER_RECORD} is damaged or unreadable, so the base it was "
                         "trained on cannot be checked; use the run's intact adapter/ or a checkpoint's")
    return record


def adapter_base(adapter: str | Path) -> AdapterBase | None:
    """The base of an adapter folder: its record's `base` (base_record), or for an adapter written before records
    held one, its run's config.json (the run's own quantizer.safetensors beside adapter/ when the preset trained
    it, else the run's --quantizer); None when nothing records it (an adapter from elsewhere: the flags stand)."""
    folder = Path(adapter).resolve()
    base = adapter_record(folder).get(BASE_KEY)
    if isinstance(base, dict) and isinstance(base.get("quant"), str) and base["quant"]:
        entry, record = base.get("quantizer", False), folder / ADAPTER_RECORD
        if entry is None:
            return AdapterBase(base["quant"], False, record=record)
        if isinstance(entry, dict) and isinstance(entry.get("absolute"), str):
            relative = [Path(os.path.normpath(folder / entry["path"]))] if isinstance(entry.get("path"), str) else []
            sha = entry.get("sha256") if isinstance(entry.get("sha256"), str) else None
            candidates = (*relative, Path(entry["absolute"]))
            return AdapterBase(base["quant"], True, candidates, sha, entry["absolute"], record)
    for run in (folder.parent, folder.parent.parent):  # adapter/, or checkpoint-N/adapter and best/adapter
        if owned_by(run / CONFIG_FILE, RUN_KIND, RUN_LEGACY_KEYS):
            return _run_base(read_record(run / CONFIG_FILE) or {}, folder, run / CONFIG_FILE)
    return None


def _run_base(config: dict, folder: Path, record: Path) -> AdapterBase | None:
    quant, inputs = config.get("quant"), config.get("inputs")
    if not isinstance(quant, str) or not quant:
        return None
    if config.get("preset") != LORA_ONLY_PRESET:  # a LoRA preset that also trained the quantiser: the run's own
        own = folder.parent / QUANTIZER_FILE
        return AdapterBase(quant, True, (own,), None, str(own), record)
    start = config.get("quantizer")
    if not isinstance(start, str) or not start:
        return AdapterBase(quant, False, record=record)
    sha = inputs.get("quantizer") if isinstance(inputs, dict) else None
    return AdapterBase(quant, True, (Path(start),), sha if isinstance(sha, str) else None, start, record)


def _recorded_signature(flag: str, path: str | Path) -> str | None:
    """The model signature a --quantizer file or an --adapter folder recorded, if any."""
    path = Path(path)
    if path.is_dir():
        recorded = adapter_record(path).get(MODEL_SIGNATURE_KEY)
        return recorded if isinstance(recorded, str) else None
    if not path.is_file():
        return None  # missing: the loader that reads it names it
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get(MODEL_SIGNATURE_KEY)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{flag} {path}: damaged or truncated ({first_line(e)})") from None


def check_made_from(model: str, artefacts: dict[str, str]) -> None:
    """Refuse a quantiser or adapter made from other weights than --model's (same shapes, another model, or the
    same model changed): it would load without an error and give a wrong student.

    Args:
        artefacts: {flag: path}, e.g. {"--quantizer": path, "--adapter": path}; empty paths are skipped.
    Raises:
        ValueError: naming the flag, the file and the fix.
    """
    current = None
    for flag, path in artefacts.items():
        recorded = _recorded_signature(flag, path) if path else None
        if recorded is None:
            continue
        current = current or identities.weights_signature(model)
        if current is not None and current != recorded:
            raise ValueError(f"{flag} {path}: made from other weights than --model {model} (its model signature "
                             f"{recorded[:12]} differs from {current[:12]}); pass the --model it was made from")


def _tell(line: str) -> None:
    print(f"qat-lora: {line}", file=sys.stderr)


def resolve_adapter_base(flag: str, adapter: str, model: str, quant: str, quantizer: str,
                         log: Callable[[str], None] = _tell) -> tuple[str, str]:
    """(--quant, --quantizer) of the student `adapter` belongs to, over --model `model`: what the flags leave empty
    comes from the adapter's base (adapter_base; the quantiser said in one `log` line), and what they name must be
    that base (a quantiser by its bytes, so a copy passes); the adapter must have been made from `model`'s weights
    (check_made_from) once the student is a quantised one.

    Raises:
        ValueError: another --model, --quant or --quantizer than the adapter's base, or its quantiser missing or
            changed, naming the flag, the file and the fix.
    """
    if not quant and models.is_packed_export(model):
        return quant, quantizer  # a packed export (its model's config inside): the export is the adapter's base
    base = adapter_base(adapter)
    if base is not None and quant and quant != base.quant:
        record = (recorded_quant(adapter) or (None, base.record))[1]  # the run's config.json, where there is one
        raise ValueError(f"--quant {quant}: {flag} {adapter} was trained with --quant {base.quant} ({record}); "
                         f"drop --quant or pass --quant {base.quant}")
    if quant or base is not None:  # an adapter over an export (--model dense/, no --quant) is not a student's
        check_made_from(model, {flag: adapter})
    if base is None:
        return quant, quantizer
    if not base.trained:
        if quantizer:
            raise ValueError(f"--quantizer {quantizer}: {flag} {adapter} was trained over the {base.quant} preset's "
                             f"own init, without a quantiser ({base.record}); drop --quantizer")
        return base.quant, quantizer
    found = [p for p in base.candidates if p.is_file()]
    expected = base.sha256 or (file_sha256(found[0]) if found else None)
    if quantizer:
        if expected is not None and file_sha256(quantizer) != expected:
            raise ValueError(f"--quantizer {quantizer}: {flag} {adapter} was trained over another quantiser "
                             f"({base.named}, {base.record}); drop --quantizer to load that one, or pass a copy of it")
        return base.quant, quantizer
    intact = next((p for p in found if expected is None or file_sha256(p) == expected), None)
    if intact is None:
        state = "has changed since the adapter was trained" if found else "is missing"
        raise ValueError(f"{flag} {adapter}: its base quantiser {base.named} ({base.record}) {state}; pass "
                         "--quantizer with an intact copy of the file it was trained over")
    log(f"{flag} {adapter}: trained over --quantizer {intact} ({base.record}); loading that base")
    return base.quant, str(intact)
