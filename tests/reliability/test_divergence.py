"""A run whose loss or gradient turns NaN / inf stops at once, saves nothing broken, and says so in one line."""
from __future__ import annotations

import pytest
import torch

import qat_lora.train.trainer as train_module
from qat_lora.train import checkpoint as ckpt
from qat_lora.commands.cli import main
from qat_lora.train.config import TrainConfig
from qat_lora.runtime.runs import RunDiverged


@pytest.fixture
def nan_from_step(monkeypatch):
    """Make the loss NaN from the given micro-step on (1-based), as a corrupted target or an overflow would."""
    calls = {"n": 0, "from": None}
    real = train_module.forward_loss

    def poisoned(*args, **kwargs):
        parts = real(*args, **kwargs)
        calls["n"] += 1
        if calls["from"] is not None and calls["n"] >= calls["from"]:
            parts = {**parts, "loss": parts["loss"] * float("nan")}
        return parts

    monkeypatch.setattr(train_module, "forward_loss", poisoned)
    return calls


def _cfg(teacher_dir, cache_dir, out, **kw) -> TrainConfig:
    base = dict(model=str(teacher_dir), cache=str(cache_dir), quant="w2g32", out=str(out), max_steps=8, batch_size=4,
                lr=1e-3, lora_r=4, warmup_steps=1, log_steps=4, save_steps=2, device="cpu")
    return TrainConfig(**{**base, **kw})


def test_nan_loss_stops_the_run_keeping_the_last_good_checkpoint(nan_from_step, teacher_dir, cache_dir, tmp_path):
    nan_from_step["from"] = 3  # step 3 goes bad; it is found at the step-4 save, before anything is written
    with pytest.raises(RunDiverged, match="at or before step 4; the last good checkpoint is .*checkpoint-2"):
        train_module.train(_cfg(teacher_dir, cache_dir, tmp_path / "run"), log=lambda _: None)
    saved = ckpt.list_checkpoints(tmp_path / "run")
    assert [ckpt.step_of(p) for p in saved] == [2]  # the step-4 checkpoint was never written
    tensors, _ = ckpt.load_checkpoint(saved[0])
    assert all(torch.isfinite(t).all() for t in tensors[ckpt.TRAINABLE_FILE].values())
    assert not (tmp_path / "run" / "adapter").exists() and not (tmp_path / "run" / "summary.json").exists()


def test_nan_is_caught_at_the_next_log_step_without_checkpoints(nan_from_step, teacher_dir, cache_dir, tmp_path):
    nan_from_step["from"] = 2  # after step 1 (where ranks also agree), the next check is the step-4 log step
    with pytest.raises(RunDiverged, match="at or before step 4; no checkpoint was saved before it"):
        train_module.train(_cfg(teacher_dir, cache_dir, tmp_path / "run", save_steps=0), log=lambda _: None)


def test_cli_reports_divergence_in_one_line_with_exit_1(nan_from_step, teacher_dir, cache_dir, tmp_path, capsys):
    nan_from_step["from"] = 1
    code = main(["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--quant", "w2g32", "--out",
                 str(tmp_path / "run"), "--max-steps", "2", "--batch-size", "4", "--lora-r", "4", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("qat-lora train: error: training diverged: ")
