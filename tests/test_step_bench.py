"""The step harness (benchmarks/step_bench.py, issue 7): its configuration matrix, its FLOP count, and one
end-to-end run on a tiny shape (every measurement a subprocess, as in the real run)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qat_lora.train.config import TRAIN_PRESETS

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("kind", "device", "shape", "seq_len", "batch_size", "preset", "quant", "loss", "tokens_per_s", "mfu",
            "peak_mem_bytes")


@pytest.fixture(scope="module")
def step_bench():
    return load_benchmark("step_bench")


@pytest.mark.xla
def test_configurations_pair_every_preset_with_the_fake_quant_linear_only(step_bench):
    args = step_bench.parse_args(["--devices", "cpu", "xla", "--quant", "w2g32"])
    specs = step_bench.step_specs(args)
    keys = [(s["device"], s["linear"], s["preset"], s["chunk"]) for s in specs]
    presets = set(TRAIN_PRESETS)  # recovery-lora, qat, qat+lora, weight-qat
    assert len(keys) == len(set(keys)) == 2 * (1 + len(presets)) * 2  # devices x (plain LoRA + presets) x losses
    assert {k[2] for k in keys if k[1] == "nn.Linear"} == {"recovery-lora"}
    assert {k[2] for k in keys if k[1] == "w2g32"} == presets
    assert {k[3] for k in keys} == {0, 128}
    assert all(s["wq_once"] and s["accumulation"] == 1 for s in specs)
    # With micro-batches, the QAT presets also run with Wq built per micro-batch (the comparison rows).
    accumulated = step_bench.step_specs(step_bench.parse_args(["--devices", "cpu", "--quant", "w2g32",
                                                               "--accumulation-steps", "4"]))
    per_micro = sorted((s["linear"], s["preset"], s["chunk"]) for s in accumulated if not s["wq_once"])
    assert per_micro == sorted(k[1:] for k in keys if k[0] == "cpu" and k[2] != "recovery-lora")
    assert all(s["accumulation"] == 4 for s in accumulated)


@pytest.mark.parametrize("preset,weight_grad", [("recovery-lora", False), ("qat", True), ("qat+lora", True)])
def test_flops_count_weight_gradients_of_quantised_linears_only_when_the_quantiser_trains(step_bench, preset,
                                                                                         weight_grad):
    model = step_bench.build_model("tiny", 32, "w3g64", preset, torch.device("cpu"), lora_r=4)
    cfg = step_bench.SHAPES["tiny"]
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    quantised = n * (2 * h * h + 2 * h * kv + 3 * h * i)
    lora = n * 4 * (2 * h + 2 * (h + kv) + 2 * h + 3 * (h + i))  # r (in + out) per adapted linear, r = 4
    attention = 12 * n * h * 32  # n_heads x d_head = h, L = 32
    expected = ((6 if weight_grad else 4) * quantised + 4 * cfg["vocab_size"] * h  # tied lm_head: frozen
                + (6 * lora if "lora" in preset else 0) + attention)
    assert step_bench.step_flops_per_token(model, 32) == expected


def test_records_take_medians_over_rounds_and_ratios_within_each_round(step_bench):
    specs = step_bench.step_specs(step_bench.parse_args(["--devices", "cpu", "--presets", "recovery-lora", "qat"]))
    base = {(s["linear"], s["preset"], s["chunk"]): 1.0 + i for i, s in enumerate(specs)}
    slowdown = (1.0, 3.0, 1.5)  # the host's load changes between rounds; each round runs every configuration
    child = dict(precision="float32", flops_per_token=1e6, peak_mem_bytes=7, trainable_parameters=1, warmup_steps=1,
                 host_allocator_tuned=True)
    rounds = [{(s["device"], s["linear"], s["preset"], s["chunk"], s["wq_once"]):
               {**child, "step_s": base[s["linear"], s["preset"], s["chunk"]] * f} for s in specs} for f in slowdown]
    records = {(r["linear"], r["preset"], r["loss"]): r for r in step_bench.step_records(specs, rounds, {"cpu": 1e9})}
    assert len(records) == len(specs) == 6
    qat = records["w3g64", "qat", "chunked(128)"]
    assert qat["step_s_median"] == base["w3g64", "qat", 128] * 1.5 and qat["rounds"] == 3
    assert qat["tokens_per_s"] == pytest.approx(2 * 256 / qat["step_s_median"], abs=0.05)
    assert qat["mfu"] == pytest.approx(qat["tokens_per_s"] * 1e6 / 1e9, abs=1e-4)
    assert qat["step_s_vs_plain"] == round(base["w3g64", "qat", 128] / base["nn.Linear", "recovery-lora", 128], 3)
    assert qat["step_s_vs_naive"] == round(base["w3g64", "qat", 128] / base["w3g64", "qat", 0], 3)
    assert records["nn.Linear", "recovery-lora", "naive"]["step_s_vs_plain"] is None  # the reference itself


@pytest.mark.slow
def test_harness_writes_one_record_per_configuration(tmp_path):
    out = tmp_path / "step_bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_bench.py"), "--shape", "tiny", "--batch-size", "2",
           "--seq-len", "32", "--steps", "1", "--chunk", "16", "--devices", "cpu", "--presets", "qat+lora",
           "--losses", "chunked", "--accumulation-steps", "2", "--cache-tokens", "256", "--json", str(out)]
    # Figures are not checked here; one thread keeps the tiny run from spin-waiting on a busy host.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["loss_peak_mem_bytes"]) == {"naive", "chunked"} and "loss_peak_memory_ratio" in report
    records = report["records"]
    assert all(key in r for r in records for key in REQUIRED)
    assert [(r["kind"], r["quant"], r["preset"], r["loss"], r.get("wq_once_per_step")) for r in records] == [
        ("step", "w3g64", "qat+lora", "chunked(16)", True), ("step", "w3g64", "qat+lora", "chunked(16)", False),
        ("cache-build", "none", "teacher-forward", "none", None)]
    assert records[0]["accumulation_steps"] == 2 and records[0]["step_s_vs_wq_per_micro_batch"] > 0
    assert all(r["device"] == "cpu" and r["shape"] == "tiny" and r["seq_len"] == 32 for r in records)
    assert records[0]["tokens_per_s"] == pytest.approx(2 * 2 * 32 / records[0]["step_s_median"], rel=1e-3)
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["peak_mem_bytes"] >= 0 for r in records)
    chunked = records[0]
    assert chunked["step_s_vs_plain"] is None and chunked["step_s_vs_naive"] is None  # not asked for
    if sys.platform.startswith("linux") and not any(k.startswith(("MALLOC_", "GLIBC_TUNABLES")) for k in os.environ):
        assert chunked["host_allocator_tuned"] is True  # the trainer's allocator setting
    assert result.stdout.splitlines()[-1].startswith("cpu ")  # the summary table comes last
