"""Issue 14 on XLA:CPU: a multi-chip cache build with `--parallel processes` (one builder per device, merged by the
launcher; `--parallel auto` builds in one SPMD process instead, tests/test_cache_pipeline.py) and FSDP
parameter sharding over 4 devices (SPMD), each run in its own subprocess (DESIGN §6: the device count, SPMD mode
and compile counters are fixed per process).

torch_xla.launch does run a collective-free function on XLA:CPU (CPU_NUM_DEVICES=2: two replicas, ordinals 0
and 1), but as threads of one process: two builders loading the teacher at once race on transformers' lazy
imports (measured: ImportError) and share one set of counters. So on a CPU host `--num-chips N` starts N builder
processes instead: the same per-rank build and the same merge by the launcher as the TPU replicas.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers_xla import on_xla, require_torch_xla
from qat_lora.cache.reader import KDCache
from qat_lora.cache.builder import build_cache
from qat_lora.cache.config import CacheBuildConfig

require_torch_xla()

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, devices: int = 1, timeout: int = 500) -> subprocess.CompletedProcess:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "qat_lora", *args], env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _all_rows(cache: KDCache) -> dict[str, torch.Tensor]:
    rows = [cache.sequence(i, split) for split in ("train", "heldout") for i in range(cache.num_sequences(split))]
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_a_two_chip_xla_build_equals_the_one_process_build(tmp_path, teacher_dir, corpus_dir):
    flags = ("--teacher", str(teacher_dir), "--data", str(corpus_dir), "--seq-len", "32", "--encoding", "topk", "--top-k", "8",
             "--value-bits", "32", "--max-tokens", "1500", "--batch-size", "8", "--shard-sequences", "16")
    out = tmp_path / "two"
    result = _cli("build-cache", *flags, "--out", str(out), "--device", "xla", "--num-chips", "2",
                  "--parallel", "processes")
    assert "building on 2 local processes" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert {sh["rank"] for split in manifest["splits"].values() for sh in split["shards"]} == {0, 1}
    for rank in (0, 1):  # each builder ran its own XLA:CPU runtime: one graph, compiled once, no CPU fallback
        xla = json.loads((out / f"manifest-r{rank:03d}.json").read_text())["xla"]
        assert xla["graphs_compiled"] == 1 and xla["cpu_fallback_ops"] == [], xla
    one = tmp_path / "one"
    build_cache(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(one), seq_len=32,
                                 encoding="topk", top_k=8, value_bits=32, max_tokens=1500, batch_size=8, device="cpu"),
                log=lambda _: None)
    a, b = _all_rows(KDCache(out)), _all_rows(KDCache(one))
    assert torch.equal(a["input_ids"], b["input_ids"])  # every sequence once, in the same order
    torch.testing.assert_close(a["topk_logprobs"], b["topk_logprobs"], rtol=0, atol=1e-4)
    assert (a["topk_ids"] == b["topk_ids"]).float().mean() > 0.999  # only near-ties may swap
    # Rerunning with --resume is a successful no-op (a preemption loop may); --overwrite rebuilds it, the folder
    # cleared once, by the launcher, before any builder starts.
    again = _cli("build-cache", *flags, "--out", str(out), "--device", "xla", "--num-chips", "2", "--parallel",
                 "processes", "--resume")
    assert again.stdout.count("this build is already complete") == 2
    _cli("build-cache", *flags, "--out", str(out), "--device", "xla", "--num-chips", "2", "--parallel", "processes",
         "--overwrite")
    assert json.loads((out / "manifest.json").read_text())["splits"] == manifest["splits"]


SHARD = """
import json, sys
import torch, torch_xla
from qat_lora.train.config import StudentSpec
from qat_lora.runtime.distributed import SpmdBackend
from qat_lora.runtime.sharding import FsdpBackend, device_bytes, shard_shape
from qat_lora.train.student import build_student, make_trainable_, set_storage_dtype_
from qat_lora.quant.fake_quant import quantised_layers

