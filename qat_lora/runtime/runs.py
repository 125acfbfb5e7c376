"""A run folder: its file names, its metrics log and the stop signal that ends a run cleanly.

    runs/w3g64/
        config.json            the TrainConfig (+ quant config, trainable count, chips), written at step 0
        metrics.jsonl          one JSON record per logged step / evaluation
        adapter/               LoRA adapters, standard PEFT files (presets with LoRA)
        quantizer.safetensors  trained scales / zeros / codebooks (presets with QAT)
        checkpoint-N/          resumable training state (see train/checkpoint.py)
        best/                  artefacts of the best held-out evaluation
        summary.json           written when the run finishes
        compile_report.json    XLA only: graphs compiled, recompiles, CPU fallbacks
        tensorboard/           --report-to tensorboard (or --tensorboard) only
        wandb/, wandb_run_id   --report-to wandb only: the wandb run folder, and the id a resumed run reuses

No torch here: `qat-lora plot` reads a run without importing the trainer or any device runtime.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
from pathlib import Path

from qat_lora.runtime.files import owned_by, read_record, save_debris

ADAPTER_DIR = "adapter"
QUANTIZER_FILE = "quantizer.safetensors"
BEST_DIR = "best"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
COMPILE_REPORT_FILE = "compile_report.json"
TENSORBOARD_DIR = "tensorboard"
INIT_REPORT_FILE = "quantize.json"  # what `qat-lora quantize` writes next to its quantizer.safetensors
WANDB_DIR, WANDB_ID_FILE = "wandb", "wandb_run_id"
CHECKPOINT_PREFIX = "checkpoint-"
# config.json is the run's ownership record (files.owned_by): stamped with this kind; a run written before the
# stamp existed is recognised by these keys, which a model's config.json never has.
RUN_KIND, RUN_LEGACY_KEYS = "train-run", ("preset", "cache", "max_steps", "quant")
# checkpoint-N and the temporary .checkpoint-N.tmp a save assembles it in: nothing else that starts alike.
_CHECKPOINT_NAME = re.compile(rf"\.?{CHECKPOINT_PREFIX}\d+(\.tmp)?")
# Everything a run writes at the top of its folder (checkpoints are matched by CHECKPOINT_PREFIX).
RUN_FILES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, COMPILE_REPORT_FILE, ADAPTER_DIR, QUANTIZER_FILE, BEST_DIR,
             TENSORBOARD_DIR, WANDB_DIR, WANDB_ID_FILE)


class RunDiverged(RuntimeError):
    """The loss or gradient norm became NaN / inf: the run stops without saving the broken state."""


def read_config(run_dir: str | Path) -> dict | None:
    """The run's config.json, or None when the folder holds no run (or a damaged one: check_run_folder, which
    every writer calls first, refuses a config.json that is not a run's)."""
    return read_record(Path(run_dir) / CONFIG_FILE)


def recorded_quant(artefact: str | Path) -> tuple[str, Path] | None:
    """(--quant, the file recording it) of the run or init that wrote `artefact`: an adapter/ folder or a
    quantizer.safetensors, at the top of a run, in a checkpoint-N/ or best/, or in a quantize output folder.
    None when nothing records it (a file from elsewhere: the user's --quant stands)."""
    here = Path(artefact).resolve().parent
    for folder in (here, here.parent):
        for name, field in ((CONFIG_FILE, ()), (INIT_REPORT_FILE, ("config",))):
            try:
                record = json.loads((folder / name).read_text())
                for key in field:
                    record = record[key]
                quant = record.get("quant")
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
            if isinstance(quant, str) and quant:
                return quant, folder / name
    return None


