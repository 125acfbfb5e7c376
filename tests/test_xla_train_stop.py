"""Stopping a multi-rank run (issue 14): ranks agree on a stop at fixed steps (every --log-steps / --save-steps),
before any save collective, so a SIGTERM that reaches one rank only never deadlocks; the agreement costs one
collective and one host read at those steps and nothing in the steps between. Tested through gloo ranks of the
same trainer code (DESIGN §6: XLA:CPU replicas cannot run collectives); plus evaluation under training's
autocast with exact sums, and the checks of the new flags."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qat_lora.train import checkpoint as ckpt
from qat_lora.cache.reader import KDCache
from qat_lora.commands.config import EvalConfig
from qat_lora.train.config import StudentSpec, TrainConfig
from qat_lora.commands.evaluate import evaluate
from qat_lora.runtime.launch import free_port
from qat_lora.train.metrics import kd_metrics
from qat_lora.train.student import load_student
from qat_lora.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]

# One rank of `qat-lora train`, counting the backend's flag agreements and every all-reduce it runs.
COUNTED_RANK = """
import atexit, json, sys
import torch.distributed as dist
from qat_lora.runtime import distributed
calls = {"agree": 0, "all_reduce": 0}
agree, all_reduce = distributed.TorchDistributedBackend.agree, dist.all_reduce
def counted_agree(self, *args):
    calls["agree"] += 1
    return agree(self, *args)
def counted_all_reduce(*args, **kwargs):
    calls["all_reduce"] += 1
    return all_reduce(*args, **kwargs)
