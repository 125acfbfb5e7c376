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
import signal
import socket
import subprocess
import sys
import time
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
    log(f"starting {cfg.num_chips} local ranks ({'NCCL' if cfg.device == 'cuda' else 'gloo'})")
    cmd = [sys.executable, "-m", "qat_lora.cli", "train", *to_argv(cfg)]
    return exit_code(launch_local(cmd, cfg.num_chips, log=log))


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


def launch_local(cmd: list[str], num_procs: int, grace_s: float = 10.0,
                 log: Callable[[str], None] = print) -> list[int]:
    """Run `cmd` as `num_procs` local ranks (torchrun's environment) and wait for all of them.

    When one rank fails, the others get SIGTERM, then SIGKILL after `grace_s`: every rank ends, none hangs
    in a collective. SIGTERM/SIGINT sent to the launcher are forwarded (preemption: every rank checkpoints).

    Returns:
        the exit code of every rank, in rank order (negative: killed by that signal).
    """
    env = {**os.environ, "WORLD_SIZE": str(num_procs), "LOCAL_WORLD_SIZE": str(num_procs),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    # As torchrun: split the cores between ranks; N ranks each spinning on every core run many times slower.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_procs)))
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(num_procs)]

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed_at = None
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.monotonic()
                bad = next(r for r, p in enumerate(procs) if p.poll() not in (None, 0))
                log(f"rank {bad} exited with {procs[bad].returncode}; stopping the other ranks")
                forward(signal.SIGTERM, None)
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return [p.returncode for p in procs]


def exit_code(codes: list[int]) -> int:
    """One exit code for a group of ranks: 0 when all succeeded, else the first failure (signals as 128+n)."""
    for code in codes:
        if code:
            return code if code > 0 else 128 - code
    return 0
