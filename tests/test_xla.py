"""The trainer on a real XLA device (PJRT_DEVICE=CPU), each run in its own subprocess (DESIGN §6):
the device count and compile counters are process-wide."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers_xla import require_torch_xla
from qat_lora.cache.builder import build_cache
from qat_lora.cache.config import CacheBuildConfig

require_torch_xla()


def _train(tmp_path, teacher_dir, cache, device: str, steps: int, *extra: str) -> dict:
    out = tmp_path / f"run-{device}"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
    cmd = [sys.executable, "-m", "qat_lora", "train", "--model", str(teacher_dir), "--cache", str(cache),
           "--quant", "w2g32", "--out", str(out), "--max-steps", str(steps), "--batch-size", "2", "--log-steps", "1",
           "--lr", "1e-3", "--warmup-steps", "2", "--device", device, "--attn-implementation", "eager", *extra]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((out / "summary.json").read_text()), "metrics": metrics, "out": out,
            "stdout": result.stdout}


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory, teacher_dir, corpus_dir):
    cache = tmp_path_factory.mktemp("cache")
    build_cache(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(cache), seq_len=32,
                                 encoding="topk", top_k=8, max_tokens=4_000, batch_size=8, device="cpu"), log=lambda _: None)
    return cache


@pytest.fixture(scope="module")
def xla_run(tmp_path_factory, teacher_dir, xla_cache):
    # A checkpoint mid-run (device -> host copies) must not add a graph either.
    root = tmp_path_factory.mktemp("xla")
    return _train(root, teacher_dir, xla_cache, "xla", 20, "--save-steps", "10", "--xla-cache-dir", str(root / "xc"))


@pytest.mark.slow
@pytest.mark.xla
def test_twenty_xla_steps_compile_nothing_after_step_two(tmp_path, teacher_dir, xla_cache, xla_run):
    xla = xla_run
    report = json.loads((xla["out"] / "compile_report.json").read_text())
    assert xla["summary"]["device"].startswith("xla") and xla["summary"]["compile"] == report
    assert {"graphs_compiled", "graphs_compiled_after_step_2", "compile_seconds", "cpu_fallback_ops"} <= set(report)
    assert "compile report" in xla["stdout"]
    assert [m["step"] for m in xla["metrics"]] == list(range(1, 21))
    assert 1 <= report["graphs_compiled"] <= 3, report
    assert report["graphs_compiled_after_step_2"] == 0, report
    assert (xla["out"] / "checkpoint-10" / "adapter" / "adapter_model.safetensors").exists()
    assert any((xla["out"].parent / "xc").iterdir())  # the persistent compile cache was written
    # Same seed, same data order, same LoRA init: the XLA losses follow the CPU run's.
    cpu = _train(tmp_path, teacher_dir, xla_cache, "cpu", 20)
    assert not (cpu["out"] / "compile_report.json").exists()
    for a, b in zip(xla["metrics"], cpu["metrics"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3, abs=1e-4)


@pytest.mark.slow
@pytest.mark.xla
def test_qat_lora_with_accumulation_compiles_nothing_after_step_two(tmp_path, teacher_dir, xla_cache):
    # Micro-steps with a trainable quantiser: Wq is built in the first micro-step's graph and backpropagated in the
    # last one's (quant/fake_quant.quantized_weights_once_per_step): a fixed set of graphs, and the CPU run's losses.
    flags = ("--preset", "qat+lora", "--accumulation-steps", "2")
    xla = _train(tmp_path, teacher_dir, xla_cache, "xla", 6, *flags)
    report = json.loads((xla["out"] / "compile_report.json").read_text())
    assert report["graphs_compiled_after_step_2"] == 0 and report["graphs_compiled"] <= 4, report
    cpu = _train(tmp_path, teacher_dir, xla_cache, "cpu", 6, *flags)
    assert [m["step"] for m in xla["metrics"]] == list(range(1, 7))
    for a, b in zip(xla["metrics"], cpu["metrics"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3, abs=1e-4)


def _load_adapter(run) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_recovery_lora_multi.py"


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_spmd_over_two_devices_with_recompute_matches_one_device_with_the_whole_batch(tmp_path, teacher_dir, xla_cache, xla_run):
    out = tmp_path / "spmd"
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    env.pop("CPU_NUM_DEVICES", None)
    cmd = [sys.executable, str(SCRIPT), "--num-chips", "2", "--model", str(teacher_dir), "--cache", str(xla_cache),
           "--quant", "w2g32", "--out", str(out), "--max-steps", "20", "--batch-size", "1", "--log-steps", "1",
           "--lr", "1e-3", "--warmup-steps", "2", "--device", "xla", "--attn-implementation", "eager",
           "--gradient-checkpointing"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--parallel auto: one SPMD process over 2 XLA devices" in result.stdout
    report = json.loads((out / "compile_report.json").read_text())
    assert 1 <= report["graphs_compiled"] <= 3 and report["graphs_compiled_after_step_2"] == 0, report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens"] == xla_run["summary"]["tokens"]
    # One graph over the global batch (layers recomputed in backward): the same update as one device reading
    # both halves without recomputation.
    a, b = _load_adapter(xla_run["out"]), _load_adapter(out)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_multi_chip_xla_processes_on_a_cpu_host_are_a_one_line_error(tmp_path):
    from qat_lora.runtime.device import tpu_present

    if tpu_present():
        pytest.skip("a TPU host runs XLA replicas")
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    result = subprocess.run([sys.executable, str(SCRIPT), "--num-chips", "2", "--device", "xla", "--parallel",
                             "processes", "--model", "m", "--out", str(tmp_path / "r")], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        "train_recovery_lora_multi.py: error: --device xla --num-chips 2 --parallel processes: XLA:CPU replicas")
