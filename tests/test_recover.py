"""`qat-lora recover`: init -> end-to-end QAT -> LoRA, each stage's artefacts kept and each stage resumable."""
from __future__ import annotations

import json

import pytest
import torch

from qat_lora.cache.reader import KDCache
from qat_lora.commands.cli import build_parser, config_from_args, main
from qat_lora.commands.config import RecoverConfig
from qat_lora.train.config import StudentSpec
from qat_lora.train.metrics import kd_metrics
from qat_lora.commands.recover import recover
from qat_lora.train.student import load_student

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
    second = recover(_cfg(teacher_dir, cache_dir, out, lora_steps=4, lr=2e-3), **QUIET)  # the same stages + LoRA
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


def test_lr_probe_chooses_the_rate_with_the_lowest_heldout_kd_loss(teacher_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    rates = [1e-5, 3e-3, 0.5]  # too low to move, about right, far too high for a tiny random model
    summary = recover(_cfg(teacher_dir, cache_dir, out, qat="none", lora_steps=6, lr=rates, lr_probe_steps=3),
                      **QUIET)
    probe = json.loads((out / "probe" / "probe.json").read_text())
    assert probe["steps"] == 3 and set(probe["heldout_kd_loss"]) == {"1e-05", "0.003", "0.5"}
    scores = {float(k): v for k, v in probe["heldout_kd_loss"].items()}
    finite = {k: v for k, v in scores.items() if v is not None}
    assert probe["chosen"] == summary["lr"] == min(finite, key=finite.get) == 3e-3
    for lr, score in finite.items():  # each score is the probe adapter's held-out soft CE, recomputed here
        run = out / "probe" / f"lr-{lr:g}"
        assert json.loads((run / "config.json").read_text())["max_steps"] == 3
        assert _soft_ce(teacher_dir, cache_dir, summary["quantizer"], str(run / "adapter")) == pytest.approx(score,
                                                                                                            rel=1e-4)
    lora = json.loads((out / "lora" / "config.json").read_text())
    assert lora["lr"] == 3e-3 and lora["max_steps"] == 6 and lora["eval_steps"] == 0
    runs = {p: p.stat().st_mtime_ns for p in (out / "probe").glob("lr-*/adapter/*.safetensors")}
    again = recover(_cfg(teacher_dir, cache_dir, out, qat="none", lora_steps=6, lr=rates, lr_probe_steps=3), **QUIET)
    assert again["lr"] == 3e-3 and again["adapter"] == summary["adapter"]
    assert runs and {p: p.stat().st_mtime_ns for p in runs} == runs  # finished probes are read, not rerun


@pytest.mark.parametrize("lora_steps, probe, expected", [(200, 0, 20), (1000, 0, 20), (40, 0, 8), (4, 0, 4),
                                                         (200, 7, 7)])
def test_probe_length_is_a_fifth_of_the_stage_within_4_to_20(lora_steps, probe, expected, teacher_dir, cache_dir,
                                                             tmp_path):
    from qat_lora.commands.recover import probe_steps

    cfg = _cfg(teacher_dir, cache_dir, tmp_path / "run", lora_steps=lora_steps, lr_probe_steps=probe)
    assert probe_steps(cfg) == expected


def test_a_diverged_probe_loses_and_all_diverged_is_one_line(teacher_dir, cache_dir, tmp_path, monkeypatch):
    from qat_lora.commands import recover as recover_module
    from qat_lora.runtime.runs import RunDiverged

    real = recover_module._train_stage

    def diverge_above(limit):
        def stage(cfg, name, quantizer, log, **fields):
            if fields["lr"] > limit and name.startswith("probe/"):
                raise RunDiverged("training diverged")
            return real(cfg, name, quantizer, log, **fields)
        return stage

    monkeypatch.setattr(recover_module, "_train_stage", diverge_above(1e-3))
    out = recover(_cfg(teacher_dir, cache_dir, tmp_path / "a", qat="none", lora_steps=4, lr=[1e-3, 2e-3],
                       lr_probe_steps=2), **QUIET)
    assert out["lr"] == 1e-3 and out["lr_probe"]["0.002"] is None
    monkeypatch.setattr(recover_module, "_train_stage", diverge_above(0.0))
    with pytest.raises(ValueError, match=r"^--lr 0.001 0.002: every rate diverged in the probe; pass lower rates$"):
        recover(_cfg(teacher_dir, cache_dir, tmp_path / "b", qat="none", lora_steps=4, lr=[1e-3, 2e-3],
                     lr_probe_steps=2), **QUIET)
    assert not (tmp_path / "b" / "lora").exists()


def test_lr_probe_needs_a_heldout_split(teacher_dir, corpus_dir, tmp_path):
    from qat_lora.cache.builder import build_cache
    from qat_lora.cache.config import CacheBuildConfig

    cache = tmp_path / "cache"
    build_cache(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(cache), seq_len=32,
                                 encoding="topk", top_k=8, max_tokens=2_000, batch_size=8, holdout_fraction=0.0, device="cpu"),
                log=lambda _: None)
    with pytest.raises(ValueError, match="no held-out split to choose --lr on"):
        recover(_cfg(teacher_dir, cache, tmp_path / "run", qat="none", lora_steps=4, lr=[1e-3, 2e-3]), **QUIET)
    assert not (tmp_path / "run" / "init").exists()  # refused before the init's minutes of work


