"""Device specifics, in one place: choice and per-process binding, host allocator, autocast, graph cuts,
step closures, batched device-to-host transfers, matmul precision, what an op lowers to (generators,
searchsorted), compile counters and cache, memory figures, activation checkpointing.

torch_xla is imported lazily, only when the XLA device is asked for, so the library imports on machines
without it. Components stay device-agnostic and call these helpers; the collectives of several processes
live in distributed.py, and how processes are started in launch.py.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from typing import Callable, Iterator, Sequence

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "xla", "tpu")


def xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


_XLA_OFF = "USE_TORCH_XLA"  # accelerate and transformers import torch_xla when it is installed, unless this is 0


def keep_torch_xla_unloaded() -> None:
    """Before loading a model on a run that has not asked for an XLA device: keep accelerate from importing
    torch_xla, whose import alone warns "Defaulting to PJRT_DEVICE=CPU" and costs seconds. `resolve_device`
    lifts it when an XLA device is asked for later in the same process."""
    if "torch_xla" not in sys.modules and "PJRT_DEVICE" not in os.environ:
        os.environ.setdefault(_XLA_OFF, "0")


def tpu_present() -> bool:
    # Cheap checks that need no runtime start: a TPU VM sets these or exposes /dev/accel*.
    return os.environ.get("PJRT_DEVICE", "").upper() == "TPU" or os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")


def resolve_device(name: str = "auto") -> torch.device:
    """Map a --device value to a torch.device.

    auto picks a TPU (through torch_xla), then CUDA, then the CPU. `xla` is any PJRT device
    (PJRT_DEVICE=CPU gives XLA on the host CPU, which is how the XLA path is tested without a TPU).

    Raises:
        ValueError: unknown name, or an explicit device that is not available here.
    """
    if name not in DEVICE_CHOICES:
        raise ValueError(f"--device {name!r}: choose one of {', '.join(DEVICE_CHOICES)}")
    if name == "auto":
        if xla_available() and tpu_present():
            name = "tpu"
        elif torch.cuda.is_available():
            name = "cuda"
        else:
            name = "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch; use --device cpu or auto")
    if name in ("xla", "tpu"):
        if not xla_available():
            raise ValueError(f"--device {name}: torch_xla is not installed; pip install 'qat-lora[xla]' "
                             "(torch-xla X.Y needs torch X.Y)")
        if name == "tpu" and not tpu_present():
            raise ValueError("--device tpu: no TPU found on this host; use --device xla with PJRT_DEVICE=CPU to test XLA")
        os.environ.setdefault("PJRT_DEVICE", "TPU" if name == "tpu" else "CPU")
        if os.environ.get(_XLA_OFF) == "0":
            del os.environ[_XLA_OFF]
        import torch_xla

        return torch_xla.device()
    return torch.device(name)


# glibc's malloc hands every block above its mmap threshold (dynamic, <= 32 MiB) to mmap and returns it to the
# kernel on free, and trims the heap top above M_TRIM_THRESHOLD: the step's many short-lived 10-30 MB tensors
# (a chunk of logits, its gradient) then page-fault afresh every time. Measured on the demo step (2-core CPU):
# 10.8 s -> 7.6 s, kernel time 35 s -> 11 s over 8 steps (docs/BENCHMARKS.md).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def tune_host_allocator() -> bool:
    """Keep large freed blocks in glibc's heap instead of returning them to the kernel (Linux/glibc only).

    A no-op, returning False, elsewhere or when the user set any MALLOC_* / GLIBC_TUNABLES variable.
    """
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux") or any(k in os.environ for k in _MALLOC_ENV):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    return all([mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1, mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1,
                mallopt(_M_TOP_PAD, 256 << 20) == 1])


def wants_xla(name: str) -> bool:
    """Whether --device `name` runs through torch_xla (without starting any runtime)."""
    return name in ("xla", "tpu") or (name == "auto" and xla_available() and tpu_present())


def prepare_process(device: torch.device, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """Bind this process to its device and tune the host for it: with several CUDA ranks, rank r drives GPU r
    (LOCAL_RANK); on the CPU, the allocator keeps large blocks (see tune_host_allocator). Returns the device."""
    if device.type == "cpu":
        tune_host_allocator()
    if device.type == "cuda" and world_size > 1:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def is_xla(device: torch.device) -> bool:
    return device.type == "xla"


PRECISIONS = ("auto", "fp32", "bf16")


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """The autocast dtype for `precision` ('auto', 'fp32', 'bf16') on `device`; None means no autocast.

    auto: bf16 on CUDA (when supported) and TPU; fp32 on the CPU, whose bf16 matmuls are slower than fp32
    on hosts without AMX, and on XLA:CPU.
    """
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if is_xla(device) and os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
        return torch.bfloat16
    return None


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def sync(device: torch.device) -> None:
    """Cut the lazy graph on XLA (one call per micro-step); a no-op elsewhere."""
    if is_xla(device):
        import torch_xla

        torch_xla.sync()


def add_step_closure(device: torch.device, fn: Callable[[], None]) -> None:
    """Run `fn` once the current step's values exist: after the next sync on XLA, at once elsewhere.

    Reading tensors inside `fn` (e.g. `.item()`) then costs no extra graph execution on XLA.
    """
    if is_xla(device):
        import torch_xla.core.xla_model as xm

        xm.add_step_closure(fn)
    else:
        fn()


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    if xla_available() and "torch_xla" in sys.modules:
        import torch_xla

        torch_xla.manual_seed(seed)


def compile_metrics() -> dict:
    """XLA counters from torch_xla.debug.metrics: compiles, graph executions, device-to-host transfers, ops that
    fell back to the CPU ({} when torch_xla is not in use)."""
    if "torch_xla" not in sys.modules:
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
        "cpu_fallback_ops": sorted(name for name in met.counter_names() if name.startswith("aten::")),
    }


def compile_metrics_since(before: dict) -> dict:
    """compile_metrics() of what ran after `before` (an earlier compile_metrics()): counts and seconds
    subtracted, CPU fallbacks new since then."""
    now = compile_metrics()
    return {k: (sorted(set(v) - set(before.get(k, ()))) if isinstance(v, list) else v - before.get(k, 0))
            for k, v in now.items()}


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
    import torch_xla
    import torch_xla.runtime as xr

    path = xla_cache_path(setting)
    if torch_xla._XLAC._xla_computation_cache_is_initialized():  # this process compiled already
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


def memory_stats(device: torch.device) -> dict:
    """Memory in MiB for the metrics log: device peak on CUDA, device in use on XLA, process peak RSS on the CPU.

    Host-side queries only: no graph is cut and nothing is read from the device's tensors.
    """
    mib = 2**20
    if device.type == "cuda":
        return {"memory_mib": torch.cuda.max_memory_allocated(device) / mib}
    if is_xla(device):
        import torch_xla.core.xla_model as xm

        try:
            info = xm.get_memory_info(device)
            used = info.get("bytes_used", (info.get("kb_total", 0) - info.get("kb_free", 0)) * 1024)
            return {"memory_mib": used / mib}
        except RuntimeError:  # XLA:CPU has no allocator stats: report the process, as on the CPU
            pass
    import resource

    return {"memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux


def move_model_(model: torch.nn.Module, device: torch.device,
                on_module: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """model.to(device) module by module, keeping tied parameters tied; `on_module` sees each module once its own
    tensors have arrived (fsdp splits them there).

    Why not model.to(device): moving a CPU parameter to an XLA device makes a new Parameter (the tensor types
    differ, so torch cannot swap the data in place), once per module that holds it, so a tied embedding and
    lm_head become two copies on the device (measured: V x hidden x 4 bytes more, 13 % of Qwen3-0.6B).
    """
    # id of a host parameter -> (that parameter, kept alive so its id is not reused; its device copy)
    moved: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
    for module in model.modules():
        params = module._parameters
        tied = {name: moved[id(p)][1] for name, p in params.items() if p is not None and id(p) in moved}
        own = {name: p for name, p in params.items() if p is not None and name not in tied}
        for name in tied:  # hidden from _apply, then pointed at the copy an earlier module made
            params[name] = None
        module._apply(lambda t: t.to(device), recurse=False)
        for name, copy in tied.items():
            params[name] = copy
        for name, before in own.items():
            moved[id(before)] = (before, params[name])
        if on_module is not None:
            on_module(module)
    return model


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached CPU copies of `tensors`, in order. On XLA all of them come in ONE device-to-host transfer, and
    their pending graph runs once for all (a `.cpu()` each would be a transfer each, and may rerun the graph);
    elsewhere one `.cpu()` each (a CPU tensor is returned as it is).
    """
    on_xla = [t.detach() for t in tensors if is_xla(t.device)]
    fetched = iter(())
    if on_xla:
        import torch_xla
        import torch_xla.runtime as xr

        if xr.is_spmd():
            fetched = iter(_from_device_shards(on_xla))
        else:
            fetched = iter(torch_xla._XLAC._xla_get_cpu_tensors(on_xla))  # what xm.save does, minus the pickling
    return [next(fetched) if is_xla(t.device) else t.detach().cpu() for t in tensors]


