"""torch_xla replicas (`train --parallel processes` on a TPU host) are supervised (issue 47, item 1): a replica
that dies, or one whose wait on the others outlasts --dist-timeout-s, ends every replica with one line and exit 1.
XLA:CPU replicas cannot run collectives (DESIGN §6), so the faults are injected: a process pool like
torch_xla.launch's, whose replicas die, hang, or wait on a peer that never comes."""
from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qat_lora.runtime.distributed import WaitWatchdog


def _replica(index: int, fault: str, pids: str) -> None:
    """A replica of the fault plan: `dies` ends at once (exit 3), `hangs` never returns (stuck in its own work,
    no watchdog armed), `waits` waits on the others with a 1 s watchdog, as XlaBackend's rendezvous does."""
    from qat_lora.train.launch import record_replica

    record_replica(index)  # as _xla_rank does: the supervisor watches it
    Path(pids, str(index)).write_text(str(os.getpid()))  # and the test, after the run
    if fault == "dies":
        time.sleep(0.5)
        os._exit(3)
    if fault == "waits":
        with WaitWatchdog(1.0, index).waiting("rendezvous step-7"):
            time.sleep(300)
    time.sleep(300)


def _pool(faults: list[str], pids: Path):
    """torch_xla.launch's shape: a spawn ProcessPoolExecutor, one replica per chip, results read in order."""
    def launch(fn, args=()):
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(len(faults), mp_context=context) as pool:
            list(pool.map(_replica, range(len(faults)), faults, [str(pids)] * len(faults)))
    return launch


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


# The launcher runs in a process of its own, as `qat-lora train` does.
LAUNCHER = """
import json, sys, time
from tests.test_replica_supervision import _pool
from qat_lora.train.config import TrainConfig
from qat_lora.train.launch import launch_replicas

logs, started = [], time.monotonic()
code = launch_replicas(TrainConfig(model="m", num_chips=2, dist_timeout_s=1.0), logs.append,
                       launch=_pool(sys.argv[1].split(","), sys.argv[2]))
print(json.dumps({"code": code, "logs": logs, "seconds": time.monotonic() - started}))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("faults", [["hangs", "dies"], ["waits", "hangs"]], ids=["a replica dies", "a peer hangs"])
def test_a_dead_or_hung_replica_ends_every_replica_with_one_line(tmp_path, faults):
    out = subprocess.run([sys.executable, "-c", LAUNCHER, ",".join(faults), str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["code"] == 1 and result["seconds"] < 60, result
    logs = result["logs"]
    assert "a torch_xla replica died or gave up waiting for the others" in logs[-1] and "--resume auto" in logs[-1]
    deadline = time.monotonic() + 10
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids), "a replica outlived the run"


def test_the_watchdog_times_waits_only():
    script = ("import time; from qat_lora.runtime.distributed import WaitWatchdog\n"
              "dog = WaitWatchdog(0.5, 3)\n"
              "time.sleep(1.5)  # work, not a wait: never timed\n"
              "with dog.waiting('rendezvous save-40'): time.sleep(0.2)\n"
              "print('worked', flush=True)\n"
              "with dog.waiting('rendezvous eval-50'): time.sleep(30)\n")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == "worked\n" and time.monotonic() - started < 20
    assert out.stderr.strip().splitlines() == [
        "rank 3: waited over --dist-timeout-s 0.5 s for the other replicas (rendezvous eval-50): one of them died or "
        "hung; ending this one too"]
