"""The XLA paths of the cache builder, the LUT quantiser and checkpoints on XLA:CPU, held to torch_xla's debug
metrics: graph compiles and executions, device-to-host transfers, ops that fell back to the CPU (issue 14).

Each scenario runs in its own subprocess (DESIGN §6: the counters are process-wide) and prints its measures as
one JSON line; the metrics are cleared before each measured call.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers_xla import on_xla, require_torch_xla
from qat_lora.cache.reader import KDCache
from qat_lora.cache.builder import build_cache
from qat_lora.cache.config import CacheBuildConfig

require_torch_xla()


BUILD = """
import json, sys
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from qat_lora.runtime import xla
from qat_lora.cache.builder import build_cache
from qat_lora.cache.config import CacheBuildConfig

teacher, corpus, out = sys.argv[1:4]
cases = {"short": dict(max_tokens=1000, encoding="topk"), "long": dict(max_tokens=2500, encoding="topk"),
         "sampled": dict(max_tokens=1000, encoding="sampled", num_samples=20),
         "bf16": dict(max_tokens=1000, encoding="topk", dtype="bf16", matmul_precision="highest")}
report = {}
for name, kwargs in cases.items():
    met.clear_all()
    build_cache(CacheBuildConfig(teacher=teacher, data=[corpus], out=f"{out}/{name}", seq_len=32, top_k=8,
                                 value_bits=32, batch_size=8, device="xla", **kwargs), log=lambda _: None)
    xm.wait_device_ops()  # every execution counted
    report[name] = xla.compile_metrics()
print(json.dumps(report))
"""


def _batches(cache: KDCache, batch_size: int) -> tuple[int, bool]:
    """Teacher batches a build ran (each shard in batches, the last one short), and whether any was short."""
    sizes = [len(range(*shard["rows"])) for info in cache.manifest["splits"].values() for shard in info["shards"]]
    return sum(math.ceil(n / batch_size) for n in sizes), any(n % batch_size for n in sizes)


def _rows(cache: KDCache) -> dict[str, torch.Tensor]:
    parts = [b for split in ("train", "heldout") for b in cache.batches(split, 4, shuffle=False, drop_last=False)]
    return {k: torch.cat([b[k] for b in parts]) for k in parts[0]}


@pytest.fixture(scope="module")
def xla_builds(tmp_path_factory, teacher_dir, corpus_dir):
    out = tmp_path_factory.mktemp("xla-builds")
    return out, on_xla(BUILD, str(teacher_dir), str(corpus_dir), str(out), timeout=400)


@pytest.mark.slow
@pytest.mark.xla
def test_cache_build_on_xla_runs_one_graph_per_batch_and_compiles_once(xla_builds):
    out, report = xla_builds
    short, long = KDCache(out / "short"), KDCache(out / "long")
    batches, has_short_batch = _batches(short, 8)
    assert has_short_batch  # the case that used to compile a second graph
    # Forward + log-softmax + top-K is one graph for every batch, the short ones padded to its shape; its
    # results come back in one transfer that runs it once.
    assert report["short"]["graphs_compiled"] == 1, report["short"]
    assert report["short"]["graph_executions"] == batches == report["short"]["transfers_from_device"]
    assert report["short"]["cpu_fallback_ops"] == []
    # More batches, the graph already compiled: nothing compiles, still one execution per batch.
    long_batches, _ = _batches(long, 8)
    assert long_batches > batches
    assert report["long"]["graphs_compiled"] == 0, report["long"]
    assert report["long"]["graph_executions"] == long_batches


@pytest.mark.slow
@pytest.mark.xla
def test_xla_cache_equals_the_cpu_cache(tmp_path, xla_builds, teacher_dir, corpus_dir):
    out, _ = xla_builds
    cpu = tmp_path / "cpu"
    build_cache(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(cpu), seq_len=32, encoding="topk", top_k=8,
                                 value_bits=32, max_tokens=1000, batch_size=8, device="cpu"), log=lambda _: None)
    a, b = _rows(KDCache(out / "short")), _rows(KDCache(cpu))
    torch.testing.assert_close(a["topk_logprobs"], b["topk_logprobs"], rtol=0, atol=1e-4)
    assert (a["topk_ids"] == b["topk_ids"]).float().mean() > 0.999  # only near-ties may swap


@pytest.mark.slow
@pytest.mark.xla
def test_sampled_cache_builds_on_xla_with_the_cpu_draws(tmp_path, xla_builds, teacher_dir, corpus_dir):
    # The draws happen on the device (inverse CDF without searchsorted, which XLA lacks) from the per-row CPU
    # generators' uniforms: one graph, compiled once, no CPU fallback, and only the ids come back, in one transfer
    # per batch. So the draws are the CPU build's (up to float rounding of the logits).
    out, report = xla_builds
    xla = KDCache(out / "sampled")
    assert report["sampled"]["graph_executions"] == _batches(xla, 8)[0] == report["sampled"]["transfers_from_device"]
    assert report["sampled"]["graphs_compiled"] == 1 and report["sampled"]["cpu_fallback_ops"] == [], report["sampled"]
    cpu = tmp_path / "cpu"
    build_cache(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(cpu), seq_len=32,
                                 encoding="sampled", num_samples=20, max_tokens=1000, batch_size=8, device="cpu"),
                log=lambda _: None)
    a, b = _rows(xla), _rows(KDCache(cpu))
    same = ((a["sample_ids"] == b["sample_ids"]) & (a["sample_weights"] == b["sample_weights"])).all(-1)
    assert same.float().mean() > 0.99


@pytest.mark.slow
@pytest.mark.xla
def test_bf16_teacher_and_matmul_precision_are_recorded(xla_builds):
    out, report = xla_builds
    cache = KDCache(out / "bf16")
    assert cache.manifest["teacher_dtype"] == "bf16" and cache.manifest["matmul_precision"] == "highest"
    assert report["bf16"]["graph_executions"] == _batches(cache, 8)[0]
    # The teacher's identity is that of its stored weights, whatever dtype it ran in.
    assert cache.manifest["teacher"] == KDCache(out / "short").manifest["teacher"]
    assert np.isfinite(_rows(cache)["topk_logprobs"].numpy()).all()


TRAIN = """
import json, sys
import torch_xla.debug.metrics as met
from qat_lora.train.config import TrainConfig
from qat_lora.train.trainer import train

