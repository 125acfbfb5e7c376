"""Training across hosts with torchrun's own multi-node launch (issue 29): two "nodes" on localhost, each a
`torchrun --nnodes 2 --node-rank R` of one gloo rank, make the same adapters as one process with the global
batch; the cache is split by global rank; only global rank 0 writes; a SIGTERM to one node stops every rank at
the same step with a checkpoint that resumes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from qat_lora.train import checkpoint as ckpt
from qat_lora.cache.reader import KDCache, batch_order
from qat_lora.train.config import TrainConfig
from qat_lora.runtime.launch import free_port
from qat_lora.train.trainer import train
from tests.test_trainer import _full_rows_seed


def _flags(teacher_dir, cache_dir, out, *extra) -> list[str]:
    return ["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--quant", "w2g32", "--out", str(out),
            "--batch-size", "2", "--lr", "3e-3", "--lora-r", "4", "--warmup-steps", "2", "--log-steps", "1",
            "--device", "cpu", "--dist-timeout-s", "120", *extra]


def _nodes(flags: list[str], nodes: int = 2) -> list[subprocess.Popen]:
    """`nodes` torchrun agents on this host as if on `nodes` hosts: static rendezvous at node 0's address."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank",
                              str(r), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                              str(port), "-m", "qat_lora", *flags], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in range(nodes)]


def _wait(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str]]:
    return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_make_the_same_adapters_as_one_process_with_the_global_batch(teacher_dir, cache_dir, tmp_path):
    seed = _full_rows_seed(cache_dir, 12)
    single = tmp_path / "single"
    train(TrainConfig(model=str(teacher_dir), cache=str(cache_dir), quant="w2g32", out=str(single), max_steps=3,
                      batch_size=4, lr=3e-3, lora_r=4, warmup_steps=2, log_steps=1, device="cpu", seed=seed),
          log=lambda _: None)
    multi = tmp_path / "multi"
    results = _wait(_nodes(_flags(teacher_dir, cache_dir, multi, "--max-steps", "3", "--seed", str(seed))))
    assert [code for code, _ in results] == [0, 0], results
    summary = json.loads((multi / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens"] == 3 * 2 * 2 * 32  # steps x ranks x batch x L
    a = load_file(str(single / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(multi / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-6)
    records = [json.loads(line) for line in (multi / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]  # one writer: global rank 0
    assert "student" in results[0][1] and "student" not in results[1][1]  # only node 0's rank logs


def test_the_ranks_read_disjoint_rows_by_global_rank(cache_dir):
    # What a rank of W reads (cache/reader.endless_batches: order[rank::world_size]) covers the epoch once.
    cache = KDCache(cache_dir)
    order = batch_order(cache.num_sequences("train"), seed=3, epoch=0).tolist()
    shares = [order[rank::4] for rank in range(4)]
    assert sorted(sum(shares, [])) == sorted(order) and all(set(a).isdisjoint(b) for a in shares for b in shares
                                                            if a is not b)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_one_node_stops_every_rank_at_one_step_and_resumes(teacher_dir, cache_dir, tmp_path):
    run = tmp_path / "run"
    flags = _flags(teacher_dir, cache_dir, run, "--max-steps", "400", "--save-steps", "100", "--resume", "auto")
    procs = _nodes(flags)
    deadline = time.monotonic() + 240
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 3):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the run did not start"
        time.sleep(0.05)
    os.kill(procs[1].pid, signal.SIGTERM)  # the second host's agent only, as a preempted VM would get
    results = _wait(procs)
    saved = ckpt.list_checkpoints(run)
    assert saved and not (run / "summary.json").exists(), results
    stopped_at = ckpt.step_of(saved[-1])
    assert 3 <= stopped_at < 400
    node0 = results[0][1]
    assert f"stopped by SIGTERM after step {stopped_at}" in node0, results  # rank 0 stopped at the same step
    assert all(code != 0 for code, _ in results), results  # an unfinished run never exits 0
    state = json.loads((saved[-1] / ckpt.STATE_FILE).read_text())
    assert state["world_size"] == 2 and set(k.split(".")[0] for k in load_file(str(saved[-1] / ckpt.RNG_FILE))) == {
        "rank0", "rank1"}
    # The same two commands continue from that checkpoint to the end.
    results = _wait(_nodes(flags))
    assert [code for code, _ in results] == [0, 0], results
    assert f"resumed from {saved[-1]}" in results[0][1]
    assert json.loads((run / "summary.json").read_text())["steps"] == 400
