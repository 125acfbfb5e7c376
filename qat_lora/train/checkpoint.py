"""Training checkpoints: plain dicts of named tensors in safetensors plus JSON, written atomically.

    run/checkpoint-120/
        trainable.safetensors   trainable parameters by model name (LoRA and/or quantiser)
        optimizer.safetensors   optimizer state tensors, `state.{param index}.{key}`
        rng.safetensors         `rank{r}.{generator}` RNG states of every rank
        adapter/                the LoRA adapters as standard PEFT files (when LoRA trains)
        state.json              step, data position, scheduler, optimizer hyper-parameters, config (written last)

A checkpoint is assembled in `.checkpoint-120.tmp/` and renamed when complete, so a crash or SIGKILL never
leaves a half checkpoint under a real name. Nothing is pickled: the optimizer's tensors are flattened into
named tensors and its non-tensor parts go to JSON.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from qat_lora.runtime import device as dev
from qat_lora.runtime.files import apply_umask, save_safetensors, sha256_file
from qat_lora.runtime.runs import CHECKPOINT_PREFIX as PREFIX
from qat_lora.runtime.writes import writing

TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FILE = "state.json"
FORMAT_VERSION = 1
# Flags that may change between a run and its resumption without changing a single trained value.
RESUME_FREE_FIELDS = ("out", "overwrite", "resume", "device", "log_steps", "save_steps", "keep_checkpoints",
                      "eval_steps", "xla_cache_dir", "dist_timeout_s", "compile")


def _to_host(groups: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of every group on the CPU, in one device-to-host transfer on XLA (not one per tensor)."""
    names = [(group, name) for group, tensors in groups.items() for name in tensors]
    host = dev.to_host([groups[group][name] for group, name in names])
    out: dict[str, dict[str, torch.Tensor]] = {group: {} for group in groups}
    for (group, name), tensor in zip(names, host):
        out[group][name] = tensor.contiguous()
    return out


def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split `optimizer.state_dict()` into named tensors (left on their device: `save_checkpoint` moves all of
    a checkpoint's tensors at once) and a JSON-ready rest."""
    state = optimizer.state_dict()
    tensors, extra = {}, {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value
            else:
                extra.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "state": extra}


def optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """Inverse of `optimizer_to_flat`: a dict for `optimizer.load_state_dict`."""
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    for index, values in meta["state"].items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG states as named uint8 tensors."""
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_state(states: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def step_of(path: Path) -> int:
    match = re.fullmatch(re.escape(PREFIX) + r"(\d+)", path.name)
    return int(match.group(1)) if match else -1


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run (those with a state.json), oldest first."""
    found = [p for p in Path(run_dir).glob(PREFIX + "*") if step_of(p) >= 0 and (p / STATE_FILE).exists()]
    return sorted(found, key=step_of)


def save_checkpoint(run_dir: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict,
                    write_extra: Callable[[Path], None] | None = None, keep: int = 0) -> Path:
    """Write `checkpoint-{step}` atomically and keep only the newest `keep` (0 = all).

    Args:
        tensors: {file name: {tensor name: tensor}}; each becomes one safetensors file.
        state: the JSON part; written last, inside the temporary folder.
        write_extra: writes more files (e.g. PEFT adapters) into the temporary folder.
    """
    final = run_dir / f"{PREFIX}{step}"
    tmp = run_dir / f".{PREFIX}{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with writing(final, tmp):  # a full disk leaves no .checkpoint-N.tmp behind, and one line naming the folder
        for name, group in _to_host(tensors).items():
            save_safetensors(group, tmp / name)
        if write_extra is not None:
            write_extra(tmp)
            apply_umask(tmp)
        # Checksums of everything above, in the state written last: a flipped byte is found, not resumed.
        files = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / STATE_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, **state, "files": files},
                                                 indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    if keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


# What the trainer's resume reads from state.json, with its type: a state without them is damaged, not a KeyError.
RESUME_FIELDS = {"step": int, "world_size": int, "config": dict, "optimizer": dict, "scheduler": dict,
                 "best_eval_loss": (int, float, type(None))}