def _from_device_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """SPMD: run the tensors' pending graph once, then copy each sharded result from every device's own buffer
    into one host tensor. Reading a sharded tensor whole (_xla_get_cpu_tensors) would compile and run a gather
    program on one device for every call: a second graph per batch, and the whole B x L x V on one chip."""
    import torch_xla

    torch_xla._XLAC._xla_sync_multi(tensors, [], True, True)  # wait: the shards are read right after
    out: list[torch.Tensor | None] = [None] * len(tensors)
    sharded = [i for i, t in enumerate(tensors) if "devices=" in torch_xla._XLAC._get_xla_sharding_spec(t)]
    whole = [i for i in range(len(tensors)) if i not in sharded]
    for i, host in zip(whole, torch_xla._XLAC._xla_get_cpu_tensors([tensors[i] for i in whole]) if whole else ()):
        out[i] = host
    if sharded:
        shards = torch_xla._XLAC._get_local_shards([tensors[i] for i in sharded])
        places = torch_xla._XLAC._get_local_shard_replica_and_indices([tensors[i] for i in sharded])
        for i, pieces, where in zip(sharded, shards, places):
            host = torch.empty(tensors[i].shape, dtype=tensors[i].dtype)
            for (piece, _device), (_replica, index) in zip(pieces, where):
                region = host[tuple(index)]
                region.copy_(piece[tuple(slice(0, n) for n in region.shape)])  # an uneven last shard is padded
            out[i] = host
    return out


