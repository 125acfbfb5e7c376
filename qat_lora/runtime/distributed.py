"""One backend interface for data-parallel training: single process, torch.distributed, torch_xla replicas, SPMD.

The trainer uses `rank`, `world_size`, `local_rank`, `data_parallel`, `is_master`, `reduce_gradients(optimizer)`
(mean over ranks), `rendezvous(tag)`, `input_sharding(dims)`, `all_gather(tensor)`, `agree(stop, finite)`,
`shutdown()` and `describe()`; which backend plays them is chosen here (DESIGN §6). Starting the processes is
runtime/launch.py's job.

- `Backend`: one process; every collective is a no-op.
- `TorchDistributedBackend`: NCCL (CUDA) or gloo (CPU) processes, started by `launch.launch_local`
  (`qat-lora train --num-chips N`), by torchrun, or by any multi-host launcher that sets RANK / WORLD_SIZE /
  MASTER_ADDR / MASTER_PORT.
- `XlaBackend`: `torch_xla.launch` replicas on TPU: `xm.reduce_gradients` then a plain `optimizer.step()`,
  `xm.rendezvous(tag)`. torch_xla's collectives have no timeout: a `WaitWatchdog` ends a replica whose wait on
  the others outlasts --dist-timeout-s, as gloo's timeout does. XLA:CPU cannot run collectives between spawned
  replicas (pytorch/xla #5005, #9089), so multi-process semantics are tested through gloo.
- `SpmdBackend`: one process driving every XLA device, the batch sharded over a 'data' mesh.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch

from qat_lora.runtime import device as dev

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

    def input_sharding(self, dims: dict[str, int]) -> dict | None:
        """How each batch tensor (name -> number of dims) is laid out over this process's devices as it is
        copied there (SPMD: split along the batch dimension); None: whole on the one device."""
        return None

    def shard_model_(self, model: torch.nn.Module, device: torch.device | None = None) -> torch.nn.Module:
        """Lay the model's parameters out over this process's devices (FSDP); elsewhere unchanged. With `device`,
        the parameters are moved there first (FSDP: one at a time, each split as it arrives)."""
        return model if device is None else dev.move_model_(model, device)

    def shard_rows_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Lay a placed tensor out over this process's devices along its first (batch) dimension (SPMD); on an
        intermediate result this constrains the compiler's layout (no device holds the whole); unchanged elsewhere."""
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape and dtype on all ranks), on the CPU, in rank order."""
        return [tensor.cpu()]

    # Agreement steps are few (trainer: every --log-steps and --save-steps), so a rank that alone received a
    # stop signal is joined by the others at the same step, before any save collective (no deadlock), and no
    # step in between pays a collective or a host read for it.
    def agree(self, stop: bool, stats: torch.Tensor) -> tuple[bool, bool, torch.Tensor]:
        """(some rank was asked to stop, every rank's run is finite, this rank's `stats` on the host): ONE
        max-reduction of both flags and ONE host read, which brings the step's statistics with it (the trainer's
        log needs no read of its own). Every rank must call it at the same steps.

        Args:
            stop: this rank received SIGTERM / SIGINT.
            stats: float32 device vector of this rank's step statistics whose LAST entry is 1.0 while every loss
                and gradient norm of this rank so far was finite (0.0 once one was not).
        """
        host = dev.to_host([stats])[0]
        return stop, bool(host[-1] > 0.5), host

    def shutdown(self) -> None:
        """Release the process group (end of training)."""

    def describe(self) -> str:
        return "single process"


class TorchDistributedBackend(Backend):
    """torch.distributed with NCCL on CUDA and gloo elsewhere, initialised from the launcher's environment."""

    def __init__(self, device_type: str, timeout_s: float = 600.0, hosts: SpmdLayout | None = None) -> None:
        """`hosts`: the host-level group of a multi-host SPMD run (one process per host, found through the TPU
        runtime's `xla://` rendezvous); otherwise the launcher's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT."""
        import torch.distributed as dist

        self.name = "nccl" if device_type == "cuda" else "gloo"
        if hosts is not None:
            import torch_xla.distributed.xla_backend  # noqa: F401  registers the xla:// rendezvous

            self.rank, self.world_size, self.local_rank, init = hosts.host, hosts.hosts, 0, "xla://"
        else:
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise ValueError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} but {', '.join(missing)} unset; start "
                                 "ranks with qat-lora train --num-chips N or torchrun")
            self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            self.local_rank, init = int(os.environ.get("LOCAL_RANK", self.rank)), None
        # A bounded timeout: a rank that dies mid-collective makes the others fail instead of hanging forever.
        dist.init_process_group(self.name, init_method=init, rank=self.rank, world_size=self.world_size,
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

    def agree(self, stop: bool, stats: torch.Tensor) -> tuple[bool, bool, torch.Tensor]:
        local = stats.to(self._comm, torch.float32)  # gloo under XLA SPMD hosts: this copy is the one host read
        flags = torch.stack([torch.tensor(float(stop), device=self._comm), 1.0 - local[-1]])  # (stop, diverged)
        self._dist.all_reduce(flags, op=self._dist.ReduceOp.MAX)
        host = torch.cat([local, flags]).cpu()  # NCCL: the one host read (CPU tensors: no copy)
        return bool(host[-2] > 0.5), not bool(host[-1] > 0.5), host[:-2]

    def shutdown(self) -> None:
        self._dist.destroy_process_group()

    def describe(self) -> str:
        return f"torch.distributed ({self.name}), rank {self.rank} of {self.world_size}"


class WaitWatchdog:
    """Ends this process (exit 1, one line on stderr) when one wait on the other ranks lasts over `timeout_s`.

    torch_xla's collectives have no timeout: a replica whose peer died waits in the next rendezvous or host read
    forever, and keeps its chip. Ended, it breaks torch_xla.launch's process pool, whose parent then stops every
    replica (train/launch.py). Only waits are timed (as gloo's timeout does), never compiles or the work between.
    """

    def __init__(self, timeout_s: float, rank: int) -> None:
        self.timeout_s, self.rank = timeout_s, rank
        self._since: float | None = None
        self._what = ""
        threading.Thread(target=self._watch, name="qat-lora-wait-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        self._what, self._since = what, time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 10))
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                sys.stderr.write(f"rank {self.rank}: waited over --dist-timeout-s {self.timeout_s:g} s for the other "
                                 f"replicas ({self._what}): one of them died or hung; ending this one too\n")
                sys.stderr.flush()
                os._exit(1)


class XlaBackend(Backend):
    """torch_xla replicas (torch_xla.launch / xmp.spawn), one per TPU chip; each wait on the others is bounded
    by `timeout_s` (WaitWatchdog)."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        self._xm = xm
        self.rank, self.world_size = xr.global_ordinal(), xr.world_size()
        self.local_rank = xr.local_ordinal()
        self._watchdog = WaitWatchdog(timeout_s, self.rank)

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # Then a plain optimizer.step(): xm.optimizer_step would all-reduce a second time (DESIGN §6). Lazy: the
        # all-reduce runs with the step's graph, and a missing peer shows at the next host read (agree), timed.
        self._xm.reduce_gradients(optimizer)

    def rendezvous(self, tag: str) -> None:
        with self._watchdog.waiting(f"rendezvous {tag}"):
            self._xm.rendezvous(tag)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        import torch_xla

        # int32 rows: narrow integer collectives are not lowered on every TPU generation; a float tensor travels
        # as its float32 bits (exact), not as values rounded to integers.
        floating = tensor.is_floating_point()
        flat = tensor.reshape(1, -1)
        row = flat.to(torch.float32).view(torch.int32) if floating else flat.to(torch.int32)
        with self._watchdog.waiting("all_gather"):
            gathered = self._xm.all_gather(row.to(torch_xla.device()), dim=0).cpu()
        return [(r.view(torch.float32) if floating else r).to(tensor.dtype).reshape(tensor.shape) for r in gathered]

    def agree(self, stop: bool, stats: torch.Tensor) -> tuple[bool, bool, torch.Tensor]:
        # A preemption signals the hosts at different moments: a rank deciding alone would start the save's
        # rendezvous while the others enter the next step's all-reduce, and both would wait forever.
        # float32 flags: narrow integer collectives are not lowered on every TPU generation.
        flags = torch.stack([torch.tensor(float(stop)).to(stats.device), 1.0 - stats[-1]])  # (stop, diverged)
        reduced = self._xm.all_reduce(self._xm.REDUCE_MAX, flags)
        with self._watchdog.waiting("the log step's all-reduce"):  # the steps since the last read run here too
            host = dev.to_host([torch.cat([stats, reduced])])[0]  # the one host read
        return bool(host[-2] > 0.5), not bool(host[-1] > 0.5), host[:-2]

    def describe(self) -> str:
        return f"torch_xla replicas, rank {self.rank} of {self.world_size}"


@dataclass(frozen=True)
class SpmdLayout:
    """Where this process sits in an SPMD run: host `host` of `hosts` (one process each: a TPU pod slice runs the
    same command on every host), driving `local` of the mesh's `devices` devices."""

    host: int
    hosts: int
    local: int
    devices: int

    @property
    def mesh_shape(self) -> tuple[int]:
        """One 'data' axis over every device of every host, in the runtime's global order (host-major): each host
        feeds the rows of its own devices, and GSPMD's gradient all-reduce spans them all."""
        return (self.devices,)


def spmd_layout(host: int, hosts: int, local: int, devices: int) -> SpmdLayout:
    """The layout the runtime reports, checked: every host drives the same number of devices.

    Raises:
        ValueError: the hosts' device counts do not add up (a slice started on some of its hosts only).
    """
    if not (0 <= host < hosts and local > 0 and devices == hosts * local):
        raise ValueError(f"XLA runtime: host {host} of {hosts} drives {local} of {devices} devices; a multi-host run "
                         "needs every host of the slice running the same command (gcloud ... ssh --worker=all)")
    return SpmdLayout(host, hosts, local, devices)


class SpmdBackend(Backend):
    """One process per host driving all its XLA devices: the batch is sharded over a 1-D 'data' mesh and the
    compiler inserts the gradient all-reduce, so the update equals the full-batch one. Create it before any XLA work.

    On a multi-host slice (a TPU pod) every host runs the same command: the mesh spans every host's devices, host h
    reads the cache rows of rank h of H (as torch.distributed ranks do) and feeds them to its own devices
    (`minibatch` sharding: the global batch is the hosts' batches in host order), and the host-level agreement
    (stop, save barrier, RNG states) goes through a gloo group over the runtime's own rendezvous.
    """

    def __init__(self) -> None:
        import numpy as np
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()
        self.layout = spmd_layout(xr.process_index(), xr.process_count(), xr.addressable_runtime_device_count(),
                                  xr.global_runtime_device_count())
        self.rank, self.world_size, self.data_parallel = self.layout.host, self.layout.hosts, self.layout.local
        self._xs = xs
        self._mesh = xs.Mesh(np.arange(self.layout.devices), self.layout.mesh_shape, ("data",))
        self._hosts = TorchDistributedBackend("cpu", hosts=self.layout) if self.layout.hosts > 1 else None

    def input_sharding(self, dims: dict[str, int]) -> dict:
        return {name: self._xs.ShardingSpec(self._mesh, ("data",) + (None,) * (n - 1),
                                            minibatch=self.layout.hosts > 1) for name, n in dims.items()}

    # Host-level collectives of a multi-host slice (one host: the single-process no-ops). The gradients need
    # none: GSPMD reduces them over the whole mesh inside the step.
    def rendezvous(self, tag: str) -> None:
        if self._hosts is not None:
            self._hosts.rendezvous(tag)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return super().all_gather(tensor) if self._hosts is None else self._hosts.all_gather(tensor)

    def agree(self, stop: bool, stats: torch.Tensor) -> tuple[bool, bool, torch.Tensor]:
        return super().agree(stop, stats) if self._hosts is None else self._hosts.agree(stop, stats)

    def shutdown(self) -> None:
        if self._hosts is not None:
            self._hosts.shutdown()

    def shard_rows_(self, tensor: torch.Tensor) -> torch.Tensor:
        self._xs.mark_sharding(tensor, self._mesh, ("data",) + (None,) * (tensor.dim() - 1))
        return tensor

    def describe(self) -> str:
        where = f" (host {self.rank} of {self.world_size}, {self.layout.devices} in all)" if self.world_size > 1 else ""
        return f"XLA SPMD, batch sharded over {self.data_parallel} devices{where}"


def init_backend(device: torch.device, timeout_s: float = 600.0) -> Backend:
    """The backend for this process: torch.distributed when a launcher set WORLD_SIZE > 1, else one process.

    Raises:
        ValueError: a torchrun-style environment with an XLA device (use torch_xla.launch instead).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Backend()
    if device.type == "xla":
        raise ValueError("--device xla under torchrun: XLA replicas start with torch_xla.launch; use "
                         "qat-lora train --num-chips N --device tpu")
    return TorchDistributedBackend(device.type, timeout_s)
