"""One backend interface for data-parallel training: single process, torch.distributed, torch_xla replicas.

The trainer calls only `rank`, `world_size`, `is_master`, `reduce_gradients(optimizer)` (mean over ranks),
`rendezvous(tag)`, `all_gather(tensor)` and `any(flag)`; which backend plays them is chosen here (DESIGN §6):

- `Backend`: one process; every collective is a no-op.
- `TorchDistributedBackend`: NCCL (CUDA) or gloo (CPU) processes, started by `launch_local` (the
  `--num-chips N` of scripts/train_recovery_lora_multi.py), by torchrun, or by any multi-host launcher that
  sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.
- `XlaBackend`: `torch_xla.launch` replicas on TPU: `xm.reduce_gradients` then a plain `optimizer.step()`,
  `xm.rendezvous(tag)`. XLA:CPU cannot run collectives between spawned replicas (pytorch/xla #5005, #9089),
  so multi-process semantics are tested through gloo.

    python scripts/train_recovery_lora_multi.py --num-chips 2 --device cpu --model M --cache C --out runs/x
    torchrun --nproc-per-node 8 -m qat_lora.cli train --device cuda --model M --cache C --out runs/x
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Callable

import torch

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class Backend:
    """A single process: rank 0 of 1, every collective a no-op."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    data_parallel: int = 1  # devices one process splits its batch over (SPMD); the batch is this x --batch-size

    @property
    def is_master(self) -> bool:
        """Only the master evaluates, logs and writes files."""
        return self.rank == 0

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Replace every gradient of `optimizer`'s parameters by its mean over ranks."""

    def rendezvous(self, tag: str) -> None:
        """Wait until every rank reaches the point named `tag`."""

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Lay a device batch out over this process's devices (SPMD); unchanged elsewhere."""
        return batch

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape and dtype on all ranks), on the CPU, in rank order."""
        return [tensor.cpu()]

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on some rank (e.g. a stop signal reached only one)."""
        return flag

    def shutdown(self) -> None:
        """Release the process group (end of training)."""

    def describe(self) -> str:
        return "single process"


class TorchDistributedBackend(Backend):
    """torch.distributed with NCCL on CUDA and gloo elsewhere, initialised from the launcher's environment."""

    def __init__(self, device_type: str, timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} but {', '.join(missing)} unset; start ranks "
                             "with scripts/train_recovery_lora_multi.py --num-chips N or torchrun")
        self.name = "nccl" if device_type == "cuda" else "gloo"
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        # A bounded timeout: a rank that dies mid-collective makes the others fail instead of hanging forever.
        dist.init_process_group(self.name, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=timeout_s))
        self._dist = dist
        self._comm = torch.device("cuda", self.local_rank) if self.name == "nccl" else torch.device("cpu")

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)  # one all-reduce per step instead of one per tensor
        self._dist.all_reduce(flat)
        flat /= self.world_size
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)

    def rendezvous(self, tag: str) -> None:
        self._dist.barrier()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        local = tensor.to(self._comm)
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        self._dist.all_gather(out, local)
        return [t.cpu() for t in out]

    def any(self, flag: bool) -> bool:
        value = torch.tensor([int(flag)], device=self._comm)
        self._dist.all_reduce(value, op=self._dist.ReduceOp.MAX)
        return bool(value.item())

    def shutdown(self) -> None:
        self._dist.destroy_process_group()

    def describe(self) -> str:
        return f"torch.distributed ({self.name}), rank {self.rank} of {self.world_size}"


class XlaBackend(Backend):
    """torch_xla replicas (torch_xla.launch / xmp.spawn), one per TPU chip."""

    def __init__(self) -> None:
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        self._xm = xm
        self.rank, self.world_size = xr.global_ordinal(), xr.world_size()
        self.local_rank = xr.local_ordinal()

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # Then a plain optimizer.step(): xm.optimizer_step would all-reduce a second time (DESIGN §6).
        self._xm.reduce_gradients(optimizer)

    def rendezvous(self, tag: str) -> None:
        self._xm.rendezvous(tag)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        import torch_xla

        # int32 rows: narrow integer collectives are not lowered on every TPU generation.
        row = tensor.reshape(1, -1).to(torch.int32).to(torch_xla.device())
        gathered = self._xm.all_gather(row, dim=0).cpu()
        return [r.to(tensor.dtype).reshape(tensor.shape) for r in gathered]

    def any(self, flag: bool) -> bool:
        # A TPU preemption signals every host process; agreeing would cost a collective in every step.
        return flag

    def describe(self) -> str:
        return f"torch_xla replicas, rank {self.rank} of {self.world_size}"


