"""build-cache keeps the device busy (issue 47, item 5): the next batch is launched before the last one's results
are fetched, on XLA one SPMD process builds on a host's chips by default (one teacher load, fingerprint and
tokenisation per host) and the persistent compile cache makes a second build compile nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qat_lora.cache.builder import build_cache
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.cache.reader import verify_cache

FLAGS = ("--seq-len", "32", "--encoding", "topk", "--top-k", "8", "--max-tokens", "1500", "--batch-size", "2",
         "--shard-sequences", "16")


def test_the_next_batch_is_launched_before_the_last_one_is_fetched(tmp_path, teacher_dir, corpus_dir,
                                                                    monkeypatch, cache_dir):
    from qat_lora.cache import builder
    from qat_lora.runtime import device as dev

    events: list[tuple[str, int]] = []
    started, submit = dev.to_host_soon, builder._ShardWriter.submit

    def recording(tensors):
        batch = sum(kind == "launch" for kind, _ in events)
        events.append(("launch", batch))
        fetch = started(tensors)
        return lambda: (events.append(("fetch", batch)), fetch())[1]

    monkeypatch.setattr(dev, "to_host_soon", recording)
    monkeypatch.setattr(builder._ShardWriter, "submit", lambda self, *a: (events.append(("shard", -1)),
                                                                          submit(self, *a))[1])
    out = tmp_path / "cache"
    build_cache(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(out), seq_len=32,
                                 encoding="topk", top_k=8, value_bits=32, max_tokens=6_000, batch_size=8,
                                 holdout_fraction=0.1, device="cpu"), log=lambda _: None)
    # Each shard's batches a..z: launch a, launch a+1, fetch a, launch a+2, fetch a+1, ..., fetch z; then the shard.
    expected: list[tuple[str, int]] = []
    shards = [[]]
    for kind, batch in events:
        if kind == "shard":
            shards.append([])
        elif kind == "launch":
            shards[-1].append(batch)
    for batches in shards[:-1]:
        for i, batch in enumerate(batches):
            expected.append(("launch", batch))
            if i:
                expected.append(("fetch", batches[i - 1]))
        expected += [("fetch", batches[-1]), ("shard", -1)]
    assert events == expected and len(shards[0]) >= 3, events
    # The same cache, byte for byte, as conftest's build of these settings.
    verify_cache(out)
    ours, theirs = sorted(out.glob("*.safetensors")), sorted(cache_dir.glob("*.safetensors"))
    assert [p.name for p in ours] == [p.name for p in theirs]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(ours, theirs))


def _build(args: list[str], devices: int, cache_home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "OMP_NUM_THREADS": "1",
           "XDG_CACHE_HOME": str(cache_home)}
    result = subprocess.run([sys.executable, "-m", "qat_lora", "build-cache", *args], env=env, capture_output=True,
                            text=True, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_on_xla_one_spmd_process_builds_and_the_second_build_compiles_nothing(tmp_path, teacher_dir, corpus_dir):
    from helpers_xla import require_torch_xla

    require_torch_xla()
    home = tmp_path / "home"
    base = ["--teacher", str(teacher_dir), "--data", str(corpus_dir), *FLAGS, "--device", "xla", "--num-chips", "2"]
    first = _build([*base, "--out", str(tmp_path / "a")], 2, home)
    assert "--parallel auto: one SPMD process over 2 XLA devices" in first.stdout + first.stderr
    assert "building on 2 local processes" not in first.stdout + first.stderr
    assert (home / "qat-lora" / "xla").is_dir() and any((home / "qat-lora" / "xla").iterdir())
    second = _build([*base, "--out", str(tmp_path / "b")], 2, home)
    xla = [json.loads((tmp_path / name / "manifest-r000.json").read_text())["xla"] for name in ("a", "b")]
    assert xla[0]["persistent_cache_misses"] >= 1 and xla[0]["cpu_fallback_ops"] == [], xla[0]
    # The second build found every graph on disk under the key the first wrote it with. A TPU loads them (hits,
    # nothing compiled); XLA:CPU's PJRT client cannot deserialize executables, so there they compile again.
    found = xla[1]["persistent_cache_hits"] + xla[1]["persistent_cache_unloadable"]
    assert xla[1]["persistent_cache_misses"] == 0 and found >= 1, xla[1]
    assert xla[1]["graphs_compiled"] == xla[1]["persistent_cache_unloadable"], xla[1]
    # One process, so one manifest of rank 0; the cache is the same as the first build's, shard for shard.
    for name in ("a", "b"):
        verify_cache(tmp_path / name)
    shards = [sorted((tmp_path / name).glob("*.safetensors")) for name in ("a", "b")]
    assert [p.read_bytes() for p in shards[0]] == [p.read_bytes() for p in shards[1]]
    assert second.returncode == 0