fsdp = FsdpBackend()  # turns SPMD on, over the CPU_NUM_DEVICES devices
device = torch_xla.device()
report = {"devices": fsdp.data_parallel}
for storage in ("fp32", "bf16"):
    for name, backend in (("replicated", SpmdBackend()), ("fsdp", fsdp)):
        student = make_trainable_(build_student(StudentSpec(sys.argv[1], "w2g32"), "eager"), "recovery-lora")
        model = backend.shard_model_(set_storage_dtype_(student, storage).to(device))
        frozen = [p for p in model.parameters() if not p.requires_grad]
        report[f"{name}-{storage}"] = device_bytes(frozen)
        report[f"total-{storage}"] = sum(p.numel() * p.element_size() for p in frozen)
        report[f"trainable-{storage}"] = device_bytes([p for p in model.parameters() if p.requires_grad])
        if storage == "fp32":  # the cached Wq of each frozen layer, made by a forward: laid out like its weight
            model(input_ids=torch.tensor([[1, 2, 3, 4]] * 4, device=device))
            torch_xla.sync()
            cached = [m._cached_wq for m in quantised_layers(model).values()]
            report[f"wq-{name}"] = device_bytes(cached)
            report["wq-total"] = sum(t.numel() * t.element_size() for t in cached)
from qat_lora.quant.fake_quant import quantizer_parameters
quantizer = {id(p) for p in quantizer_parameters(model)}
report["frozen_numel"] = sum(p.numel() for p in model.parameters() if not p.requires_grad and id(p) not in quantizer)
# The spec arithmetic against the shards the runtime really holds (a transfer; test only).
shapes = [(list(shard_shape(p)), [list(s.shape) for s, _ in torch_xla._XLAC._get_local_shards([p])[0]])
          for p in [p for p in model.parameters() if not p.requires_grad][:8]]
report["shapes"] = shapes
print(json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_fsdp_keeps_a_quarter_of_the_parameter_bytes_per_device(teacher_dir):
    report = on_xla(SHARD, str(teacher_dir), devices=4, timeout=400)
    assert report["devices"] == 4
    for spec, shards in report["shapes"]:
        assert all(shape == spec for shape in shards), (spec, shards)  # every device holds a shard of that shape
    for storage in ("fp32", "bf16"):
        assert report[f"replicated-{storage}"] == report[f"total-{storage}"]
        # Every frozen tensor of the tiny model divides by 4 along some dimension: exactly a quarter.
        assert report[f"fsdp-{storage}"] * 4 == report[f"total-{storage}"], report
    # The frozen layers' cached Wq too (the bulk of a recovery-lora student's bytes under fp32 storage).
    assert report["wq-replicated"] == report["wq-total"] > 0 and report["wq-fsdp"] * 4 == report["wq-total"], report
    # LoRA stays replicated in fp32 (small); bf16 storage saves 2 bytes on every frozen weight but the
    # quantiser's (fp32: it defines the grid).
    assert report["trainable-fp32"] == report["trainable-bf16"] > 0
    assert report["total-fp32"] - report["total-bf16"] == 2 * report["frozen_numel"] > 0


def _train(out: Path, teacher_dir, cache, devices: int, *extra: str) -> tuple[list[dict], subprocess.CompletedProcess]:
    result = _cli("train", "--model", str(teacher_dir), "--cache", str(cache), "--quant", "w2g32", "--out", str(out),
                  "--max-steps", "6", "--log-steps", "1", "--lr", "1e-3", "--warmup-steps", "2", "--device", "xla",
                  "--attn-implementation", "eager", *extra, devices=devices)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], result


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_fsdp_over_four_devices_makes_the_single_device_update(tmp_path, teacher_dir, corpus_dir):
    from safetensors.torch import load_file

    cache = tmp_path / "cache"
    build_cache(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(cache), seq_len=32,
                                 encoding="topk", top_k=8, max_tokens=4_000, batch_size=8, device="cpu"), log=lambda _: None)
    one, _ = _train(tmp_path / "one", teacher_dir, cache, 1, "--batch-size", "4")
    fsdp, result = _train(tmp_path / "fsdp", teacher_dir, cache, 4, "--batch-size", "1", "--num-chips", "4",
                          "--parallel", "fsdp")
    assert "XLA SPMD (fsdp), batch and parameters sharded over 4 devices; parameters" in result.stdout
    report = json.loads((tmp_path / "fsdp" / "compile_report.json").read_text())
    assert 1 <= report["graphs_compiled"] <= 3 and report["graphs_compiled_after_step_2"] == 0, report
    # The same 4 sequences per step: the same losses and the same adapters, up to float summation order.
    for a, b in zip(one, fsdp, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    a, b = (load_file(str(tmp_path / run / "adapter" / "adapter_model.safetensors")) for run in ("one", "fsdp"))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)
    # The mode for students larger than a chip: fsdp with the frozen student stored in bf16. Still a fixed set of
    # graphs; its losses follow the fp32 run's within bf16 rounding (Wq, weights and residual stream in bf16).
    bf16, result = _train(tmp_path / "bf16", teacher_dir, cache, 4, "--batch-size", "1", "--num-chips", "4",
                          "--parallel", "fsdp", "--storage-dtype", "bf16")
    report = json.loads((tmp_path / "bf16" / "compile_report.json").read_text())
    assert 1 <= report["graphs_compiled"] <= 3 and report["graphs_compiled_after_step_2"] == 0, report
    for a, b in zip(one, bf16, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=0.03)