def state_dict_to_cpu(state: dict) -> dict:
    """Tensors of a state dict moved to the CPU in one transfer (save_pretrained of a model living on XLA fails
    otherwise)."""
    keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
    return {**state, **dict(zip(keys, to_host([state[k] for k in keys])))}


# Positions per lm_head + loss chunk when --loss-chunk-size is auto (-1). On the CPU small chunks keep each
# chunk's logits in cache and measured fastest (docs/BENCHMARKS.md). On XLA the chunk loop is unrolled into the
# step's graph: B*L/chunk copies of lm_head + loss + its gradient, so compile time and graph size grow with the
# count; 1024 positions keep the graph short while a chunk's fp32 logits stay small (1024 x 49k x 4 B = 200 MB).
LOSS_CHUNK_CPU, LOSS_CHUNK_ACCELERATOR = 128, 1024


def default_loss_chunk_size(device: torch.device) -> int:
    """--loss-chunk-size auto on `device`: 128 positions on the CPU, 1024 on XLA and CUDA."""
    return LOSS_CHUNK_CPU if device.type == "cpu" else LOSS_CHUNK_ACCELERATOR


def _narrow_ids(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # int64 ids are emulated on TPU and cost twice the host-to-device bytes; token ids fit in int32.
    return {k: v.to(torch.int32) if v.dtype == torch.int64 else v for k, v in batch.items()}


@contextlib.contextmanager
def device_batches(batches: Iterator[dict[str, torch.Tensor]], device: torch.device, sharding=None):
    """Yields an iterator of `batches` on `device`.

    On XLA through torch_xla's ParallelLoader (what MpDeviceLoader wraps): background threads copy the next
    batches to the device while the current step runs, integer ids as int32, each tensor laid out by
    `sharding` ({name: ShardingSpec}, SPMD) as it is copied. The loader's threads are stopped on exit (a second
    `train()` in the same process leaves none behind). Elsewhere a plain `.to(device)` per batch.
    """
    if not is_xla(device):
        yield ({k: v.to(device, non_blocking=True) for k, v in b.items()} for b in batches)
        return
    import torch_xla.distributed.parallel_loader as pl

    # The loader would cut the graph (torch_xla.sync) before handing out each batch; the trainer cuts it itself,
    # once per micro-step, and a trainable quantiser's Wq is traced before the first batch of a step is taken
    # (quant.quantized_weights_once_per_step): a cut there would make it a graph of its own.
    never_sync = sys.maxsize
    loader = pl.ParallelLoader(map(_narrow_ids, batches), [device], input_sharding=sharding,
                               batches_per_execution=never_sync, loader_prefetch_size=4, device_prefetch_size=2)
    try:
        yield loader.per_device_loader(device)
    finally:
        loader.close()


def searchsorted_is_native(device: torch.device) -> bool:
    """Whether torch.searchsorted runs on `device` itself: XLA has no lowering and falls back to the CPU (a host
    round trip inside the graph), so callers use a compare-and-sum there."""
    return not is_xla(device)


MATMUL_PRECISIONS = ("default", "high", "highest")


@contextlib.contextmanager
def matmul_precision(device: torch.device, precision: str):
    """fp32 matmul precision inside the block, restored after it (the setting is process-wide).

    `default` keeps the backend's own (TPU: one bf16 pass per fp32 matmul; CPU and CUDA: full fp32); `high`
    and `highest` go to torch_xla.backends.set_mat_mul_precision on XLA (TPU: 3 and 6 bf16 passes), to
    torch.set_float32_matmul_precision elsewhere (CUDA: `high` allows TF32).
    """
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"--matmul-precision {precision!r}: choose one of {', '.join(MATMUL_PRECISIONS)}")
    if precision == "default":
        yield
        return
    if is_xla(device):
        import torch_xla.backends as xb

        get, set_ = xb.get_mat_mul_precision, xb.set_mat_mul_precision
    else:
        get, set_ = torch.get_float32_matmul_precision, torch.set_float32_matmul_precision

    def quietly(fn: Callable, *args):  # both warn on every call (torch: a deprecation; torch_xla: "set once")
        import logging
        import warnings

        xla_log = logging.getLogger("torch_xla.backends")
        level = xla_log.level
        xla_log.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return fn(*args)
        finally:
            xla_log.setLevel(level)

    before = quietly(get)
    quietly(set_, precision)
    try:
        yield
    finally:
        quietly(set_, before)


def checkpoint_fn(device: torch.device) -> Callable:
    """Activation checkpointing that really recomputes on this device.

    XLA's compiler would merge a plain recomputation with the forward (common-subexpression elimination)
    and keep the activations alive; torch_xla's own checkpoint prevents that.
    """
    if is_xla(device):
        import torch_xla.utils.checkpoint as xla_checkpoint

        return xla_checkpoint.checkpoint
    import functools
    import torch.utils.checkpoint

    return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