def checkpoint_problem(path: Path, resume: bool = False) -> str | None:
    """Why a checkpoint folder cannot be read (incomplete, a file missing or changed), or None if intact; with
    `resume`, also why the trainer could not resume it (a field it reads missing)."""
    if not (path / STATE_FILE).exists():
        return f"not a complete checkpoint (no {STATE_FILE})"
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"{STATE_FILE} is damaged"
    fields = {"files": dict, **(RESUME_FIELDS if resume else {})}
    wrong = [k for k, kind in fields.items() if not isinstance(state, dict) or not isinstance(state.get(k), kind)]
    if wrong:
        return f"{STATE_FILE} is damaged (no valid `{wrong[0]}`)"
    for name, digest in state["files"].items():
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            return f"{STATE_FILE} names {name!r}, not a file inside the checkpoint"
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if sha256_file(file) != digest:
            return f"{name} is damaged (sha256 differs from {STATE_FILE})"
    return None


def load_checkpoint(path: str | Path, resume: bool = False) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Read a checkpoint folder: ({file name: tensors}, state), after checking every file's checksum (and, with
    `resume`, the fields the trainer's resume reads).

    Raises:
        ValueError: an incomplete or damaged checkpoint, naming the file.
    """
    path = Path(path)
    problem = checkpoint_problem(path, resume)
    if problem:
        raise ValueError(f"--resume {path}: {problem}; pass another checkpoint-N folder or auto")
    state = json.loads((path / STATE_FILE).read_text())
    tensors = {f.name: load_file(str(f)) for f in path.glob("*.safetensors")}
    return tensors, state


def find_resume_point(run_dir: Path, resume: str, log: Callable[[str], None] = print) -> Path | None:
    """The checkpoint `--resume` names: for `auto` the newest intact one (a damaged one is reported and skipped;
    None when there is none); else a checkpoint-N folder of this run (a name is looked up in `run_dir`).

    Raises:
        ValueError: every checkpoint is damaged (starting over would delete them: that takes --overwrite), or the
            named folder is not one of this run's checkpoints (another run's would mix two runs in one folder).
    """
    if not resume:
        return None
    if resume == "auto":
        found_any = list_checkpoints(run_dir)
        for found in reversed(found_any):
            problem = checkpoint_problem(found, resume=True)
            if problem is None:
                return found
            log(f"--resume auto: {found.name} cannot be resumed ({problem}); trying an older checkpoint")
        if found_any:
            raise ValueError(f"--resume auto: every checkpoint in {run_dir} is damaged; restore one, or pass "
                             "--overwrite to start again (which deletes them)")
        return None
    path = Path(resume) if Path(resume).is_absolute() or Path(resume).parent != Path(".") else run_dir / resume
    if path.resolve().parent != Path(run_dir).resolve() or step_of(path) < 0:
        raise ValueError(f"--resume {resume}: not a checkpoint-N folder of --out {run_dir}; pass auto or one of "
                         "its own checkpoints (another run's would mix two runs)")
    return path


# What a run's values depend on beyond its flags (run.run_inputs): the flag that names each, for the messages.
INPUT_FLAGS = {"model": "--model", "cache": "--cache", "quantizer": "--quantizer", "teacher": "--online-teacher"}


def check_same_inputs(saved: dict | None, current: dict, path: Path, config: dict) -> None:
    """Refuse to continue a run whose inputs changed since it was written: the same flags over another model's
    weights, a rebuilt cache or another quantiser would mix two trainings in one result. A run written before
    inputs were recorded (`saved` None) or an input that could not be identified (None) is not compared.

    Raises:
        ValueError: one line naming the flag, its path and the fix.
    """
    for key, flag in INPUT_FLAGS.items():
        before, now = (saved or {}).get(key), current.get(key)
        if before and now and before != now:
            named = config.get(flag[2:].replace("-", "_"))  # the config field the flag sets
            raise ValueError(f"--resume: {path.name} was trained on {flag} {named}, whose contents differ "
                             f"from this run's {flag} now (weights, shards or file); restore them, or pass "
                             "--overwrite to start again, or choose a new --out")


def check_resumable(saved: dict, current: dict, path: Path) -> None:
    """Refuse to resume with a config that would train different values; explain the first difference.

    Raises:
        ValueError: one line naming the flag, the checkpoint's value and the current one.
    """
    for key in sorted(set(saved) | set(current)):
        # A config.json holds null for a non-finite float (files.atomic_write_json): --max-grad-norm inf.
        if key in RESUME_FREE_FIELDS or saved.get(key) == current.get(key) or (
                saved.get(key) is None and isinstance(current.get(key), float) and not math.isfinite(current[key])):
            continue
        flag = "--" + key.replace("_", "-")
        raise ValueError(f"--resume: {path.name} was written with {flag} {saved.get(key)!r}, this run has "
                         f"{current.get(key)!r}; pass the same {flag}, or --overwrite to replace that run, or "
                         "choose a new --out")