teacher, cache, out = sys.argv[1:4]
report = {}
for quant in ("w2g32", "lut2g32"):
    for preset in ("recovery-lora", "qat+lora"):  # the quantiser frozen, then trained
        met.clear_all()
        summary = train(TrainConfig(model=teacher, cache=cache, quant=quant, preset=preset, out=f"{out}/{quant}-{preset}",
                                    max_steps=3, batch_size=2, warmup_steps=1, save_steps=2, device="xla",
                                    attn_implementation="eager"), log=lambda _: None)
        report[f"{quant} {preset}"] = summary["compile"]
print(json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.xla
def test_training_int_and_lut_presets_on_xla_falls_back_to_the_cpu_for_nothing(tmp_path, teacher_dir, cache_dir):
    # searchsorted (the LUT lookup) and float() of each logged value used to run as CPU fallbacks.
    report = on_xla(TRAIN, str(teacher_dir), str(cache_dir), str(tmp_path), timeout=400)
    for case, compile_report in report.items():
        assert compile_report["cpu_fallback_ops"] == [], case
        assert compile_report["graphs_compiled_after_step_2"] == 0, case


SAVE = """
import json, sys
from pathlib import Path
import torch, torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from qat_lora.train import checkpoint as ckpt
from qat_lora.runtime import device as dev
from qat_lora.runtime import xla

out, device, report = Path(sys.argv[1]), torch_xla.device(), {}
for layers in (2, 20):
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8, device=device)).sum().backward()
    optimizer.step()
    torch_xla.sync()
    xm.wait_device_ops()  # the step's graph ran and was counted: what follows is the save alone
    met.clear_all()
    opt_tensors, meta = ckpt.optimizer_to_flat(optimizer)
    groups = {ckpt.TRAINABLE_FILE: dict(model.named_parameters()), ckpt.OPTIMIZER_FILE: opt_tensors,
              ckpt.RNG_FILE: ckpt.rng_state(device)}
    path = ckpt.save_checkpoint(out, layers, groups, {"optimizer": meta})
    report[layers] = {**xla.compile_metrics(), "tensors": sum(len(g) for g in groups.values())}
    saved, _ = ckpt.load_checkpoint(path)
    report[layers]["equal"] = all(torch.equal(saved[ckpt.TRAINABLE_FILE][k], v.cpu())
                                  for k, v in model.named_parameters())
    met.clear_all()
    host = dev.state_dict_to_cpu(model.state_dict())  # the adapter and quantiser files' path to the host
    report[layers]["state_dict_transfers"] = xla.compile_metrics()["transfers_from_device"]
print(json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.xla
def test_a_checkpoint_leaves_the_device_in_one_transfer(tmp_path):
    report = on_xla(SAVE, str(tmp_path), timeout=400)
    small, large = report["2"], report["20"]
    assert large["tensors"] > 5 * small["tensors"]
    for measured in (small, large):
        assert measured["equal"]
        assert measured["transfers_from_device"] == 1, measured  # was one per tensor
        assert measured["graph_executions"] == 0 and measured["cpu_fallback_ops"] == []
        assert measured["state_dict_transfers"] == 1