class SpmdBackend(Backend):
    """One process driving every XLA device: the batch is sharded over a 1-D 'data' mesh and the compiler
    inserts the gradient all-reduce, so the update equals the full-batch one. Create it before any XLA work."""

    def __init__(self) -> None:
        import numpy as np
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()
        self.data_parallel = xr.global_runtime_device_count()
        self._xs = xs
        self._mesh = xs.Mesh(np.arange(self.data_parallel), (self.data_parallel,), ("data",))

    def shard_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for tensor in batch.values():
            self._xs.mark_sharding(tensor, self._mesh, ("data",) + (None,) * (tensor.dim() - 1))
        return batch

    def describe(self) -> str:
        return f"XLA SPMD, batch sharded over {self.data_parallel} devices"


def init_backend(device: torch.device, timeout_s: float = 600.0) -> Backend:
    """The backend for this process: torch.distributed when a launcher set WORLD_SIZE > 1, else one process.

    Raises:
        ValueError: a torchrun-style environment with an XLA device (use torch_xla.launch instead).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Backend()
    if device.type == "xla":
        raise ValueError("--device xla under torchrun: XLA replicas start with torch_xla.launch; use "
                         "scripts/train_recovery_lora_multi.py --num-chips N --device tpu")
    return TorchDistributedBackend(device.type, timeout_s)


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


def python_module_cmd(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _xla_rank(index: int, num_chips: int, train_argv: list[str]) -> None:
    """One torch_xla replica: parse the train flags and train with the XLA backend."""
    from .cli import build_parser, config_from_args
    from .train import TrainConfig, train

    cfg = config_from_args(TrainConfig, build_parser().parse_args(["train", *train_argv]))
    backend = XlaBackend()
    if backend.world_size != num_chips:  # torch_xla.launch starts one replica per visible chip
        raise ValueError(f"--num-chips {num_chips}: torch_xla started {backend.world_size} replicas (one per "
                         f"visible chip); pass --num-chips {backend.world_size}, or limit the chips with "
                         "TPU_VISIBLE_CHIPS / TPU_PROCESS_BOUNDS")
    train(cfg, backend=backend)


def _train_spmd(num_chips: int, train_argv: list[str]) -> int:
    """One SPMD process over `num_chips` XLA devices (on the host CPU: CPU_NUM_DEVICES of them)."""
    from .cli import build_parser, config_from_args
    from .train import TrainConfig, train

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    if os.environ["PJRT_DEVICE"].upper() == "CPU":
        os.environ["CPU_NUM_DEVICES"] = str(num_chips)
    cfg = config_from_args(TrainConfig, build_parser().parse_args(["train", *train_argv]))
    backend = SpmdBackend()
    if backend.data_parallel != num_chips:
        raise ValueError(f"--num-chips {num_chips}: this host has {backend.data_parallel} XLA devices")
    train(cfg, backend=backend)
    return 0


def run_multi(num_chips: int, parallel: str, train_argv: list[str], log: Callable[[str], None] = print) -> int:
    """Start `num_chips` ranks of `qat-lora train` with the flags `train_argv`; returns the exit code.

    One chip, or ranks already started by torchrun (WORLD_SIZE set): train in this process. TPU: torch_xla
    replicas, or one SPMD process (--parallel spmd). XLA on a CPU host: SPMD (its replicas cannot run
    collectives). CUDA/CPU: `launch_local` processes (NCCL/gloo).

    Raises:
        ValueError: --num-chips < 1, SPMD without XLA, or XLA replicas without a TPU.
    """
    from . import device as dev
    from .cli import build_parser, main

    if num_chips < 1:
        raise ValueError(f"--num-chips {num_chips}: must be >= 1")
    if num_chips == 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return main(["train", *train_argv])
    device = build_parser().parse_args(["train", *train_argv]).device
    xla = device in ("xla", "tpu") or (device == "auto" and dev.xla_available() and dev._tpu_present())
    if parallel == "spmd" and not xla:
        raise ValueError(f"--parallel spmd with --device {device}: SPMD needs --device xla or tpu; use "
                         "--parallel processes")
    if xla and not dev._tpu_present() and parallel != "spmd":
        if parallel == "processes":
            raise ValueError(f"--device {device} --num-chips {num_chips} --parallel processes: XLA:CPU replicas "
                             "cannot run collectives (DESIGN §6); use --parallel spmd, a TPU, or --device cpu")
        log(f"XLA on a CPU host: its replicas cannot run collectives (DESIGN §6); training one SPMD process "
            f"over {num_chips} devices instead")
        parallel = "spmd"
    if parallel == "spmd":
        return _train_spmd(num_chips, train_argv)
    if xla:
        import torch_xla

        log(f"starting torch_xla replicas for {num_chips} chips")
        torch_xla.launch(_xla_rank, args=(num_chips, list(train_argv)))
        return 0
    log(f"starting {num_chips} local ranks ({'NCCL' if device == 'cuda' else 'gloo'})")
    return exit_code(launch_local(python_module_cmd("qat_lora.cli", ["train", *train_argv]), num_chips, log=log))
