"""Starting the ranks of a training run: one process, N local processes, torch_xla replicas or one SPMD process.

`run(cfg)` is what `qat-lora train` calls. With `--num-chips 1` (or inside a rank a launcher already started:
WORLD_SIZE is set) it trains in this process; otherwise (DESIGN §6):
- CUDA / CPU: `launch_local` starts N processes with torchrun's environment (NCCL / gloo) and waits for them;
  a rank that fails stops the others.
- TPU: `torch_xla.launch` replicas (xm.reduce_gradients + a plain optimizer.step), or one SPMD process over
  the chips with `--parallel spmd`.
- XLA on a CPU host: one SPMD process over CPU_NUM_DEVICES devices (its spawned replicas cannot run
  collectives: pytorch/xla #5005, #9089).

    qat-lora train --num-chips 2 --device cpu --model M --cache caches/kd --out runs/x
    qat-lora train --num-chips 4 --device tpu --model M --cache caches/kd --out runs/x
    torchrun --nproc-per-node 8 -m qat_lora.cli train --device cuda --model M --cache caches/kd --out runs/x
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import device as dev
from .config import TrainConfig, to_argv


def run(cfg: TrainConfig, log: Callable[[str], None] = print) -> int:
    """Train `cfg` on `cfg.num_chips` devices; returns the exit code (0, or the first failing rank's).

    Raises:
        ValueError: SPMD without XLA, or XLA replicas on a host without a TPU.
    """
    from .train import train

    if cfg.num_chips == 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        train(cfg, log)
        return 0
    xla = dev.wants_xla(cfg.device)
    parallel = cfg.parallel
    if parallel == "spmd" and not xla:
        raise ValueError(f"--parallel spmd with --device {cfg.device}: SPMD needs --device xla or tpu; use "
                         "--parallel processes")
    if xla and not dev.tpu_present() and parallel != "spmd":
        if parallel == "processes":
            raise ValueError(f"--device {cfg.device} --num-chips {cfg.num_chips} --parallel processes: XLA:CPU "
                             "replicas cannot run collectives (DESIGN §6); use --parallel spmd, a TPU, or --device cpu")
        log(f"XLA on a CPU host: its replicas cannot run collectives (DESIGN §6); training one SPMD process "
            f"over {cfg.num_chips} devices instead")
        parallel = "spmd"
    if parallel == "spmd":
        return _train_spmd(cfg)
    if xla:
        import torch_xla

        log(f"starting torch_xla replicas for {cfg.num_chips} chips")
        torch_xla.launch(_xla_rank, args=(cfg,))
        return 0
    check_local_devices(cfg)
    log(f"starting {cfg.num_chips} local ranks ({'NCCL' if cfg.device == 'cuda' else 'gloo'})")
    cmd = [sys.executable, "-m", "qat_lora.cli", "train", *to_argv(cfg)]
    return launch_local(cmd, cfg.num_chips, log=log).exit_code()


def check_local_devices(cfg: TrainConfig) -> None:
    """Refuse more local ranks than this host has GPUs (CUDA) or cores (CPU), before any rank starts: more
    would share a GPU or a core each, and run out of memory or many times slower instead of failing."""
    if cfg.device == "cuda" or (cfg.device == "auto" and dev.resolve_device("auto").type == "cuda"):
        import torch

        have, what = torch.cuda.device_count(), "GPUs"
    else:
        have, what = os.cpu_count() or 1, "CPU cores"
    if cfg.num_chips > have:
        raise ValueError(f"--num-chips {cfg.num_chips}: this host has {have} {what}; pass --num-chips {have} or "
                         "fewer")


def _xla_rank(index: int, cfg: TrainConfig) -> None:
    """One torch_xla replica: train with the XLA backend."""
    from .distributed import XlaBackend
    from .train import train

    backend = XlaBackend()
    if backend.world_size != cfg.num_chips:  # torch_xla.launch starts one replica per visible chip
        raise ValueError(f"--num-chips {cfg.num_chips}: torch_xla started {backend.world_size} replicas (one per "
                         f"visible chip); pass --num-chips {backend.world_size}, or limit the chips with "
                         "TPU_VISIBLE_CHIPS / TPU_PROCESS_BOUNDS")
    train(cfg, backend=backend)


def _train_spmd(cfg: TrainConfig) -> int:
    """One SPMD process over `cfg.num_chips` XLA devices (on the host CPU: CPU_NUM_DEVICES of them)."""
    from .distributed import SpmdBackend
    from .train import train

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    if os.environ["PJRT_DEVICE"].upper() == "CPU":
        os.environ["CPU_NUM_DEVICES"] = str(cfg.num_chips)
    backend = SpmdBackend()
    if backend.data_parallel != cfg.num_chips:
        raise ValueError(f"--num-chips {cfg.num_chips}: this host has {backend.data_parallel} XLA devices")
    train(cfg, backend=backend)
    return 0


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
