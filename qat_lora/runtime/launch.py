"""Starting processes, whatever they run: N local ranks with torchrun's environment (`launch_local`: a rank that
fails stops the others, and the one to blame is named), how a group of ranks ended (`RankExits`), which TPU chips
a process and its replicas see (`--num-chips`: `select_tpu_chips`, `tpu_visibility_env`), and the one SPMD
backend over a host's chips (`spmd_backend`).

What starts a training run's ranks is train/launch.py (`qat-lora train`); what builds a cache on N chips,
cache/launch.py (`qat-lora build-cache`). `--num-chips 0` (the default) means every TPU chip of the host, one
device elsewhere; on a TPU host with more chips than asked for, the PJRT visibility variables limit the run to
the first N.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from qat_lora.runtime import device as dev
from qat_lora.runtime.xla import tpu_chip_count


# The chip mesh of a TPU host slice of N chips (x, y, z): what libtpu's *_BOUNDS variables describe.
_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
_TPU_VISIBILITY_KEYS = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS")


def tpu_visibility_env(num_chips: int, host_chips: int, per_process: bool) -> dict[str, str]:
    """The PJRT/libtpu variables that make a run use the first `num_chips` of a host's `host_chips` chips.

    Args:
        per_process: one process per chip (torch_xla.launch replicas: each replica then picks its own chip
            through torch_xla's topology set-up); else one process over all `num_chips` (SPMD, or one chip).
    Returns:
        {} when the run uses every chip (the runtime's own topology), else the variables to set.
    Raises:
        ValueError: more chips than the host has, or a count no TPU host slice has.
    """
    if num_chips > host_chips:
        raise ValueError(f"--num-chips {num_chips}: this host has {host_chips} TPU chip(s); pass --num-chips "
                         f"{host_chips} or fewer")
    if num_chips == host_chips:
        return {}
    if num_chips not in _CHIP_BOUNDS:
        raise ValueError(f"--num-chips {num_chips}: a TPU host runs on 1, 2, 4 or 8 of its chips; pass one of those")
    if per_process:  # N processes of one chip each: torch_xla.launch starts min(chips, N) replicas
        return {"TPU_PROCESS_BOUNDS": _CHIP_BOUNDS[num_chips], "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1"}
    return {"TPU_VISIBLE_CHIPS": ",".join(map(str, range(num_chips))),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": _CHIP_BOUNDS[num_chips], "TPU_PROCESS_BOUNDS": "1,1,1"}


def chips_to_use(requested: int, device: str) -> int:
    """--num-chips as a count: 0 means every TPU chip of this host, and one device anywhere else."""
    if requested:
        return requested
    return max(1, tpu_chip_count()) if dev.wants_xla(device) and dev.tpu_present() else 1


def select_tpu_chips(num_chips: int, per_process: bool, log: Callable[[str], None] = print) -> None:
    """Limit this process (and the replicas it starts) to `num_chips` TPU chips; a user's own
    TPU_VISIBLE_CHIPS / *_BOUNDS settings win."""
    host_chips = tpu_chip_count()
    if host_chips == 0:  # no PCI view of the chips (some containers): leave the runtime's own topology
        log("TPU chips: this host's chips cannot be counted; using the runtime's own topology")
        return
    env = tpu_visibility_env(num_chips, host_chips, per_process)
    if env and any(k in os.environ for k in _TPU_VISIBILITY_KEYS):
        log(f"TPU chips: keeping this environment's {', '.join(k for k in _TPU_VISIBILITY_KEYS if k in os.environ)}")
        return
    if env:
        log("TPU chips: " + " ".join(f"{k}={v}" for k, v in env.items()))
        os.environ.update(env)


def spmd_backend(num_chips: int, fsdp: bool):
    """The one SPMD process over `num_chips` XLA devices (on the host CPU: CPU_NUM_DEVICES of them) that
    `--parallel spmd` trains and builds caches with; with `fsdp` the frozen parameters are sharded over them
    too (sharding.FsdpBackend). Call before any XLA work."""
    from qat_lora.runtime.distributed import SpmdBackend
    from qat_lora.runtime.sharding import FsdpBackend

    os.environ.setdefault("PJRT_DEVICE", "TPU" if dev.tpu_present() else "CPU")
    if os.environ["PJRT_DEVICE"].upper() == "CPU":
        os.environ["CPU_NUM_DEVICES"] = str(num_chips)
    backend = FsdpBackend() if fsdp else SpmdBackend()
    if backend.data_parallel != num_chips:
        raise ValueError(f"--num-chips {num_chips}: this host has {backend.data_parallel} XLA devices")
    return backend


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STATUS_ENV = "QAT_LORA_RANK_STATUS"  # a folder where a rank that lost its peers says so (launch_local sets it)
STOP_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT)  # a rank stopped cleanly


@dataclass
class RankExits:
    """How a group of local ranks ended: every rank's exit code, and the ranks to blame for a failure."""

    codes: list[int]  # in rank order; negative: killed by that signal
    failed: list[int] = field(default_factory=list)  # the ranks that failed first (not those stopped after them)
    stopped_by: int | None = None  # a stop signal the launcher itself received and forwarded

    def exit_code(self) -> int:
        """The launcher's exit code: 128 + n only for a stop signal, the failed rank's 1 or 2, else 1."""
        if self.failed:
            code = self.codes[self.failed[0]]
            return code if code in (1, 2) else 1  # a hung or killed rank is an environment failure, never 143
        if self.stopped_by is not None:
            return 128 + self.stopped_by
        return exit_code(self.codes)


def report_lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective that lost its peers (a timeout, a closed connection): not this rank's
    fault. Under launch_local it also leaves a marker, so the launcher blames the rank that hung or died."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False  # one process has no peers: a "timed out" there is something else (a bug to show in full)
    names = {c.__name__ for c in type(error).__mro__}
    text = str(error)
    lost = bool(names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}) or any(
        sign in text for sign in ("Timed out", "timed out", "Connection reset by peer", "Connection closed by peer"))
    if lost and os.environ.get(STATUS_ENV) and "RANK" in os.environ:
        Path(os.environ[STATUS_ENV], f"rank-{os.environ['RANK']}.lost").touch()
    return lost


def _failed_ranks(procs: list[subprocess.Popen], status: Path) -> list[int]:
    """The ranks to blame once some rank ended badly: those that failed on their own; when every failed rank
    only lost its peers (a collective timed out), the ranks still running: they hung."""
    bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0, *STOP_CODES)]
    own = [r for r in bad if not (status / f"rank-{r}.lost").exists()]
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    return own or hung or bad


