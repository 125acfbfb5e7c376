"""Multi-process training: a rank that hangs or dies makes every rank exit within --dist-timeout-s + the
launcher's grace, the launcher names the rank that failed (not a healthy one whose collective timed out
waiting for it), and the exit code tells a preemption loop the truth (143 only for a real stop signal).

Real gloo ranks of `qat-lora train --num-chips 2` on a tiny model; the fault is a signal sent to rank 1."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qat_lora.commands.cli import main
from qat_lora.runtime.launch import RankExits

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 20  # --dist-timeout-s: how long a healthy rank waits in a collective (set-up included: 2 busy cores)
GRACE_S = 10  # launch_local's grace between SIGTERM and SIGKILL


def _rank_pid(launcher: subprocess.Popen, rank: int, deadline_s: float = 120) -> int:
    """The pid of the launcher's child whose environment says RANK=`rank`."""
    stop = time.monotonic() + deadline_s
    while time.monotonic() < stop:
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        for pid in children:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never started")


def _wait_for(path: Path, launcher: subprocess.Popen, deadline_s: float = 240) -> None:
    stop = time.monotonic() + deadline_s
    while not (path.exists() and path.read_text().strip()):
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < stop, f"{path} never written"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("fault, message", [
    (signal.SIGSTOP, "rank 1 stopped responding (the others gave up waiting for it after --dist-timeout-s)"),
    (signal.SIGKILL, "rank 1 was killed by SIGKILL"),
])
def test_a_rank_that_hangs_or_dies_is_named_and_every_rank_ends(fault, message, teacher_dir, cache_dir, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "qat_lora", "train", "--num-chips", "2", "--device", "cpu", "--model",
           str(teacher_dir), "--cache", str(cache_dir), "--quant", "w2g32", "--out", str(run), "--max-steps", "100000",
           "--batch-size", "2", "--lora-r", "4", "--log-steps", "1", "--save-steps", "0",
           "--dist-timeout-s", str(TIMEOUT_S)]
    launcher = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        victim = _rank_pid(launcher, 1)
        _wait_for(run / "metrics.jsonl", launcher)  # both ranks are in the training loop
        os.kill(victim, fault)
        faulted = time.monotonic()
        out, _ = launcher.communicate(timeout=TIMEOUT_S + GRACE_S + 60)
        elapsed = time.monotonic() - faulted
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1, out[-3000:]
    assert message in out and "rank 0 failed" not in out, out[-3000:]
    assert elapsed < TIMEOUT_S + GRACE_S + 30
    with pytest.raises(ProcessLookupError):  # nothing left running (the launcher reaped every rank)
        os.kill(victim, 0)


@pytest.mark.parametrize("codes, failed, stopped_by, expected", [
    ([0, 0], [], None, 0),
    ([143, 143], [], signal.SIGTERM, 143),  # preempted: every rank saved its checkpoint; rerun with --resume auto
    ([130, 130], [], signal.SIGINT, 130),
    ([143, 2], [1], None, 2),  # a rank found a bad input; the other was stopped: 2, not 143
    ([143, -9], [1], None, 1),  # a rank killed from outside (OOM killer): a failure, not a preemption
    ([1, -19], [1], None, 1),  # a hung rank, killed by the launcher
])
def test_launcher_exit_code_is_the_failed_ranks_not_a_stopped_ones(codes, failed, stopped_by, expected):
    assert RankExits(codes, failed, stopped_by).exit_code() == expected


def test_more_chips_than_cores_is_refused_before_anything_starts(teacher_dir, cache_dir, tmp_path, capsys):
    chips = (os.cpu_count() or 1) + 1
    code = main(["train", "--num-chips", str(chips), "--device", "cpu", "--model", str(teacher_dir), "--cache",
                 str(cache_dir), "--quant", "w2g32", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"qat-lora train: error: --num-chips {chips}: this host has {os.cpu_count()} CPU "
                                 f"cores; pass --num-chips {os.cpu_count()} or fewer"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("world_size, error, lost", [
    ("2", RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation"), True),
    ("2", RuntimeError("[gloo/transport/tcp/pair.cc:538] Read error: Connection reset by peer"), True),
    ("2", RuntimeError("CUDA out of memory"), False),  # this rank's own failure: it is the one to blame
    ("1", RuntimeError("Timed out waiting 20000ms for recv operation"), False),  # no peers: not a lost rank
])
def test_a_rank_reports_a_lost_peer_only_for_collective_failures(world_size, error, lost, tmp_path, monkeypatch):
    from qat_lora.runtime.launch import STATUS_ENV, report_lost_peer

    monkeypatch.setenv("WORLD_SIZE", world_size)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(STATUS_ENV, str(tmp_path))
    assert report_lost_peer(error) is lost
    assert (tmp_path / "rank-1.lost").exists() is lost  # what the launcher reads to blame another rank
