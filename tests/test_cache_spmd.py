"""Issue 29: `build-cache --parallel fsdp` on XLA:CPU devices: one SPMD process, the teacher's weights split over
the devices (each holds ~1/N, read from the devices' own buffers), the batch split with them, and the cache equal
to a one-device build. Each build runs in its own subprocess (DESIGN §6: device count and SPMD mode are fixed
per process)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers_xla import require_torch_xla
from qat_lora.cache.reader import KDCache
from qat_lora.cache.encodings import DELTA_STEP

require_torch_xla()

BATCH = 2  # rows per device
FLAGS = ("--seq-len", "32", "--encoding", "topk", "--top-k", "8", "--value-bits", "16", "--max-tokens", "1500", "--batch-size", str(BATCH),
         "--shard-sequences", "16", "--device", "xla")

MEASURED_BUILD = """
import json, sys
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.cache.builder import build_cache
from qat_lora.runtime.launch import spmd_backend
from qat_lora.runtime.sharding import held_bytes

teacher, data, out, devices = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
backend = spmd_backend(devices, fsdp=True)
measured, shard = {}, backend.shard_model_

def shard_and_measure(model, device=None):  # what the build's teacher holds, per device, once laid out
    shard(model, device)
    params = list(model.parameters())
    measured.update(held=held_bytes(params), total=sum(p.numel() * p.element_size() for p in params))
    return model

backend.shard_model_ = shard_and_measure
build_cache(CacheBuildConfig(teacher=teacher, data=[data], out=out, seq_len=32, encoding="topk", top_k=8, value_bits=16,
                             max_tokens=1500, batch_size=%d, shard_sequences=16, device="xla", num_chips=devices,
                             parallel="fsdp"), log=lambda _: None, backend=backend)
print("MEASURED " + json.dumps(measured))
""" % BATCH


def _run(args: list[str], devices: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=500)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _rows(path: Path) -> dict[str, torch.Tensor]:
    cache = KDCache(path)
    rows = [cache.sequence(i, split) for split in ("train", "heldout") for i in range(cache.num_sequences(split))]
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _batches(out: Path, per_forward: int) -> int:
    """Teacher forwards the build ran: each shard's rows in fixed batches of `per_forward`."""
    manifest = json.loads((out / "manifest.json").read_text())
    return sum(math.ceil(len(range(*shard["rows"])) / per_forward)
               for split in manifest["splits"].values() for shard in split["shards"])


def _assert_same_cache(a: Path, b: Path) -> None:
    x, y = _rows(a), _rows(b)
    assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["attention_mask"], y["attention_mask"])
    assert torch.equal(x["topk_ids"], y["topk_ids"])  # bit-exact ids
    # Values are stored as 16-bit steps below each row's fp32 anchor: a sum over 8 shards may round one value to
    # the neighbouring step, and the anchor itself moves by fp32 noise, so one step plus that noise.
    torch.testing.assert_close(x["topk_logprobs"], y["topk_logprobs"], rtol=0, atol=DELTA_STEP[16] + 1e-5)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, teacher_dir, corpus_dir) -> Path:
    out = tmp_path_factory.mktemp("one") / "cache"
    _run(["-m", "qat_lora", "build-cache", "--teacher", str(teacher_dir), "--data", str(corpus_dir),
          "--out", str(out), *FLAGS, "--num-chips", "1"])
    return out


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.parametrize("devices", [4, 8])
def test_an_fsdp_build_splits_the_teacher_and_equals_a_one_device_build(devices, one_device, teacher_dir,
                                                                        corpus_dir, tmp_path):
    out = tmp_path / "fsdp"
    result = _run(["-c", MEASURED_BUILD, str(teacher_dir), str(corpus_dir), str(out), str(devices)], devices)
    measured = json.loads(result.stdout.split("MEASURED ", 1)[1])
    assert len(measured["held"]) == devices  # every device holds a part, read from its own buffers
    assert max(measured["held"].values()) <= 1.1 * measured["total"] / devices, measured
    _assert_same_cache(out, one_device)
    xla = json.loads((out / "manifest-r000.json").read_text())["xla"]
    assert xla["graphs_compiled"] <= 2 and xla["cpu_fallback_ops"] == [], xla
    assert xla["graph_executions"] == _batches(out, BATCH * devices), xla  # one run per batch, no gather program
    assert xla["transfers_from_device"] == _batches(out, BATCH * devices), xla


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_the_cli_fsdp_build_resumes_after_its_last_recorded_shard(one_device, teacher_dir, corpus_dir, tmp_path):
    out = tmp_path / "fsdp"
    cmd = ["-m", "qat_lora", "build-cache", "--teacher", str(teacher_dir), "--data", str(corpus_dir),
           "--out", str(out), *FLAGS, "--num-chips", "4", "--parallel", "fsdp"]
    result = _run(cmd, 4)
    assert "XLA SPMD (fsdp)" in result.stdout and "per device" in result.stdout
    _assert_same_cache(out, one_device)
    # As a preempted build leaves it: the last shard unrecorded, no manifest; --resume writes only that shard.
    progress = json.loads((out / "progress-r000.json").read_text())
    last = progress["shards"]["train"].pop()
    (out / last["file"]).unlink()
    (out / "progress-r000.json").write_text(json.dumps(progress))
    for name in ("manifest.json", "manifest-r000.json"):
        (out / name).unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    _run(cmd + ["--resume"], 4)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors") if p.name in kept} == kept
    assert (out / last["file"]).exists()
    _assert_same_cache(out, one_device)


@pytest.mark.slow
@pytest.mark.xla
def test_fsdp_without_xla_is_one_line(teacher_dir, corpus_dir, tmp_path):
    result = _run(["-m", "qat_lora", "build-cache", "--teacher", str(teacher_dir), "--data", str(corpus_dir),
                   "--out", str(tmp_path / "c"), "--device", "cpu", "--parallel", "fsdp"], check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "--parallel fsdp with --device cpu: SPMD needs --device xla or tpu" in result.stderr


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_a_sampled_fsdp_build_draws_what_one_device_draws(teacher_dir, corpus_dir, tmp_path):
    # Sampled targets are drawn on the host from the logits: under SPMD those come from each device's own shard
    # (device.to_host), never gathered whole on one device, and give the same draws.
    flags = ["--seq-len", "32", "--encoding", "sampled", "--num-samples", "16", "--max-tokens", "1500",
             "--batch-size", str(BATCH), "--shard-sequences", "16", "--device", "xla"]
    base = ["-m", "qat_lora", "build-cache", "--teacher", str(teacher_dir), "--data", str(corpus_dir), *flags]
    _run(base + ["--out", str(tmp_path / "one"), "--num-chips", "1"])
    _run(base + ["--out", str(tmp_path / "fsdp"), "--num-chips", "4", "--parallel", "fsdp"], 4)
    a, b = _rows(tmp_path / "one"), _rows(tmp_path / "fsdp")
    assert torch.equal(a["sample_ids"], b["sample_ids"]) and torch.equal(a["sample_weights"], b["sample_weights"])
    xla = json.loads((tmp_path / "fsdp" / "manifest-r000.json").read_text())["xla"]
    assert xla["graphs_compiled"] <= 2 and xla["graph_executions"] == _batches(tmp_path / "fsdp", BATCH * 4), xla