def _describe(rank: int, procs: list[subprocess.Popen]) -> str:
    code = procs[rank].poll()
    if code is None:
        return f"rank {rank} stopped responding (the others gave up waiting for it after --dist-timeout-s)"
    if code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} failed with exit code {code}"


def launch_local(cmd: list[str], num_procs: int, grace_s: float = 10.0,
                 log: Callable[[str], None] = print) -> RankExits:
    """Run `cmd` as `num_procs` local ranks (torchrun's environment) and wait for all of them.

    When a rank fails, the launcher names it (a rank that hung, not the healthy one whose collective timed out
    waiting for it), sends the others SIGTERM, then SIGKILL after `grace_s`: every rank ends within
    --dist-timeout-s + `grace_s`. SIGTERM/SIGINT sent to the launcher are forwarded (every rank checkpoints).
    """
    status = Path(tempfile.mkdtemp(prefix="qat-lora-ranks-"))
    env = {**os.environ, "WORLD_SIZE": str(num_procs), "LOCAL_WORLD_SIZE": str(num_procs),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), STATUS_ENV: str(status)}
    # As torchrun: split the cores between ranks; N ranks each spinning on every core run many times slower.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_procs)))
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(num_procs)]
    result = RankExits([])

    def signal_all(signum: int) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    def forward(signum, _frame):
        result.stopped_by = signum
        signal_all(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed_at = None
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.poll() not in (None, 0, *STOP_CODES) for p in procs):
                failed_at = time.monotonic()
                result.failed = _failed_ranks(procs, status)
                log("; ".join(_describe(r, procs) for r in result.failed) + "; stopping every rank")
                for r in result.failed:  # a hung rank cannot checkpoint (its collectives have no peers): end it now
                    if procs[r].poll() is None:
                        procs[r].kill()
                signal_all(signal.SIGTERM)
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                signal_all(signal.SIGKILL)
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if not result.failed and any(p.returncode not in (0, *STOP_CODES) for p in procs):
        result.failed = _failed_ranks(procs, status)  # every rank ended at once
    shutil.rmtree(status, ignore_errors=True)
    result.codes = [p.returncode for p in procs]
    return result


def exit_code(codes: list[int]) -> int:
    """One exit code for a group of ranks: 0 when all succeeded, else the first failure (signals as 128+n)."""
    for code in codes:
        if code:
            return code if code > 0 else 128 - code
    return 0
