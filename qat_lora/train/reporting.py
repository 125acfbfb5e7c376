"""Where a training run's metrics go besides metrics.jsonl: `--report-to tensorboard|wandb|none` (issue 18, item 6).

    qat-lora train ... --report-to wandb        # OUT/wandb/, offline unless WANDB_MODE or WANDB_API_KEY say online
    qat-lora train ... --report-to tensorboard  # OUT/tensorboard/ (--tensorboard is the same)

Only the master rank reports (the trainer creates the metrics log there only). A resumed run reports to the same
wandb run: its id is kept in OUT/wandb_run_id and handed back with resume="allow"; TensorBoard purges the steps
after the checkpoint, as metrics.jsonl drops them.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from qat_lora.runtime import runs

PROJECT = "qat-lora"


def _scalars(record: dict) -> dict[str, float]:
    """A metrics record's numbers under train/ or eval/ (booleans and the step itself left out)."""
    group = "eval" if "eval_loss" in record else "train"
    return {f"{group}/{k}": v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardReporter:
    def __init__(self, run_dir: Path, resumed_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / runs.TENSORBOARD_DIR), purge_step=resumed_step or None)

    def write(self, record: dict) -> None:
        for key, value in _scalars(record).items():
            self._writer.add_scalar(key, value, record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbReporter:
    def __init__(self, run_dir: Path, config: dict):
        import wandb

        id_file = run_dir / runs.WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        online = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        (run_dir / runs.WANDB_DIR).mkdir(exist_ok=True)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), id=run_id, resume="allow",
                               dir=str(run_dir / runs.WANDB_DIR), mode=online, config=config, name=run_dir.name)

    def write(self, record: dict) -> None:
        self._run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


def open_reporters(report_to: str, run_dir: Path, resumed_step: int, config: dict) -> list:
    """The reporters `--report-to` names (none: an empty list)."""
    if report_to == "tensorboard":
        return [TensorBoardReporter(run_dir, resumed_step)]
    if report_to == "wandb":
        return [WandbReporter(run_dir, config)]
    return []
