"""`train --report-to` (issue 18, item 6): wandb offline writes its run folder without a network, a resumed run
continues the same wandb run id; --tensorboard stays an alias of --report-to tensorboard."""
from __future__ import annotations

import json
import shutil

import pytest

from qat_lora.train.config import TrainConfig
from qat_lora.train.trainer import train

pytest.importorskip("wandb", reason="the `wandb` extra: pip install 'qat-lora[wandb]'")


def _cfg(teacher_dir, cache_dir, out, **kw) -> TrainConfig:
    base = dict(model=str(teacher_dir), cache=str(cache_dir), quant="w2g32", out=str(out), batch_size=4, lr=3e-3,
                lora_r=4, warmup_steps=1, log_steps=1, device="cpu", report_to="wandb")
    return TrainConfig(**{**base, **kw})


def _offline_runs(run_dir):
    return sorted((run_dir / "wandb" / "wandb").glob("offline-run-*"))


def _logged(run_folder) -> bytes:
    """The run's record log (wandb 0.31 ships no reader for it: its protobuf records carry the keys as text)."""
    return next(run_folder.glob("run-*.wandb")).read_bytes()


@pytest.mark.slow
def test_wandb_offline_run_and_resume_keep_one_run_id(teacher_dir, cache_dir, tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    run = tmp_path / "run"
    train(_cfg(teacher_dir, cache_dir, run, max_steps=5, save_steps=3), log=lambda _: None)
    (run / "summary.json").unlink()  # as if stopped after checkpoint-3: resume redoes steps 4 and 5
    for extra in run.glob("checkpoint-*"):
        if extra.name != "checkpoint-3":
            shutil.rmtree(extra)
    run_id = (run / "wandb_run_id").read_text().strip()
    first = _offline_runs(run)
    assert len(first) == 1 and first[0].name.endswith(run_id)
    assert b"train/loss" in _logged(first[0]) and run_id.encode() in _logged(first[0])
    train(_cfg(teacher_dir, cache_dir, run, max_steps=5, save_steps=3, resume="auto"), log=lambda _: None)
    runs = _offline_runs(run)
    assert len(runs) == 2 and all(r.name.endswith(run_id) for r in runs)  # one run id, two sessions
    assert (run / "wandb_run_id").read_text().strip() == run_id
    assert b"train/loss" in _logged(next(r for r in runs if r not in first))
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("kwargs,match", [
    (dict(report_to="mlflow"), "--report-to 'mlflow': choose one of none, tensorboard, wandb"),
    (dict(report_to="wandb", tensorboard=True), "--tensorboard means --report-to tensorboard"),
])
def test_report_to_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(model="m", **kwargs)


def test_tensorboard_flag_is_an_alias():
    assert TrainConfig(model="m", tensorboard=True).report_to == "tensorboard"
