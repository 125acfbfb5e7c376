"""The XLA runtime: torch_xla imported on demand (and kept unloaded on runs that do not ask for it), the XLA
device started, its counters and memory figure, the persistent compile cache, and the library's every private
torch_xla call, each behind a small named function saying why the public API does not suffice.

Nothing here imports torch_xla at module import time: the library imports on machines without it.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch


def xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def loaded() -> bool:
    """Whether torch_xla is imported in this process already (asking never imports it)."""
    return "torch_xla" in sys.modules


_XLA_OFF = "USE_TORCH_XLA"  # accelerate and transformers import torch_xla when it is installed, unless this is 0


def keep_torch_xla_unloaded() -> None:
    """Before loading a model on a run that has not asked for an XLA device: keep accelerate from importing
    torch_xla, whose import alone warns "Defaulting to PJRT_DEVICE=CPU" and costs seconds. `start_device`
    lifts it when an XLA device is asked for later in the same process."""
    if "torch_xla" not in sys.modules and "PJRT_DEVICE" not in os.environ:
        os.environ.setdefault(_XLA_OFF, "0")


def start_device(pjrt_device: str) -> torch.device:
    """The XLA device of PJRT_DEVICE `pjrt_device` ('TPU' or 'CPU'; a PJRT_DEVICE already set wins): imports
    torch_xla, after lifting keep_torch_xla_unloaded's hold."""
    os.environ.setdefault("PJRT_DEVICE", pjrt_device)
    if os.environ.get(_XLA_OFF) == "0":
        del os.environ[_XLA_OFF]
    import torch_xla

    return torch_xla.device()


def device_hardware(device: torch.device) -> str:
    """The hardware XLA `device` runs on ('TPU', 'CPU', 'CUDA', ...), from the runtime's real device, not from
    PJRT_DEVICE (torch_xla.runtime.device_type() only reads the variable back)."""
    import torch_xla.core.xla_model as xm

    return xm.xla_device_hw(device)


def compile_metrics() -> dict:
    """XLA counters from torch_xla.debug.metrics: compiles, graph executions, device-to-host transfers, ops that
    fell back to the CPU ({} when torch_xla is not in use)."""
    if not loaded():
        return {}
    import torch_xla.debug.metrics as met

    compile_time = met.metric_data("CompileTime")  # (count, total_ns, samples) or None before any compile
    return {
        "graphs_compiled": int(compile_time[0]) if compile_time else 0,
        "compile_seconds": float(compile_time[1]) / 1e9 if compile_time else 0.0,
        "uncached_compiles": int(met.counter_value("UncachedCompile") or 0),
        # SPMD runs a graph on every device at once: ExecuteReplicated, one count per graph run.
        "graph_executions": sum(int((met.metric_data(name) or (0,))[0]) for name in ("ExecuteTime",
                                                                                     "ExecuteReplicatedTime")),
        "transfers_from_device": int((met.metric_data("TransferFromDeviceTime") or (0,))[0]),
        # Graphs loaded from the persistent cache, and graphs it did not hold (then compiled and written).
        "persistent_cache_hits": int(met.counter_value("PersistentCacheHit") or 0),
        "persistent_cache_misses": int(met.counter_value("PersistentCacheMiss") or 0),
        # Found on disk but not loadable here (XLA:CPU's PJRT client cannot deserialize executables): compiled.
        "persistent_cache_unloadable": int(met.counter_value("PersistentCacheDeserializeFailure") or 0),
        "cpu_fallback_ops": sorted(name for name in met.counter_names() if name.startswith("aten::")),
    }


def compile_metrics_since(before: dict) -> dict:
    """compile_metrics() of what ran after `before` (an earlier compile_metrics()): counts and seconds
    subtracted, CPU fallbacks new since then."""
    now = compile_metrics()
    return {k: (sorted(set(v) - set(before.get(k, ()))) if isinstance(v, list) else v - before.get(k, 0))
            for k, v in now.items()}


def memory_used_bytes(device: torch.device) -> int | None:
    """Bytes in use on XLA `device` by its allocator's own count (a host-side query: no graph is cut); None on
    XLA:CPU, which keeps no allocator statistics."""
    import torch_xla.core.xla_model as xm

    try:
        info = xm.get_memory_info(device)
    except RuntimeError:
        return None
    return info.get("bytes_used", (info.get("kb_total", 0) - info.get("kb_free", 0)) * 1024)


XLA_CACHE_AUTO, XLA_CACHE_OFF = "auto", "off"


def xla_cache_path(setting: str) -> str | None:
    """The persistent compile cache folder for --xla-cache-dir `setting`: `auto` is
    $XDG_CACHE_HOME/qat-lora/xla (~/.cache/qat-lora/xla), `off` (or empty) none, anything else that folder."""
    if setting in ("", XLA_CACHE_OFF):
        return None
    if setting == XLA_CACHE_AUTO:
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(root, "qat-lora", "xla")
    return setting


