"""Starting a training run's ranks: one process, N local processes, torch_xla replicas or one SPMD process.

`run(cfg)` is what `qat-lora train` calls. With one chip (or inside a rank a launcher already started:
WORLD_SIZE is set) it trains in this process; otherwise (DESIGN §6):
- CUDA / CPU: `launch.launch_local` starts N processes with torchrun's environment (NCCL / gloo) and waits for
  them; a rank that fails stops the others.
- XLA (TPU, and XLA:CPU's CPU_NUM_DEVICES devices): one SPMD process over the chips, `--parallel auto` or
  `spmd` (the batch sharded), or `--parallel fsdp` (the frozen parameters too: runtime/sharding.py): the path
  the tests prove, one process to supervise. `--parallel processes` on a TPU host starts `torch_xla.launch`
  replicas instead (xm.reduce_gradients + a plain optimizer.step); on a CPU host it is refused (XLA:CPU
  replicas cannot run collectives: pytorch/xla #5005, #9089).

The generic machinery (local ranks, TPU chip visibility, the SPMD backend) is runtime/launch.py.

    qat-lora train --num-chips 2 --device cpu --model M --cache caches/kd --out runs/x
    qat-lora train --num-chips 4 --device tpu --model M --cache caches/kd --out runs/x
    torchrun --nproc-per-node 8 -m qat_lora train --device cuda --model M --cache caches/kd --out runs/x
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable

from qat_lora.runtime import device as dev
from qat_lora.runtime.launch import chips_to_use, launch_local, select_tpu_chips, spmd_backend
from qat_lora.train.config import TrainConfig
from qat_lora.runtime.options import to_argv


def run(cfg: TrainConfig, log: Callable[[str], None] = print) -> int:
    """Train `cfg` on `cfg.num_chips` devices; returns the exit code (0, or the first failing rank's).

    Raises:
        ValueError: SPMD without XLA, or XLA replicas on a host without a TPU.
    """
    from qat_lora.train.trainer import train

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        train(cfg, log)
        return 0
    cfg = replace(cfg, num_chips=chips_to_use(cfg.num_chips, cfg.device))
    xla = dev.wants_xla(cfg.device)
    parallel = cfg.parallel
    if xla and dev.tpu_present():  # before any runtime starts: the chips this run may see
        select_tpu_chips(cfg.num_chips, per_process=cfg.num_chips > 1 and parallel == "processes", log=log)
    if cfg.num_chips == 1 and parallel != "fsdp":
        train(cfg, log)
        return 0
    one_process = ("spmd", "fsdp")
    if parallel in one_process and not xla:
        raise ValueError(f"--parallel {parallel} with --device {cfg.device}: SPMD needs --device xla or tpu; use "
                         "--parallel processes")
    if xla and parallel == "processes" and not dev.tpu_present():
        raise ValueError(f"--device {cfg.device} --num-chips {cfg.num_chips} --parallel processes: XLA:CPU "
                         "replicas cannot run collectives (DESIGN §6); use --parallel spmd, a TPU, or --device cpu")
    if xla and parallel == "auto":
        log(f"--parallel auto: one SPMD process over {cfg.num_chips} XLA devices (the batch sharded over them)")
        parallel = "spmd"
    if parallel in one_process:
        return _train_spmd(cfg, fsdp=parallel == "fsdp")
    if xla:
        return launch_replicas(cfg, log)
    check_local_devices(cfg)
    log(f"starting {cfg.num_chips} local ranks ({'NCCL' if cfg.device == 'cuda' else 'gloo'})")
    cmd = [sys.executable, "-m", "qat_lora", "train", *to_argv(cfg)]
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


REPLICA_DIR_ENV = "QAT_LORA_REPLICA_DIR"  # where each torch_xla replica records its pid for the supervisor


def launch_replicas(cfg: TrainConfig, log: Callable[[str], None] = print, launch: Callable | None = None) -> int:
    """torch_xla replicas, one per chip (`--parallel processes` on a TPU host), supervised, so a dead or hung
    replica ends the run with one line and exit 1 instead of leaving the others waiting: one whose wait on the
    others outlasts --dist-timeout-s ends itself (distributed.WaitWatchdog), and once any replica has ended this
    process kills the rest (`_supervise`), which breaks torch_xla.launch's process pool. The pool alone does not
    notice reliably: a worker it spawned after its manager thread began waiting is not watched (Python 3.11,
    measured: the dead replica stays a zombie while the others hang). `launch` stands in for torch_xla.launch."""
    from concurrent.futures.process import BrokenProcessPool

    if launch is None:
        import torch_xla

        launch = torch_xla.launch
    log(f"starting torch_xla replicas for {cfg.num_chips} chips (each wait on the others bounded by "
        f"--dist-timeout-s {cfg.dist_timeout_s:g})")
    pids = Path(tempfile.mkdtemp(prefix="qat-lora-replicas-"))
    os.environ[REPLICA_DIR_ENV] = str(pids)  # the spawned replicas inherit it
    done = threading.Event()
    supervisor = threading.Thread(target=_supervise, args=(pids, done), name="qat-lora-replicas", daemon=True)
    supervisor.start()
    try:
        launch(_xla_rank, args=(cfg,))
    except BrokenProcessPool:
        log("a torch_xla replica died or gave up waiting for the others (its line is above); every replica is "
            "stopped: rerun the same command with --resume auto to continue from the last checkpoint")
        return 1
    finally:
        done.set()
        os.environ.pop(REPLICA_DIR_ENV, None)
        shutil.rmtree(pids, ignore_errors=True)
    return 0


def record_replica(index: int) -> None:
    """Called first in each replica: its pid, for the supervisor of launch_replicas (nothing outside one)."""
    if os.environ.get(REPLICA_DIR_ENV):
        Path(os.environ[REPLICA_DIR_ENV], str(index)).write_text(str(os.getpid()))


def _supervise(pids: Path, done: threading.Event) -> None:
    """Once a recorded replica has ended while the run goes on (a replica returns only when all do), kill the rest."""
    while not done.wait(0.5):
        recorded = [int(text) for text in (p.read_text().strip() for p in pids.iterdir()) if text.isdigit()]
        if any(not _running(pid) for pid in recorded):
            for pid in recorded:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            return


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped by the pool, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _xla_rank(index: int, cfg: TrainConfig) -> None:
    """One torch_xla replica: train with the XLA backend."""
    from qat_lora.runtime.distributed import XlaBackend
    from qat_lora.train.trainer import train

    record_replica(index)
    backend = XlaBackend(cfg.dist_timeout_s)
    if backend.world_size != cfg.num_chips:  # torch_xla.launch starts one replica per visible chip
        raise ValueError(f"--num-chips {cfg.num_chips}: torch_xla started {backend.world_size} replicas (one per "
                         f"visible chip); pass --num-chips {backend.world_size}, or limit the chips with "
                         "TPU_VISIBLE_CHIPS / TPU_PROCESS_BOUNDS")
    train(cfg, backend=backend)


def _train_spmd(cfg: TrainConfig, fsdp: bool = False) -> int:
    from qat_lora.train.trainer import train

    train(cfg, backend=spmd_backend(cfg.num_chips, fsdp))
    return 0
