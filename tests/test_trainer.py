"""The trainer on CPU: presets, exact resume after SIGKILL, SIGTERM checkpoints, gloo ranks, eval and best/."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qat_lora.train import checkpoint as ckpt
from qat_lora.cache.reader import KDCache, batch_order
from qat_lora.commands.cli import main
from qat_lora.train.config import TRAIN_PRESETS, StudentSpec, TrainConfig
from qat_lora.runtime.launch import launch_local
from qat_lora.train.metrics import kd_metrics
from qat_lora.quant.fake_quant import get_preset, latent_weights, quantizer_parameters
from qat_lora.quant.state import quantizer_state_dict, save_quantizer_state
from qat_lora.train.student import build_student, enable_activation_checkpointing_, load_student, make_trainable_
from qat_lora.train.optim import build_optimizer
from qat_lora.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(log=lambda _: None)


def _cfg(teacher_dir, cache_dir, out, **kw) -> TrainConfig:
    base = dict(model=str(teacher_dir), cache=str(cache_dir), quant="w2g32", out=str(out), max_steps=12,
                batch_size=4, lr=3e-3, lora_r=4, warmup_steps=2, log_steps=1, device="cpu")
    return TrainConfig(**{**base, **kw})


def _cli(teacher_dir, cache_dir, out, *extra: str) -> list[str]:
    return [sys.executable, "-m", "qat_lora", "train", "--model", str(teacher_dir), "--cache", str(cache_dir),
            "--quant", "w2g32", "--out", str(out), "--batch-size", "2", "--lr", "3e-3", "--lora-r", "4",
            "--warmup-steps", "2", "--log-steps", "1", "--device", "cpu", *extra]


def _curve(run: Path) -> list[dict]:
    """Per-step training records without the wall-clock fields."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    clock = ("tokens_per_s", "elapsed_s", "memory_mib")
    return [{k: v for k, v in r.items() if k not in clock} for r in records if "loss" in r]


