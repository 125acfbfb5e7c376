"""FSDP-style parameter sharding over the devices of one SPMD process (`--parallel fsdp`), for students larger
than one chip.

Each frozen parameter is split along one dimension over the same 1-D device mesh that splits the batch (torch_xla's
FSDPv2 layout: one axis shards both); GSPMD then all-gathers a layer's weights where the graph needs them and
reduce-scatters their gradients, so each device keeps about 1/N of the frozen student. Trainable tensors (LoRA, quantisers: small) stay
replicated, with their optimizer states. torch_xla is imported inside functions only.

    backend = FsdpBackend()                      # before any XLA work: turns SPMD on
    model = backend.shard_model_(model, device)  # each parameter split as it moves: no device holds it all
"""
from __future__ import annotations

import functools
import math
import re
from typing import Iterable

import torch

from qat_lora.runtime import device as dev
from qat_lora.runtime import xla
from qat_lora.runtime.distributed import SpmdBackend


def shard_dim(shape: tuple[int, ...], devices: int) -> int | None:
    """The dimension to split a tensor of `shape` over `devices`: the largest one they divide evenly (even
    shards keep every device's buffers the same size); None: too small or indivisible, so it is replicated."""
    fits = [d for d, n in enumerate(shape) if n >= devices and n % devices == 0]
    return max(fits, key=lambda d: shape[d]) if fits else None


def shard_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape one device holds of an XLA `tensor`, read from its sharding spec (no transfer): the whole
    shape when replicated or unannotated, else each dimension divided by its tile count (rounded up)."""
    spec = xla.sharding_spec(tensor)  # e.g. "{devices=[4,1]0,1,2,3}", "{replicated}", ""
    tiles = re.search(r"devices=\[([\d,]+)\]", spec)
    if tiles is None:
        return tuple(tensor.shape)
    counts = [int(n) for n in tiles.group(1).split(",")][:tensor.dim()]  # a trailing replicated tile dim dropped
    return tuple(-(-size // count) for size, count in zip(tensor.shape, counts))


def held_bytes(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    """{device: bytes} that each XLA device holds of `tensors`, read from the devices' own buffers (a copy of each
    shard comes to the host: for tests and benchmarks, not for a hot path)."""
    held: dict[str, int] = {}
    tensors = list(tensors)
    for pieces in xla.local_shards(tensors):
        for piece, device in pieces:
            held[device] = held.get(device, 0) + piece.numel() * piece.element_size()
    return held


def device_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of `tensors` one device holds, from their shardings (replicated tensors count whole)."""
    return sum(math.prod(shard_shape(t)) * t.element_size() for t in tensors)


class FsdpBackend(SpmdBackend):
    """SPMD over every XLA device with the batch AND the parameters sharded over the 'data' mesh axis."""

    def shard_model_(self, model: torch.nn.Module, device: torch.device | None = None) -> torch.nn.Module:
        """Mark each frozen parameter's sharding (in place): split along `shard_dim`, else replicated.

        Trainable parameters stay replicated: LoRA and quantiser tensors are small, and a sharded tensor leaving
        the device (every save) would compile a gather program each time. With `device`, host parameters move there
        module by module, each split as it lands: no device ever holds more than one module's tensors whole, so a
        model larger than one chip loads (model.to(device) first would copy all of it to every device).
        """
        if device is not None:  # module by module, tied parameters kept tied (one copy, split once)
            dev.move_model_(model, device, on_module=self._shard_module_)
        else:
            for module in model.modules():
                self._shard_module_(module)
        params = list(model.parameters())
        self._bytes = (device_bytes(params), sum(p.numel() * p.element_size() for p in params))
        return model

    def _shard_module_(self, module: torch.nn.Module) -> None:
        """Split the module's own frozen parameters; a fake-quantised linear's cached Wq (its `wq_layout` slot)
        is then laid out like its weight, so the frozen layer is 1/N per device, not only its latent weight."""
        for name, p in module.named_parameters(recurse=False):
            dim = None if p.requires_grad else shard_dim(tuple(p.shape), self.layout.devices)  # every host's
            if dim is None:
                continue
            spec = tuple("data" if d == dim else None for d in range(p.dim()))
            self._xs.mark_sharding(p, self._mesh, spec)
            if name == "weight" and hasattr(module, "wq_layout"):
                module.wq_layout = functools.partial(self._xs.mark_sharding, mesh=self._mesh, partition_spec=spec)

    _bytes: tuple[int, int] | None = None  # (per device, whole model) parameter bytes, once sharded

    def describe(self) -> str:
        held = "" if self._bytes is None else (f"; parameters {self._bytes[0] / 2**20:.2f} MiB per device of "
                                               f"{self._bytes[1] / 2**20:.2f} MiB")
        where = f" (host {self.rank} of {self.world_size})" if self.world_size > 1 else ""
        return f"XLA SPMD (fsdp), batch and parameters sharded over {self.layout.devices} devices{where}{held}"