TIED = """
import json
import torch, torch_xla
from transformers import AutoModelForCausalLM, LlamaConfig
from qat_lora.runtime.distributed import Backend
from qat_lora.runtime.sharding import FsdpBackend, device_bytes

def tied_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)).requires_grad_(False)

fsdp = FsdpBackend()  # SPMD on before any tensor reaches the device (the plain move then replicates)
device = torch_xla.device()
ids = torch.tensor([[1, 7, 42, 3]])
expected = tied_model()(input_ids=ids).logits
report = {}
for name, backend in (("replicated", Backend()), ("fsdp", fsdp)):
    model = tied_model()
    model = backend.shard_model_(model, device)
    params = list(model.parameters())
    report[name] = {"tied": model.lm_head.weight is model.model.embed_tokens.weight,
                    "held": device_bytes(params), "total": sum(p.numel() * p.element_size() for p in params),
                    "max_logit_diff": float((model(input_ids=ids.to(device)).logits.cpu() - expected).abs().max())}
print(json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_a_tied_head_stays_one_tensor_on_the_device():
    # model.to(xla) makes a new Parameter per module that holds a tied one: the head would be a second copy.
    report = on_xla(TIED, devices=4, timeout=400)
    for name, row in report.items():
        assert row["tied"] and row["max_logit_diff"] < 1e-5, (name, row)
    assert report["replicated"]["held"] == report["replicated"]["total"]
    assert report["fsdp"]["held"] * 4 == report["fsdp"]["total"] == report["replicated"]["total"], report


EVAL = """
import contextlib, json, sys
import torch, torch_xla
from qat_lora.cache.reader import KDCache
from qat_lora.runtime import device as dev, xla
from qat_lora.runtime.distributed import SpmdBackend
from qat_lora.train import metrics
from qat_lora.train.config import StudentSpec
from qat_lora.train.student import build_student

backend = SpmdBackend()  # SPMD over the 2 devices
device = torch_xla.device()
cache = KDCache(sys.argv[2])
model = build_student(StudentSpec(sys.argv[1], "w2g32"), "eager").to(device).eval()
layouts, place = [], dev.device_batches

@contextlib.contextmanager
def recorded(batches, device, sharding=None):  # each placed batch's layout, as the metrics loop receives it
    def each(placed):
        for batch in placed:
            layouts.append(xla.sharding_spec(batch["input_ids"]))
            yield batch
    with place(batches, device, sharding) as placed:
        yield each(placed)

dev.device_batches = recorded
dims = {k: v.dim() + 1 for k, v in cache.sequence(0).items()}
sharded = metrics.kd_metrics(model, cache, 4, device, sharding=backend.input_sharding(dims))
whole = metrics.kd_metrics(model, cache, 4, device)
print(json.dumps({"sharded": sharded, "whole": whole, "layouts": layouts}))
"""


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_heldout_eval_under_spmd_splits_each_batch_over_the_devices(teacher_dir, cache_dir):
    report = on_xla(EVAL, str(teacher_dir), str(cache_dir), devices=2, timeout=400)
    half = len(report["layouts"]) // 2
    # The sharded pass placed every batch split over the 2 devices (the whole pass: replicated), same sums.
    assert half and all("devices=[2" in spec for spec in report["layouts"][:half]), report["layouts"]
    assert not any("devices=[2" in spec for spec in report["layouts"][half:]), report["layouts"]
    for key in ("kd_soft_ce", "kd_kl", "kd_ce"):
        assert report["sharded"][key] == pytest.approx(report["whole"][key], rel=1e-5), key
    assert report["sharded"]["kd_tokens"] == report["whole"]["kd_tokens"]
