"""`qat-lora recover`: init -> end-to-end QAT -> LoRA, each stage's artefacts kept and each stage resumable."""
from __future__ import annotations

import json

import pytest
import torch

from qat_lora.cache import KDCache
from qat_lora.cli import main
from qat_lora.config import RecoverConfig, StudentSpec
from qat_lora.metrics import kd_metrics
from qat_lora.recover import recover
from qat_lora.student import load_student

QUIET = dict(log=lambda _: None)


def _cfg(teacher_dir, cache_dir, out, **kw) -> RecoverConfig:
    base = dict(model=str(teacher_dir), quant="w2g32", cache=str(cache_dir), out=str(out), calib_sequences=16,
                qat="weight-qat", qat_steps=4, lora_steps=0, lora_r=4, batch_size=4, save_steps=0, device="cpu")
    return RecoverConfig(**{**base, **kw})


def _soft_ce(teacher_dir, cache_dir, quantizer: str = "", adapter: str = "") -> float:
    student = load_student(StudentSpec(str(teacher_dir), "w2g32", quantizer), adapter)
    return kd_metrics(student, KDCache(cache_dir), 8, torch.device("cpu"))["kd_soft_ce"]


def test_stages_chain_and_a_rerun_only_adds_what_is_new(teacher_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    first = recover(_cfg(teacher_dir, cache_dir, out), **QUIET)
    assert first["stages"]["init"] == str(out / "init" / "quantizer.safetensors")
    assert first["quantizer"] == str(out / "qat" / "quantizer.safetensors") and first["adapter"] is None
    assert json.loads((out / "qat" / "config.json").read_text())["quantizer"] == first["stages"]["init"]
    before = {p: p.stat().st_mtime_ns for p in (out / "init").rglob("*")} | \
        {p: p.stat().st_mtime_ns for p in (out / "qat").rglob("*")}
    second = recover(_cfg(teacher_dir, cache_dir, out, lora_steps=4), **QUIET)  # the same stages + LoRA
    assert {p: p.stat().st_mtime_ns for p in before} == before  # init and qat were not redone
    assert second["adapter"] == str(out / "lora" / "adapter") and second["quantizer"] == first["quantizer"]
    assert json.loads((out / "lora" / "config.json").read_text())["quantizer"] == first["quantizer"]
    assert json.loads((out / "recover.json").read_text())["adapter"] == second["adapter"]
    ptq = _soft_ce(teacher_dir, cache_dir)
    init = _soft_ce(teacher_dir, cache_dir, first["stages"]["init"])
    qat = _soft_ce(teacher_dir, cache_dir, second["quantizer"])
    final = _soft_ce(teacher_dir, cache_dir, second["quantizer"], second["adapter"])
    assert final < qat < init < ptq


def test_scale_only_qat_after_gptq_keeps_the_moved_weights(teacher_dir, cache_dir, tmp_path):
    # qat trains scales and zeros only, but its start (GPTQ) moved the weights: its state must carry the codes,
    # or a student rebuilt from it would silently fall back to the base model's weights.
    from safetensors.torch import load_file

    out = recover(_cfg(teacher_dir, cache_dir, tmp_path / "run", qat="qat", qat_steps=2), **QUIET)
    init, trained = load_file(out["stages"]["init"]), load_file(out["quantizer"])
    codes = [k for k in init if k.endswith(".codes")]
    assert codes and set(codes) <= set(trained)


def test_blockwise_stage_runs_between_init_and_qat(teacher_dir, cache_dir, tmp_path):
    out = recover(_cfg(teacher_dir, cache_dir, tmp_path / "run", blockwise_steps=4, qat_steps=2), **QUIET)
    report = json.loads((tmp_path / "run" / "init" / "quantize.json").read_text())
    assert report["config"]["blockwise_steps"] == 4 and len(report["blockwise"]["blocks"]) == 2
    assert (tmp_path / "run" / "init" / "blocks" / "progress.json").exists()
    assert json.loads((tmp_path / "run" / "qat" / "config.json").read_text())["quantizer"] == out["stages"]["init"]


def test_changed_init_settings_are_refused_not_mixed(teacher_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    recover(_cfg(teacher_dir, cache_dir, out, qat="none"), **QUIET)
    with pytest.raises(ValueError, match="its init/ was made with other settings"):
        recover(_cfg(teacher_dir, cache_dir, out, qat="none", init="act"), **QUIET)


@pytest.mark.parametrize("flag, value, message", [
    ("--qat", "lsq", "--qat 'lsq': choose one of none, weight-qat, qat"),
    ("--init", "awq", "--init 'awq': choose one of"),
    ("--qat-steps", "0", "--qat-steps 0: must be positive"),
    ("--weight-lr", "nan", "--weight-lr nan: must be positive"),
    ("--blockwise-steps", "-2", "--blockwise-steps -2: must be >= 0"),
])
def test_bad_flags_are_one_line_errors(flag, value, message, teacher_dir, cache_dir, tmp_path, capsys):
    argv = ["recover", "--model", str(teacher_dir), "--quant", "w2g32", "--cache", str(cache_dir),
            "--out", str(tmp_path / "r"), flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qat-lora recover: error: " + message)
    assert not (tmp_path / "r").exists()