def init_xla_cache(setting: str, local_rank: int = 0) -> str | None:
    """Persistent XLA compile cache: a rerun, a resumed run or the next command loads its graphs from disk
    instead of compiling them (minutes on a TPU for a large student). Returns the folder in use, or None.

    torch_xla takes the folder once per process, before the first compile: a second `train()` or `evaluate()`
    in the same notebook kernel keeps the first one's cache (asking again would fail). Only local rank 0 writes
    (replicas on a host compile the same graphs; each host of a pod has its own folder).

    Raises:
        ValueError: the folder cannot be created (names --xla-cache-dir and the way out).
    """
    import torch_xla.runtime as xr

    path = xla_cache_path(setting)
    if compile_cache_initialized():  # this process compiled already
        return os.environ.get("XLA_PERSISTENT_CACHE_PATH") or None
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--xla-cache-dir {setting}: cannot create {path} ({e.strerror}); pass a writable folder "
                         f"or --xla-cache-dir {XLA_CACHE_OFF}") from e
    xr.initialize_cache(path, readonly=local_rank != 0)
    return path


def host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of XLA `tensors`, in order, in ONE device-to-host transfer: their pending graph runs
    once for all. Under SPMD each sharded result is assembled from the devices' own buffers (from_device_shards)."""
    import torch_xla.runtime as xr

    if xr.is_spmd():
        return from_device_shards(tensors)
    return cpu_tensors(tensors)


def from_device_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """SPMD: run the tensors' pending graph once, then copy each sharded result from every device's own buffer
    into one host tensor. Reading a sharded tensor whole (cpu_tensors) would compile and run a gather program
    on one device for every call: a second graph per batch, and the whole B x L x V on one chip."""
    wait_for(tensors)  # the shards are read right after
    out: list[torch.Tensor | None] = [None] * len(tensors)
    sharded = [i for i, t in enumerate(tensors) if "devices=" in sharding_spec(t)]
    whole = [i for i in range(len(tensors)) if i not in sharded]
    for i, host in zip(whole, cpu_tensors([tensors[i] for i in whole]) if whole else ()):
        out[i] = host
    if sharded:
        shards = local_shards([tensors[i] for i in sharded])
        places = local_shard_places([tensors[i] for i in sharded])
        for i, pieces, where in zip(sharded, shards, places):
            host = torch.empty(tensors[i].shape, dtype=tensors[i].dtype)
            for (piece, _device), (_replica, index) in zip(pieces, where):
                region = host[tuple(index)]
                region.copy_(piece[tuple(slice(0, n) for n in region.shape)])  # an uneven last shard is padded
            out[i] = host
    return out


# The private calls. Each wrapper names the public API closest to it and why that one does not do.

def compile_cache_initialized() -> bool:
    """Whether this process's compile cache is set up already (it compiled, or took a persistent cache folder)."""
    import torch_xla

    # Public: none; xr.initialize_cache only asserts on it, and a failed assert cannot be told from other errors.
    return torch_xla._XLAC._xla_computation_cache_is_initialized()


def cpu_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of XLA `tensors` in one transfer (a sharded one is gathered whole first)."""
    import torch_xla

    # Public: xm.save does this, but pickles to a file; `.cpu()` per tensor is one transfer (and graph run) each.
    return torch_xla._XLAC._xla_get_cpu_tensors(tensors)


def wait_for(tensors: list[torch.Tensor]) -> None:
    """Run the pending graph of `tensors` and block until their device buffers hold the results."""
    import torch_xla

    # Public: xm.unlazy makes this very call but is documented "for benchmarking, don't use it in real models";
    # torch_xla.sync() neither waits nor limits the graph to these tensors.
    torch_xla._XLAC._xla_sync_multi(tensors, [], True, True)


def launch(tensors: list[torch.Tensor]) -> None:
    """Run the pending graph of `tensors` without waiting for it: the host goes on (with the next batch's
    inputs) while the device computes; reading them later waits for the results."""
    import torch_xla

    # Public: torch_xla.sync() also returns at once, but cuts the graph of every live tensor, not just these.
    torch_xla._XLAC._xla_sync_multi(tensors, [], False, True)


def sharding_spec(tensor: torch.Tensor) -> str:
    """The XLA sharding of `tensor` as text, e.g. "{devices=[4,1]0,1,2,3}", "{replicated}", "" (unannotated)."""
    import torch_xla

    # Public: only XLAShardedTensor.sharding_spec, which needs the tensor wrapped (a tensor subclass) first.
    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def local_shards(tensors: list[torch.Tensor]) -> list[list[tuple[torch.Tensor, str]]]:
    """Per tensor, each addressable device's shard as (CPU copy, device name), padding included."""
    import torch_xla

    # Public: XLAShardedTensor.local_shards, one wrapped tensor at a time; this takes a list in one call.
    return torch_xla._XLAC._get_local_shards(tensors)


def local_shard_places(tensors: list[torch.Tensor]) -> list[list[tuple[int, list]]]:
    """Per tensor, each local shard's (replica id, index into the whole tensor), in local_shards' order."""
    import torch_xla

    # Public: XLAShardedTensor.local_shards (as XLAShard.indices), one wrapped tensor at a time.
    return torch_xla._XLAC._get_local_shard_replica_and_indices(tensors)


def tpu_chip_count() -> int:
    """TPU chips attached to this host (a PCI scan: no runtime starts, no chip is claimed)."""
    from torch_xla._internal import tpu

    # Public: xr.global_runtime_device_count and torch_xla.device_count start the runtime and claim the chips.
    return tpu.num_available_chips()