def test_one_lr_on_the_command_line_skips_the_probe(teacher_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    argv = ["recover", "--model", str(teacher_dir), "--quant", "w2g32", "--cache", str(cache_dir), "--out", str(out),
            "--calib-sequences", "16", "--lora-steps", "2", "--lora-r", "4", "--save-steps", "0", "--device", "cpu",
            "--lr", "1e-3"]
    assert main(argv) == 0
    assert not (out / "probe").exists() and json.loads((out / "lora" / "config.json").read_text())["lr"] == 1e-3
    assert json.loads((out / "recover.json").read_text())["lr"] == 1e-3


@pytest.mark.parametrize("lora_r, rates", [(16, [5e-4, 1e-3, 2e-3]), (64, [1.25e-4, 2.5e-4, 5e-4]),
                                            (8, [1e-3, 2e-3, 4e-3]), (48, [1.67e-4, 3.33e-4, 6.67e-4])])
def test_default_lr_probe_scales_with_16_over_the_rank(lora_r, rates, tmp_path):
    """The measured best rates fell as 16 / r (SmolLM2 2e-3 -> 5e-4, Gemma 3 5e-4 -> 1.25e-4 from r16 to r64)."""

    args = build_parser().parse_args(["recover", "--model", "m", "--quant", "w3g64", "--lora-r", str(lora_r)])
    assert config_from_args(RecoverConfig, args).lr == rates
    assert RecoverConfig(model="m", quant="w3g64", lora_r=lora_r).lr == rates
    explicit = build_parser().parse_args(["recover", "--model", "m", "--quant", "w3g64", "--lora-r", str(lora_r),
                                          "--lr", "3e-3", "1e-2"])
    assert config_from_args(RecoverConfig, explicit).lr == [3e-3, 1e-2]  # what the user lists is never rescaled


@pytest.mark.parametrize("quant, rate", [("w2g64", 1e-3), ("w2g64-v8", 1e-3), ("w3g64-v8", 5e-4), ("w4g64", 2e-4),
                                         ("q4_k", 2e-4), ("w8pc", 2e-4), ("lut3g64", 5e-4)])
def test_default_qat_rate_follows_the_grid_width(quant, rate):
    """The qat rate measured best fell as the start got better: 1e-3 at 2 bits, 5e-4 at 3, 2e-4 at 4 (SmolLM2)."""
    assert RecoverConfig(model="m", quant=quant, qat="qat").qat_lr == rate
    assert RecoverConfig(model="m", quant=quant, qat="qat", qat_lr=3e-3).qat_lr == 3e-3  # as typed
    args = build_parser().parse_args(["recover", "--model", "m", "--quant", quant, "--qat", "weight-qat"])
    assert config_from_args(RecoverConfig, args).qat_lr == rate


@pytest.mark.parametrize("flag, value, message", [
    ("--lr", "1e-3 1e-3", "--lr 0.001 0.001: a rate is repeated; list each once"),
    ("--lr", "0", "--lr 0.0: must be positive"),
    ("--lr", "2", "--lr 2.0: must be at most 1"),
    ("--qat", "lsq", "--qat 'lsq': choose one of none, weight-qat, qat"),
    ("--init", "awq", "--init 'awq': choose one of"),
    ("--qat-steps", "0", "--qat-steps 0: must be positive"),
    ("--weight-lr", "nan", "--weight-lr nan: must be positive"),
    ("--blockwise-steps", "-2", "--blockwise-steps -2: must be >= 0"),
])
def test_bad_flags_are_one_line_errors(flag, value, message, teacher_dir, cache_dir, tmp_path, capsys):
    argv = ["recover", "--model", str(teacher_dir), "--quant", "w2g32", "--cache", str(cache_dir),
            "--out", str(tmp_path / "r"), flag, *value.split()]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qat-lora recover: error: " + message)
    assert not (tmp_path / "r").exists()


def test_calibrated_lora_start_is_computed_once_for_the_probes_and_the_stage(teacher_dir, cache_dir, tmp_path,
                                                                               monkeypatch):
    import qat_lora.train.lora as lora

    calls = []
    original = lora.calibrated_lora_init_
    monkeypatch.setattr(lora, "calibrated_lora_init_", lambda *a, **k: calls.append(1) or original(*a, **k))
    out = tmp_path / "run"
    cfg = _cfg(teacher_dir, cache_dir, out, qat="none", lora_steps=4, lr=[2e-3, 1e-3], lora_init="calibrated")
    summary = recover(cfg, **QUIET)
    assert len(calls) == 1 and (out / "lora-init" / "adapter_model.safetensors").exists()
    for stage in ("lora", "probe/lr-0.002", "probe/lr-0.001"):
        assert json.loads((out / stage / "config.json").read_text())["lora_init"] == str(out / "lora-init")
    start = _soft_ce(teacher_dir, cache_dir, summary["quantizer"], str(out / "lora-init"))
    assert _soft_ce(teacher_dir, cache_dir, summary["quantizer"], summary["adapter"]) < start < \
        _soft_ce(teacher_dir, cache_dir, summary["quantizer"])
    recover(cfg, **QUIET)  # a rerun reuses the start
    assert len(calls) == 1
    with pytest.raises(ValueError, match="--lora-init 'pissa': choose zero or calibrated"):
        _cfg(teacher_dir, cache_dir, out, lora_init="pissa")