@pytest.mark.parametrize("preset", list(TRAIN_PRESETS))
def test_preset_trains_exactly_its_parameters(preset, teacher_dir):
    model = make_trainable_(build_student(StudentSpec(str(teacher_dir), "w2g32")), preset, lora_r=4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    quant = {n for n, p in model.named_parameters() if any(p is q for q in quantizer_parameters(model))}
    lora = {n for n in dict(model.named_parameters()) if "lora_" in n}
    weights = {n for n, p in model.named_parameters() if any(p is w for w in latent_weights(model))}
    parts = TRAIN_PRESETS[preset]
    assert quant and weights and (lora or "lora" not in parts)
    expected = ((lora if "lora" in parts else set()) | (quant if "quantizer" in parts else set())
                | (weights if "weights" in parts else set()))
    assert trainable == expected
    assert ("lora" in TRAIN_PRESETS[preset]) == hasattr(model, "peft_config")


def test_moved_weights_are_saved_as_codes_and_reload_exactly(teacher_dir, tmp_path):
    # weight-qat (and GPTQ) move the latent weights: the state file carries the codes, and a student rebuilt
    # from it (eval, export, a LoRA stage) has exactly the trained Wq, although its latent weights are on-grid.
    model = make_trainable_(build_student(StudentSpec(str(teacher_dir), "w2g32")), "weight-qat")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in latent_weights(model):
            w.add_(0.05 * torch.randn(w.shape, generator=generator))
        for p in quantizer_parameters(model):
            p.mul_(1.0 + 0.1 * torch.rand(p.shape, generator=generator))
    path = tmp_path / "quantizer.safetensors"
    save_quantizer_state(model, path, codes=True)
    saved = load_file(str(path))
    assert {k.rsplit(".", 1)[1] for k in saved} == {"scale", "zero", "codes"} and saved[next(
        k for k in saved if k.endswith(".codes"))].dtype == torch.uint8
    reloaded = build_student(StudentSpec(str(teacher_dir), "w2g32", str(path)))
    fresh = build_student(StudentSpec(str(teacher_dir), "w2g32"))
    trained = {n: m.quantized_weight() for n, m in model.named_modules() if hasattr(m, "quantized_weight")}
    for name, module in reloaded.named_modules():
        if hasattr(module, "quantized_weight"):
            assert torch.equal(module.quantized_weight(), trained[name])
            assert not torch.equal(module.quantized_weight(), fresh.get_submodule(name).quantized_weight())
    ids = torch.randint(0, 200, (2, 16), generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    bad = tmp_path / "bad.safetensors"
    save_file({**saved, next(k for k in saved if k.endswith(".codes")): torch.zeros(3, 3, dtype=torch.uint8)},
              str(bad))
    with pytest.raises(ValueError, match="codes has shape"):
        build_student(StudentSpec(str(teacher_dir), "w2g32", str(bad)))


def test_latent_weights_and_quantisers_get_their_own_learning_rates(teacher_dir, cache_dir, tmp_path):
    cfg = _cfg(teacher_dir, cache_dir, tmp_path, preset="weight-qat", lr=1e-3, weight_lr_ratio=0.25,
               quantizer_lr_ratio=0.5, weight_decay=0.1)
    model = make_trainable_(build_student(StudentSpec(str(teacher_dir), "w2g32")), "weight-qat")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    quant_group, weight_group = build_optimizer(cfg, model, params).param_groups
    assert {id(p) for p in weight_group["params"]} == {id(w) for w in latent_weights(model)}
    assert {id(p) for p in quant_group["params"]} == {id(q) for q in quantizer_parameters(model)}
    assert weight_group["lr"] == 2.5e-4 and weight_group["weight_decay"] == 0.0
    assert quant_group["lr"] == 5e-4 and quant_group["weight_decay"] == 0.0  # decay would pull the grid to 0
    # qat+lora: the adapter at --lr with decay, the scales and zeros at their own rate
    cfg = _cfg(teacher_dir, cache_dir, tmp_path, preset="qat+lora", lr=1e-3, quantizer_lr_ratio=0.05,
               weight_decay=0.1)
    model = make_trainable_(build_student(StudentSpec(str(teacher_dir), "w2g32")), "qat+lora", lora_r=4)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    lora_group, quant_group = build_optimizer(cfg, model, params).param_groups
    assert lora_group["params"] and all("lora_" in n for n, p in params.items()
                                        if id(p) in {id(q) for q in lora_group["params"]})
    assert lora_group["lr"] == 1e-3 and lora_group["weight_decay"] == 0.1
    assert quant_group["lr"] == 5e-5 and quant_group["weight_decay"] == 0.0
    assert len(lora_group["params"]) + len(quant_group["params"]) == len(params)
    # --zero-lr-ratio: the zeros (offsets) in a group of their own at that fraction of the quantiser's rate
    cfg = _cfg(teacher_dir, cache_dir, tmp_path, preset="qat", lr=1e-3, quantizer_lr_ratio=0.5, zero_lr_ratio=0.2)
    model = make_trainable_(build_student(StudentSpec(str(teacher_dir), "w2g32")), "qat")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    scale_group, zero_group = build_optimizer(cfg, model, params).param_groups
    assert {id(p) for p in zero_group["params"]} == {id(q) for q in quantizer_parameters(model, names=("zero",))}
    assert scale_group["params"] and all(n.endswith(".scale") for n, p in params.items()
                                         if id(p) in {id(q) for q in scale_group["params"]})
    assert scale_group["lr"] == 5e-4 and zero_group["lr"] == pytest.approx(1e-4) and zero_group["weight_decay"] == 0.0
    # a mixed preset: each other grid's scales at (2^4 - 1) / (2^b - 1) x 64 / group of the base's rate
    cfg = _cfg(teacher_dir, cache_dir, tmp_path, preset="qat", lr=1e-3, quantizer_lr_ratio=0.5)
    model = make_trainable_(build_student(StudentSpec(str(teacher_dir), "w4g64-qo3-v8")), "qat")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    groups = build_optimizer(cfg, model, params).param_groups
    by_param = {id(p): g["lr"] for g in groups for p in g["params"]}
    for name, p in params.items():
        v_group = model.get_submodule(name.rsplit(".", 1)[0]).group_size if ".v_proj." in name else 64
        expected = 5e-4 * {".v_proj.": 15 / 255 * 64 / v_group, ".q_proj.": 15 / 7, ".o_proj.": 15 / 7}.get(
            next((k for k in (".v_proj.", ".q_proj.", ".o_proj.") if k in name), ""), 1.0)
        assert by_param[id(p)] == pytest.approx(expected), name
    assert len(groups) == 3 and sum(len(g["params"]) for g in groups) == len(params)
    for flag in ("weight_lr_ratio", "quantizer_lr_ratio", "zero_lr_ratio"):
        with pytest.raises(ValueError, match="--" + flag.replace("_", "-")):
            _cfg(teacher_dir, cache_dir, tmp_path, **{flag: 0.0})
    # recovery-lora trains no quantiser: the flag is refused when typed (refuse_unused_flags)
    assert "zero_lr_ratio" in _cfg(teacher_dir, cache_dir, tmp_path, preset="recovery-lora").unused_flags()


def _heldout(teacher_dir, cache_dir, run: Path | None, quantizer: Path | None = None) -> float:
    """Held-out KD soft CE of the student a run trained, loaded the way `qat-lora eval` loads it."""
    if run is not None and (run / "quantizer.safetensors").exists():
        quantizer = run / "quantizer.safetensors"
    adapter = run / "adapter" if run is not None and (run / "adapter").exists() else ""
    student = load_student(StudentSpec(str(teacher_dir), "w2g32", str(quantizer or "")), str(adapter))
    return kd_metrics(student, KDCache(cache_dir), 8, torch.device("cpu"))["kd_soft_ce"]


def test_recovery_lora_can_start_from_a_qat_run(teacher_dir, cache_dir, tmp_path):
    qat = tmp_path / "qat"
    train(_cfg(teacher_dir, cache_dir, qat, preset="qat", max_steps=6), **QUIET)
    student = build_student(StudentSpec(str(teacher_dir), "w2g32", str(qat / "quantizer.safetensors")))
    saved = load_file(str(qat / "quantizer.safetensors"))
    assert all(torch.equal(v, saved[k]) for k, v in quantizer_state_dict(student).items())
    lora = tmp_path / "lora"
    train(_cfg(teacher_dir, cache_dir, lora, quantizer=str(qat / "quantizer.safetensors")), **QUIET)
    assert json.loads((lora / "config.json").read_text())["quantizer"] == str(qat / "quantizer.safetensors")
    after_qat = _heldout(teacher_dir, cache_dir, None, qat / "quantizer.safetensors")
    assert _heldout(teacher_dir, cache_dir, lora, qat / "quantizer.safetensors") < after_qat - 0.005
    with pytest.raises(ValueError, match="--quantizer .*no such file"):
        _cfg(teacher_dir, cache_dir, lora, quantizer=str(tmp_path / "missing.safetensors"))


@pytest.mark.parametrize("preset", list(TRAIN_PRESETS))
def test_each_preset_lowers_heldout_kd_loss_and_saves_what_it_trained(preset, teacher_dir, cache_dir, tmp_path):
    run = tmp_path / "run"
    steps = 40 if preset == "qat" else 12  # scales alone move the loss less per step than adapters do
    summary = train(_cfg(teacher_dir, cache_dir, run, preset=preset, max_steps=steps), **QUIET)
    assert (run / "adapter" / "adapter_model.safetensors").exists() == ("lora" in TRAIN_PRESETS[preset])
    parts = TRAIN_PRESETS[preset]
    assert (run / "quantizer.safetensors").exists() == ("quantizer" in parts or "weights" in parts)
    assert summary["preset"] == preset
    if "quantizer" in parts:
        saved = load_file(str(run / "quantizer.safetensors"))
        initial = quantizer_state_dict(build_student(StudentSpec(str(teacher_dir), "w2g32")), codes="weights" in parts)
        assert saved.keys() == initial.keys()
        assert any(not torch.equal(saved[k], initial[k]) for k in saved)
    assert _heldout(teacher_dir, cache_dir, run) < _heldout(teacher_dir, cache_dir, None) - 0.005


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_then_resume_auto_is_bit_identical(teacher_dir, cache_dir, tmp_path):
    flags = ("--max-steps", "40", "--save-steps", "4", "--keep-checkpoints", "2")
    reference = tmp_path / "reference"
    subprocess.run(_cli(teacher_dir, cache_dir, reference, *flags), check=True, capture_output=True, timeout=300)
    run = tmp_path / "run"
    proc = subprocess.Popen(_cli(teacher_dir, cache_dir, run, *flags, "--resume", "auto"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not ckpt.list_checkpoints(run) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(random.Random(0).uniform(0.0, 0.2))  # a fixed "random" point after the first checkpoint
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.kill()
    proc.wait()
    assert not (run / "adapter").exists() and ckpt.list_checkpoints(run)
    killed_at = ckpt.step_of(ckpt.list_checkpoints(run)[-1])
    assert 4 <= killed_at < 40
    result = subprocess.run(_cli(teacher_dir, cache_dir, run, *flags, "--resume", "auto"), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resumed from {run / f'checkpoint-{killed_at}'}" in result.stdout
    a = load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _curve(run) == _curve(reference) and [r["step"] for r in _curve(run)] == list(range(1, 41))
    assert len(ckpt.list_checkpoints(run)) == 2 and not list(run.glob(".checkpoint-*"))
    summary = json.loads((run / "summary.json").read_text())  # wall time counts the killed process's steps too
    assert summary["wall_s"] > summary["wall_s_this_process"] > 0
    again = subprocess.run(_cli(teacher_dir, cache_dir, run, *flags, "--resume", "auto"), capture_output=True,
                           text=True, timeout=300)  # a preemption loop's extra rerun changes nothing
    assert again.returncode == 0 and "already holds a finished run" in again.stdout
    assert all(torch.equal(v, b[k]) for k, v in load_file(str(run / "adapter" / "adapter_model.safetensors")).items())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_saves_a_checkpoint_and_exits_143(teacher_dir, cache_dir, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(_cli(teacher_dir, cache_dir, run, "--max-steps", "100000"), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    [saved] = ckpt.list_checkpoints(run)
    assert "stopped by SIGTERM" in out and "--resume auto" in out
    tensors, state = ckpt.load_checkpoint(saved)
    assert state["step"] == ckpt.step_of(saved) > 0 and state["config"]["max_steps"] == 100000
    assert (saved / "adapter" / "adapter_config.json").exists()
    assert set(tensors[ckpt.RNG_FILE]) == {"rank0.torch"}


def test_resume_explains_a_config_mismatch(teacher_dir, cache_dir, tmp_path):
    run = tmp_path / "run"
    train(_cfg(teacher_dir, cache_dir, run, max_steps=2, save_steps=1), **QUIET)
    with pytest.raises(ValueError, match=r"run was written with --lr 0.003, this run has 0.001"):
        train(_cfg(teacher_dir, cache_dir, run, max_steps=2, lr=1e-3, resume="auto"), **QUIET)  # finished run
    with pytest.raises(ValueError, match=r"checkpoint-1 was written with --lr 0.003, this run has 0.001"):
        train(_cfg(teacher_dir, cache_dir, run, max_steps=2, lr=1e-3, resume=str(run / "checkpoint-1")), **QUIET)


def test_resume_compares_the_storage_dtype_as_it_resolves(teacher_dir, cache_dir, tmp_path):
    """A run written with --storage-dtype fp32 (the default before auto) resumes under auto where auto resolves
    to fp32 (here: the CPU's fp32 step), and is refused where it would train another dtype (bf16)."""
    run = tmp_path / "run"
    train(_cfg(teacher_dir, cache_dir, run, max_steps=2, save_steps=1, storage_dtype="fp32"), **QUIET)
    with pytest.raises(ValueError, match=r"run was written with --storage-dtype 'fp32', this run has 'bf16'"):
        train(_cfg(teacher_dir, cache_dir, run, max_steps=2, storage_dtype="bf16", resume="auto"), **QUIET)
    summary = train(_cfg(teacher_dir, cache_dir, run, max_steps=2, storage_dtype="auto", resume="auto"), **QUIET)
    assert summary["steps"] == 2  # the finished run, accepted as it is


@pytest.mark.parametrize("preset", ["recovery-lora", "qat"])
def test_gradient_checkpointing_changes_no_value(preset, teacher_dir, cache_dir, tmp_path):
    plain, recomputed = tmp_path / "plain", tmp_path / "recomputed"
    train(_cfg(teacher_dir, cache_dir, plain, max_steps=2, preset=preset), **QUIET)
    train(_cfg(teacher_dir, cache_dir, recomputed, max_steps=2, preset=preset, gradient_checkpointing=True), **QUIET)
    name = "adapter/adapter_model.safetensors" if preset == "recovery-lora" else "quantizer.safetensors"
    a, b = load_file(str(plain / name)), load_file(str(recomputed / name))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    for r1, r2 in zip(_curve(plain), _curve(recomputed), strict=True):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-6) and r2["grad_norm"] == pytest.approx(r1["grad_norm"], rel=1e-5)
    model = make_trainable_(build_student(StudentSpec(str(teacher_dir), "w2g32")), preset, lora_r=4)
    enable_activation_checkpointing_(model, torch.device("cpu"))
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert layers and all(m.gradient_checkpointing for m in layers)


def _full_rows_seed(cache_dir, rows: int) -> int:
    """A seed whose first `rows` training rows hold no padding (then mean of rank means == global mean)."""
    cache = KDCache(cache_dir)
    for seed in range(100):
        order = batch_order(cache.num_sequences("train"), seed=seed, epoch=0)[:rows]
        if all(bool(cache.sequence(int(i))["attention_mask"].all()) for i in order):
            return seed
    raise AssertionError("no seed without padded rows")


@pytest.mark.parametrize("preset", ["recovery-lora", "qat+lora"])
def test_accumulated_micro_steps_make_the_same_update_as_one_batch(preset, teacher_dir, cache_dir, tmp_path):
    # 2 micro-steps of 2 rows read the same 4 rows as one batch of 4 (no padding: mean of means == mean). Under
    # qat+lora the quantiser's Wq is built once per step and the summed dL/dWq backpropagated once.
    seed = _full_rows_seed(cache_dir, 12)
    whole, accumulated = tmp_path / "whole", tmp_path / "accumulated"
    train(_cfg(teacher_dir, cache_dir, whole, max_steps=3, batch_size=4, seed=seed, preset=preset), **QUIET)
    train(_cfg(teacher_dir, cache_dir, accumulated, max_steps=3, batch_size=2, accumulation_steps=2, seed=seed,
               preset=preset), **QUIET)
    names = ["adapter/adapter_model.safetensors"] + (["quantizer.safetensors"] if preset == "qat+lora" else [])
    for name in names:
        a, b = load_file(str(whole / name)), load_file(str(accumulated / name))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    if preset == "qat+lora":  # the quantiser really moved, so the comparison says something
        start = quantizer_state_dict(build_student(StudentSpec(str(teacher_dir), "w2g32")))
        moved = load_file(str(whole / "quantizer.safetensors"))
        assert any(not torch.equal(moved[k], start[k]) for k in start)
    for r1, r2 in zip(_curve(whole), _curve(accumulated), strict=True):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5) and r2["grad_norm"] == pytest.approx(r1["grad_norm"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_gloo_ranks_make_the_same_update_as_one_rank_with_twice_the_batch(teacher_dir, cache_dir, tmp_path):
    seed = _full_rows_seed(cache_dir, 12)
    single = tmp_path / "single"
    train(_cfg(teacher_dir, cache_dir, single, max_steps=3, batch_size=4, seed=seed), **QUIET)
    multi = tmp_path / "multi"
    cmd = [sys.executable, str(ROOT / "scripts" / "train_recovery_lora_multi.py"), "--num-chips", "2",
           *_cli(teacher_dir, cache_dir, multi, "--max-steps", "3", "--seed", str(seed))[4:]]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((multi / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens"] == 3 * 4 * 32
    a = load_file(str(single / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(multi / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    assert any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)  # the adapters really moved
    for k in a:  # Adam divides by sqrt(v): float rounding of the rank mean shows up at ~1e-6 in near-zero coordinates
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    assert [r["step"] for r in _curve(multi)] == [1, 2, 3]  # only the master writes metrics


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_sigkill_then_resume_equals_an_uninterrupted_torchrun_launch(teacher_dir, cache_dir, tmp_path):
    """Multi-rank resume (every rank's RNG and data position) and a torchrun launch, against each other."""
    import os
    import signal as signals

    flags = ("--max-steps", "10", "--save-steps", "2", "--keep-checkpoints", "2")
    reference = tmp_path / "torchrun"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "qat_lora", *_cli(teacher_dir, cache_dir, reference, *flags)[3:]]
    result = subprocess.run(torchrun, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((reference / "summary.json").read_text())["world_size"] == 2
    run = tmp_path / "run"
    launch = [sys.executable, str(ROOT / "scripts" / "train_recovery_lora_multi.py"), "--num-chips", "2",
              *_cli(teacher_dir, cache_dir, run, *flags, "--resume", "auto")[4:]]
    proc = subprocess.Popen(launch, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while not ckpt.list_checkpoints(run) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signals.SIGKILL)  # the launcher and both ranks, with no chance to save
    proc.wait()
    killed_at = ckpt.step_of(ckpt.list_checkpoints(run)[-1])
    assert 2 <= killed_at < 10 and not (run / "adapter").exists()
    result = subprocess.run(launch, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {run / f'checkpoint-{killed_at}'}" in result.stdout + result.stderr
    a = load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _curve(run) == _curve(reference) and [r["step"] for r in _curve(run)] == list(range(1, 11))


FAILING_RANK = """
import torch
from qat_lora.runtime.distributed import init_backend
backend = init_backend(torch.device("cpu"), timeout_s=120)
backend.rendezvous("up")
if backend.rank == 1:
    raise RuntimeError("rank 1 fails")
p = torch.nn.Parameter(torch.ones(3))
p.grad = torch.ones(3)
backend.reduce_gradients(torch.optim.SGD([p], lr=0.1))  # waits for a rank that is gone
backend.rendezvous("end")
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_that_raises_makes_every_rank_exit_nonzero(tmp_path):
    started = time.monotonic()
    codes = launch_local([sys.executable, "-c", FAILING_RANK], 2, grace_s=5, log=lambda _: None).codes
    assert all(code != 0 for code in codes), codes
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_periodic_eval_keeps_the_best_checkpoint_by_heldout_loss(teacher_dir, cache_dir, tmp_path):
    run = tmp_path / "run"
    summary = train(_cfg(teacher_dir, cache_dir, run, max_steps=6, eval_steps=3), **QUIET)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6] and all(0 <= r["kd_top1"] <= 1 for r in evals)
    assert all(r["memory_mib"] > 0 for r in records if "loss" in r)
    best = min(evals, key=lambda r: r["eval_loss"])
    assert summary["best_eval_loss"] == best["eval_loss"]
    assert json.loads((run / "best" / "eval.json").read_text())["step"] == best["step"]
    assert (run / "best" / "adapter" / "adapter_config.json").exists()
    assert main(["plot", str(run)]) == 0
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_unavailable_devices_and_bad_flags_are_one_line_errors(teacher_dir, cache_dir, tmp_path):
    with pytest.raises(ValueError, match="--preset 'lora'"):
        _cfg(teacher_dir, cache_dir, tmp_path, preset="lora")
    from qat_lora.runtime.device import tpu_present, resolve_device

    if not tpu_present():
        with pytest.raises(ValueError, match="--device tpu"):
            resolve_device("tpu")
    script = [sys.executable, str(ROOT / "scripts" / "train_recovery_lora_multi.py")]
    result = subprocess.run(script + ["--num-chips", "2", "--parallel", "spmd", "--device", "cpu", "--model", "m"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        "train_recovery_lora_multi.py: error: --parallel spmd with --device cpu: SPMD needs --device xla")
    result = subprocess.run(script + ["--num-chips", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        "train_recovery_lora_multi.py: error: --model is required: the full-precision model folder, .gguf file or hub name")
    result = subprocess.run(script + ["--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: train_recovery_lora_multi")
    assert "--num-chips" in result.stdout and "--parallel" in result.stdout


@pytest.mark.slow
def test_tensorboard_scalars_match_the_metrics_file(teacher_dir, cache_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "tb"
    train(_cfg(teacher_dir, cache_dir, run, max_steps=4, eval_steps=2, tensorboard=True), **QUIET)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    logged = [(s.step, s.value) for s in events.Scalars("train/loss")]
    expected = [(r["step"], r["loss"]) for r in _curve(run)]
    assert [step for step, _ in logged] == [step for step, _ in expected] == [1, 2, 3, 4]
    for (_, got), (_, want) in zip(logged, expected):
        assert got == pytest.approx(want, rel=1e-6)
    assert [s.step for s in events.Scalars("eval/eval_loss")] == [2, 4]


@pytest.mark.slow
def test_calibrated_lora_init_starts_closer_to_the_teacher_than_zero(teacher_dir, cache_dir, tmp_path):
    """--lora-init calibrated: the run starts from the calibrated adapters (held-out KD loss after one step at a
    negligible rate is lower than the zero start's), records it, and refuses a preset without LoRA."""
    losses = {}
    for init in ("zero", "calibrated"):
        run = tmp_path / init
        train(_cfg(teacher_dir, cache_dir, run, max_steps=1, lr=1e-9, warmup_steps=0, lora_init=init,
                   lora_init_sequences=16), **QUIET)
        assert json.loads((run / "config.json").read_text())["lora_init"] == init
        losses[init] = _heldout(teacher_dir, cache_dir, run)
    assert losses["calibrated"] < losses["zero"] - 0.01
    with pytest.raises(ValueError, match="--lora-init calibrated --preset qat: that preset trains no LoRA"):
        _cfg(teacher_dir, cache_dir, tmp_path, preset="qat", lora_init="calibrated")
    with pytest.raises(ValueError, match="--lora-init 'svd': choose zero, calibrated or an adapter folder"):
        _cfg(teacher_dir, cache_dir, tmp_path, lora_init="svd")


def test_lora_can_start_from_a_saved_adapter_folder(teacher_dir, cache_dir, tmp_path):
    from conftest import save_random_adapter

    start = tmp_path / "start"
    save_random_adapter(teacher_dir, "w2g32", start, r=4, alpha=8.0)
    run = tmp_path / "run"
    train(_cfg(teacher_dir, cache_dir, run, max_steps=1, lr=1e-9, warmup_steps=0, lora_alpha=8.0,
               lora_init=str(start)), **QUIET)
    saved = load_file(str(start / "adapter_model.safetensors"))
    begun = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert saved.keys() == begun.keys() and all(torch.allclose(saved[k], begun[k], atol=1e-6) for k in saved)
    assert any(saved[k].abs().sum() > 0 for k in saved if "lora_B" in k)
    with pytest.raises(ValueError, match=r"--lora-init .*start: an adapter of rank 4 and alpha 8.0; this run has "
                                         r"--lora-r 8 and --lora-alpha 16.0"):
        _cfg(teacher_dir, cache_dir, tmp_path / "other", max_steps=1, lora_r=8, lora_alpha=16.0, lora_init=str(start))
    (start / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"--lora-init .*start: its adapter_model.safetensors cannot be read"):
        train(_cfg(teacher_dir, cache_dir, tmp_path / "broken", max_steps=1, lora_alpha=8.0, lora_init=str(start)),
              **QUIET)


def test_trained_norms_ride_with_the_quantiser_into_every_student_and_export(teacher_dir, cache_dir, tmp_path):
    from qat_lora.export.exporter import load_packed
    from qat_lora.quant.state import has_norms, norm_parameters

    base = build_student(StudentSpec(str(teacher_dir), "w2g32"))
    base_norms = {k: p.detach().clone() for k, p in norm_parameters(base).items()}
    assert len(base_norms) == 2 * base.config.num_hidden_layers + 1  # two per layer and the final norm
    qat = tmp_path / "qat"
    train(_cfg(teacher_dir, cache_dir, qat, preset="qat", max_steps=12, train_norms=True), **QUIET)
    saved = load_file(str(qat / "quantizer.safetensors"))
    assert has_norms(qat / "quantizer.safetensors") and set(base_norms) <= set(saved)
    assert all(not torch.equal(saved[k], v) for k, v in base_norms.items())  # every gain moved
    # optimizer: the norms in their own group, at the quantiser's rate, never decayed
    cfg = _cfg(teacher_dir, cache_dir, tmp_path / "x", preset="qat", lr=1e-3, quantizer_lr_ratio=0.5,
               weight_decay=0.1, train_norms=True)
    model = make_trainable_(build_student(StudentSpec(str(teacher_dir), "w2g32")), "qat", norms=True)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    quant_group, norm_group = build_optimizer(cfg, model, params).param_groups
    assert {id(p) for p in norm_group["params"]} == {id(p) for p in norm_parameters(model).values()}
    assert norm_group["lr"] == 5e-4 and norm_group["weight_decay"] == 0.0
    # eval's student loads them; a LoRA run over that quantiser keeps them in its base
    student = load_student(StudentSpec(str(teacher_dir), "w2g32", str(qat / "quantizer.safetensors")))
    assert all(torch.equal(p, saved[k]) for k, p in norm_parameters(student).items())
    lora = tmp_path / "lora"
    train(_cfg(teacher_dir, cache_dir, lora, quantizer=str(qat / "quantizer.safetensors"), max_steps=3), **QUIET)
    from qat_lora.train.adapter import resolve_adapter_base

    quant, quantizer = resolve_adapter_base("--adapter", str(lora / "adapter"), str(teacher_dir), "", "")
    chained = load_student(StudentSpec(str(teacher_dir), quant, quantizer), str(lora / "adapter"))
    assert all(torch.equal(p, saved[k]) for k, p in norm_parameters(chained).items())
    # qat again from that quantiser without --train-norms: the norms stay as they were, and stay in the file
    again = tmp_path / "again"
    train(_cfg(teacher_dir, cache_dir, again, preset="qat", max_steps=3, quantizer=str(qat / "quantizer.safetensors")),
          **QUIET)
    resaved = load_file(str(again / "quantizer.safetensors"))
    assert all(torch.equal(resaved[k], saved[k]) for k in base_norms)
    # the packed export ships them: same logits as the trained student
    out = tmp_path / "export"
    assert main(["export", "--model", str(teacher_dir), "--quant", "w2g32", "--quantizer",
                 str(qat / "quantizer.safetensors"), "--format", "packed", "--out", str(out)]) == 0
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        assert torch.allclose(load_packed(out / "packed")(input_ids=ids).logits, student(input_ids=ids).logits,
                              atol=1e-5)
    with pytest.raises(ValueError, match="--train-norms --preset recovery-lora"):
        _cfg(teacher_dir, cache_dir, tmp_path / "y", preset="recovery-lora", train_norms=True)


def test_trained_scales_never_cross_zero(teacher_dir, cache_dir, tmp_path):
    """Adam moves a scale by about its rate per step whatever its size: at a high rate small scales were driven
    through 0 (and a 2-bit run at 1e-3 to a NaN once fp16 stored one as 0). Every step keeps them >= SCALE_FLOOR."""
    from qat_lora.quant.inits import SCALE_FLOOR

    run = tmp_path / "run"
    train(_cfg(teacher_dir, cache_dir, run, preset="qat", lr=0.05, warmup_steps=1, max_steps=8), **QUIET)
    saved = load_file(str(run / "quantizer.safetensors"))
    scales = torch.cat([v.flatten() for k, v in saved.items() if k.endswith(".scale")])
    assert scales.min() >= SCALE_FLOOR and (scales == SCALE_FLOOR).any()  # some were stopped at the floor
    assert all(torch.isfinite(v).all() for v in saved.values())


def test_constrain_keeps_each_grids_scales_in_their_domain():
    from qat_lora.quant.fake_quant import FakeQuantLinear, constrain_quantizers_, trained_quantised_layers
    from qat_lora.quant.inits import SCALE_FLOOR

    torch.manual_seed(0)
    for preset, signed in (("w2g32", False), ("w3g64f", False), ("lut3g64", False), ("q4_0", True)):
        layer = FakeQuantLinear.from_linear(torch.nn.Linear(64, 8), get_preset(preset))
        values = torch.tensor([0.3, -0.2, 1e-7, -1e-7, 0.0, -0.0, SCALE_FLOOR, -0.5])
        with torch.no_grad():
            layer.scale.copy_(values[: layer.scale.shape[0], None].expand_as(layer.scale))
        layer.scale.requires_grad_(True)  # as make_trainable_ leaves a trained quantiser
        constrain_quantizers_(trained_quantised_layers(torch.nn.Sequential(layer)))
        got = layer.scale[:, 0]
        if signed:  # Q4_0's d keeps its sign; only its size is floored
            expected = torch.tensor([0.3, -0.2, SCALE_FLOOR, -SCALE_FLOOR, SCALE_FLOOR, -SCALE_FLOOR, SCALE_FLOOR, -0.5])
        else:
            expected = torch.tensor([0.3, SCALE_FLOOR, SCALE_FLOOR, SCALE_FLOOR, SCALE_FLOOR, SCALE_FLOOR, SCALE_FLOOR,
                                     SCALE_FLOOR])
        assert torch.equal(got, expected), preset
        layer.scale.requires_grad_(False)  # frozen layers are left alone
        with torch.no_grad():
            layer.scale.fill_(-1.0)
        constrain_quantizers_(trained_quantised_layers(torch.nn.Sequential(layer)))
        assert (layer.scale == -1.0).all()