distributed.TorchDistributedBackend.agree, dist.all_reduce = counted_agree, counted_all_reduce
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(calls)))
from qat_lora.commands.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _train_flags(teacher_dir, cache_dir, out, *extra: str) -> list[str]:
    return ["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--quant", "w2g32", "--out", str(out),
            "--batch-size", "2", "--lr", "3e-3", "--lora-r", "4", "--warmup-steps", "2", "--device", "cpu",
            "--max-steps", "150", "--log-steps", "4", "--num-chips", "2", *extra]


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_sigterm_to_one_gloo_rank_stops_both_at_the_same_step_then_resumes(teacher_dir, cache_dir, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    counts = [tmp_path / f"calls{r}.json" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-c", COUNTED_RANK, str(counts[r]),
                               *_train_flags(teacher_dir, cache_dir, run)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), ranks[0].stderr.read()[-2000:]
        time.sleep(0.05)
    ranks[1].send_signal(signal.SIGTERM)  # the non-master only: the master must learn of it, not hang
    outputs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [143, 143], [err[-2000:] for _, err in outputs]
    [saved] = ckpt.list_checkpoints(run)
    step = ckpt.step_of(saved)
    assert 0 < step < 150 and step % 4 == 0  # an agreement step
    assert f"stopped by SIGTERM after step {step}" in outputs[0][0]
    calls = [json.loads(c.read_text()) for c in counts]
    # Both ranks ran exactly `step` steps: one agreement after the first step and one per 4 steps, and besides
    # them one all-reduce per step (the gradients): no per-step flag reduction or host read.
    for made in calls:
        assert made == {"agree": 1 + step // 4, "all_reduce": step + 1 + step // 4}, calls
    _, state = ckpt.load_checkpoint(saved)
    assert state["step"] == step and state["world_size"] == 2
    resumed = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_recovery_lora_multi.py"),
                              *_train_flags(teacher_dir, cache_dir, run, "--resume", "auto")[1:]],
                             capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {saved}" in resumed.stdout + resumed.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 150 and summary["steps_this_process"] == 150 - step


def _cfg(teacher_dir, cache_dir, out, **kw) -> TrainConfig:
    base = dict(model=str(teacher_dir), cache=str(cache_dir), quant="w2g32", out=str(out), max_steps=2,
                batch_size=4, lr=3e-3, lora_r=4, warmup_steps=1, log_steps=1, device="cpu")
    return TrainConfig(**{**base, **kw})


@pytest.mark.xla
def test_evaluation_runs_under_the_training_autocast(teacher_dir, cache_dir, tmp_path):
    run = tmp_path / "run"
    # fp32 storage: the reference below is a student loaded as eval loads it (bf16 storage, the default under
    # bf16, would round the embeddings and norms too: a second difference)
    train(_cfg(teacher_dir, cache_dir, run, precision="bf16", eval_steps=2, storage_dtype="fp32"), log=lambda _: None)
    [record] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    # --loss-chunk-size auto is recorded as the size that ran (runs from before auto existed resume unchanged).
    assert json.loads((run / "config.json").read_text())["loss_chunk_size"] == 128
    student = load_student(StudentSpec(str(teacher_dir), "w2g32"), str(run / "best" / "adapter")).eval()
    cache, cpu = KDCache(cache_dir), torch.device("cpu")
    bf16 = kd_metrics(student, cache, 4, cpu, amp_dtype=torch.bfloat16)
    fp32 = kd_metrics(student, cache, 4, cpu)
    assert abs(bf16["kd_soft_ce"] - fp32["kd_soft_ce"]) > 1e-4  # autocast really changes the values
    assert record["kd_soft_ce"] == pytest.approx(bf16["kd_soft_ce"], rel=1e-6)
    standalone = evaluate(EvalConfig(model=str(teacher_dir), quant="w2g32", adapter=str(run / "best" / "adapter"),
                                     cache=str(cache_dir), precision="bf16", device="cpu"), log=lambda _: None)
    assert standalone["kd_soft_ce"] == pytest.approx(bf16["kd_soft_ce"], rel=1e-6)


@pytest.mark.xla
def test_evaluation_sums_stay_exact_past_the_float32_integer_range(teacher_dir, cache_dir, monkeypatch):
    # Counts per batch are exact in fp32; their total (past 2^24) is not: the sums must be taken in float64 on the
    # host (a float64 accumulator on the device would be fp32 on a TPU).
    from qat_lora.train import metrics

    per_batch = 3_000_001.0

    def fake_forward_loss(model, batch, cfg, chunk_size):
        one = torch.tensor(per_batch)
        return {k: one for k in ("soft_ce_sum", "kl_sum", "top1_sum", "ce_sum", "kd_tokens", "ce_tokens")}

    monkeypatch.setattr(metrics, "forward_loss", fake_forward_loss)
    cache = KDCache(cache_dir)
    batches = cache.num_sequences("heldout")  # batch size 1: one batch per held-out sequence
    assert per_batch * batches > 2**25  # where fp32 spacing is 4: an odd total cannot be held
    result = kd_metrics(torch.nn.Identity(), cache, 1, torch.device("cpu"))
    assert result["kd_tokens"] == int(per_batch) * batches
    running = torch.zeros((), dtype=torch.float32)  # what an fp32 (a TPU's "float64") accumulator would report
    for _ in range(batches):
        running += per_batch
    assert running.item() != per_batch * batches


@pytest.mark.xla
def test_the_new_flags_refuse_bad_values_in_one_line(teacher_dir, cache_dir, tmp_path):
    from qat_lora.runtime.precision import default_loss_chunk_size

    with pytest.raises(ValueError, match=r"^--matmul-precision 'fast': choose one of default, high, highest$"):
        _cfg(teacher_dir, cache_dir, tmp_path, matmul_precision="fast")
    with pytest.raises(ValueError, match=r"^--loss-chunk-size -2: must be -1 \(auto\)"):
        _cfg(teacher_dir, cache_dir, tmp_path, loss_chunk_size=-2)
    with pytest.raises(ValueError, match=r"^--precision 'fp16': choose one of auto, fp32, bf16$"):
        EvalConfig(model=str(teacher_dir), cache=str(cache_dir), precision="fp16")
    # auto: short chunks where they measured fastest (CPU), few unrolled chunks where the loop is compiled.
    assert default_loss_chunk_size(torch.device("cpu")) == 128
    assert default_loss_chunk_size(torch.device("xla")) == default_loss_chunk_size(torch.device("cuda")) == 1024
