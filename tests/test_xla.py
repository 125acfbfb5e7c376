"""The trainer on a real XLA device (PJRT_DEVICE=CPU), each run in its own subprocess (DESIGN §6):
the device count and compile counters are process-wide."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from qat_lora.cache import CacheBuildConfig, build_cache

if importlib.util.find_spec("torch_xla") is None:
    if os.environ.get("CI"):
        raise RuntimeError("torch_xla is not installed; CI must install the [xla] extra")
    pytest.skip("torch_xla not installed (pip install 'qat-lora[xla]')", allow_module_level=True)


def _train(tmp_path, teacher_dir, cache, device: str, steps: int) -> dict:
    out = tmp_path / f"run-{device}"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
    cmd = [sys.executable, "-m", "qat_lora.cli", "train", "--model", str(teacher_dir), "--cache", str(cache),
           "--quant", "w2g32", "--out", str(out), "--max-steps", str(steps), "--batch-size", "2", "--log-steps", "1",
           "--lr", "1e-3", "--warmup-steps", "2", "--device", device, "--attn-implementation", "eager"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((out / "summary.json").read_text()), "metrics": metrics}


def test_five_xla_steps_compile_nothing_after_step_two(tmp_path, teacher_dir, corpus_dir):
    cache = tmp_path / "cache"
    build_cache(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(cache), seq_len=32,
                                 top_k=8, max_tokens=4_000, batch_size=8, device="cpu"), log=lambda _: None)
    xla = _train(tmp_path, teacher_dir, cache, "xla", steps=5)
    report = xla["summary"]["compile"]
    assert xla["summary"]["device"].startswith("xla")
    assert [m["step"] for m in xla["metrics"]] == [1, 2, 3, 4, 5]
    assert 1 <= report["graphs_compiled"] <= 3, report
    assert report["graphs_compiled_after_step_2"] == 0, report
    # Same seed, same data order, same LoRA init: the XLA losses follow the CPU run's.
    cpu = _train(tmp_path, teacher_dir, cache, "cpu", steps=5)
    for a, b in zip(xla["metrics"], cpu["metrics"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3, abs=1e-4)