def read_summary(run_dir: str | Path) -> dict | None:
    """The summary of a finished run, or None while it is unfinished (or its summary is damaged: the run is then
    resumed from its last checkpoint, or refused, never taken as finished)."""
    summary = read_record(Path(run_dir) / SUMMARY_FILE)
    return summary if summary is not None and isinstance(summary.get("steps"), int) else None


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(training records, eval records) of a run's metrics JSONL; a line cut by a kill is skipped.

    Raises:
        ValueError: the folder has no metrics file.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise ValueError(f"{path} not found; pass a run folder written by `qat-lora train`")
    records = [r for r in _read_jsonl(path) if isinstance(r, dict) and _number(r.get("step"))]
    return ([r for r in records if _number(r.get("loss")) and _number(r.get("lr"))],
            [r for r in records if _number(r.get("eval_loss"))])


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by SIGKILL
            continue
    return records


class MetricsLog:
    """The run's metrics: one JSON record per line in `metrics.jsonl`, and each record handed to the reporters
    `--report-to` opened (train/reporting.py: TensorBoard, wandb).

    A resumed run first drops the records after its checkpoint (they are redone, so the file ends as an
    uninterrupted run's).
    """

    def __init__(self, path: Path, resumed_step: int, reporters: list | tuple = ()):
        self._file = _open_jsonl(path, resumed_step)
        self._reporters = list(reporters)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for reporter in self._reporters:
            reporter.write(record)

    def close(self) -> None:
        self._file.close()
        for reporter in self._reporters:
            reporter.close()


def _open_jsonl(path: Path, resumed_step: int):
    if resumed_step == 0 or not path.exists():
        return path.open("w")
    kept = [json.dumps(r) for r in _read_jsonl(path) if r.get("step", math.inf) <= resumed_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return path.open("a")


class StopSignal:
    """Remembers SIGTERM/SIGINT so the loop can finish its step, checkpoint and exit (preemptible TPUs)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for s in (signal.SIGTERM, signal.SIGINT):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def check_run_folder(out: str | Path) -> None:
    """Refuse an --out whose run-named entries are not a run's: a config.json no qat-lora run wrote (a model
    folder), or adapter/, checkpoint-N/... with no run record beside them. A run would overwrite them, and
    --overwrite would delete them.

    Raises:
        ValueError: naming --out and what is there.
    """
    out = Path(out)
    if not out.is_dir():
        return
    if (out / CONFIG_FILE).exists():
        if not owned_by(out / CONFIG_FILE, RUN_KIND, RUN_LEGACY_KEYS):
            raise ValueError(f"--out {out}: its {CONFIG_FILE} was not written by a qat-lora run (a model folder?); "
                             "choose another folder for the run")
        return
    taken = sorted(p.name for p in out.iterdir() if p.name in RUN_FILES or _CHECKPOINT_NAME.fullmatch(p.name))
    if taken:
        raise ValueError(f"--out {out}: holds {', '.join(taken[:3])} that no qat-lora run recorded there; choose an "
                         "empty or new folder")


def prepare_run_dir(out: str | Path, *, overwrite: bool, resume_auto: bool, resuming: bool) -> Path:
    """Create the run folder. A resumed run keeps everything; with --overwrite (or --resume auto and nothing
    to resume) only what a previous run wrote there is removed, and only when its config.json proves it a run.

    Raises:
        ValueError: a run already exists in `out` and neither flag allows replacing it; `out` holds run-named
            files that no run recorded.
    """
    import shutil

    out = Path(out)
    check_run_folder(out)  # only ever remove what a run wrote: proven by its config.json
    if (out / CONFIG_FILE).exists() and not resuming:
        if not (overwrite or resume_auto):
            raise ValueError(f"--out {out}: a run already exists there; pass --overwrite, --resume auto, or choose "
                             "another folder")
        checkpoints = [p for p in out.iterdir() if _CHECKPOINT_NAME.fullmatch(p.name)]
        for path in [out / name for name in RUN_FILES] + checkpoints + save_debris(out, RUN_FILES):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)  # a link is removed, never what it points to
    out.mkdir(parents=True, exist_ok=True)
    return out
