"""Which device a run uses and how work reaches it: --device resolved and this process bound to it, graph cuts and
step closures, seeds, the memory figure, moving a model there (tied parameters kept tied) and back (model_on), fixed-shape decoding,
batched device-to-host transfers (to_host), the input pipeline (device_batches: ParallelLoader on XLA), and what an
op or checkpointing lowers to on each device.

Components stay device-agnostic and call these helpers. Precision and autocast live in precision.py, the XLA
runtime (torch_xla on demand, compile counters and cache, every private torch_xla call) in xla.py, the host
allocator in host.py; the collectives of several processes in distributed.py, and how processes start in
runtime/launch.py. torch_xla is imported lazily, only when the XLA device is asked for.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Callable, Iterator, Sequence

import torch

from qat_lora.runtime import host, xla

DEVICE_CHOICES = ("auto", "cpu", "cuda", "xla", "tpu")


def tpu_present() -> bool:
    # Cheap checks that need no runtime start: a TPU VM sets these or exposes /dev/accel*.
    return os.environ.get("PJRT_DEVICE", "").upper() == "TPU" or os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")


def resolve_device(name: str = "auto") -> torch.device:
    """Map a --device value to a torch.device.

    auto picks a TPU (through torch_xla), then CUDA, then the CPU. `xla` is the PJRT device the environment
    names, else the host's TPU, else XLA on the host CPU (PJRT_DEVICE=CPU: how the XLA path is tested without a
    TPU); it never overrides a PJRT_DEVICE already set.

    Raises:
        ValueError: unknown name, or an explicit device that is not available here.
    """
    if name not in DEVICE_CHOICES:
        raise ValueError(f"--device {name!r}: choose one of {', '.join(DEVICE_CHOICES)}")
    if name == "auto":
        if xla.xla_available() and tpu_present():
            name = "tpu"
        elif torch.cuda.is_available():
            name = "cuda"
        else:
            name = "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch; use --device cpu or auto")
    if name in ("xla", "tpu"):
        if not xla.xla_available():
            raise ValueError(f"--device {name}: torch_xla is not installed; pip install 'qat-lora[xla]' "
                             "(torch-xla X.Y needs torch X.Y)")
        if name == "tpu" and not tpu_present():
            raise ValueError("--device tpu: no TPU found on this host; use --device xla with PJRT_DEVICE=CPU to test XLA")
        # --device xla is whatever XLA device the host has: a PJRT_DEVICE already set wins (start_device never
        # changes it), else the TPU of a TPU host, else the host CPU (how XLA is tested without a TPU).
        return xla.start_device("TPU" if name == "tpu" or tpu_present() else "CPU")
    return torch.device(name)


def wants_xla(name: str) -> bool:
    """Whether --device `name` runs through torch_xla (without starting any runtime)."""
    return name in ("xla", "tpu") or (name == "auto" and xla.xla_available() and tpu_present())


def prepare_process(device: torch.device, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """Bind this process to its device and tune the host for it: with several CUDA ranks, rank r drives GPU r
    (LOCAL_RANK); on the CPU, the allocator keeps large blocks (host.tune_host_allocator). Returns the device."""
    if device.type == "cpu":
        host.tune_host_allocator()
    if device.type == "cuda" and world_size > 1:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def is_xla(device: torch.device) -> bool:
    return device.type == "xla"


def sync(device: torch.device) -> None:
    """Cut the lazy graph on XLA (one call per micro-step); a no-op elsewhere."""
    if is_xla(device):
        import torch_xla

        torch_xla.sync()


class PhaseClock:
    """Seconds spent per named phase of a layer-by-layer pass (GPTQ, the calibrated LoRA start). On CUDA the device
    is waited for at each boundary, so queued work lands in the phase that queued it (a few waits per decoder
    layer, never per column or step); elsewhere host time (XLA: no extra graph cut, the pass syncs where it
    reads). `clock.lap("solve")` ends the running phase; `clock.seconds` totals them."""

    def __init__(self, device: torch.device | str | None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.seconds: dict[str, float] = {}
        self._start = self._now()

    def _now(self) -> float:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, phase: str) -> None:
        now = self._now()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._start
        self._start = now

    def summary(self) -> str:
        return ", ".join(f"{name} {value:.1f} s" for name, value in self.seconds.items())


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    if xla.xla_available() and xla.loaded():
        import torch_xla

        torch_xla.manual_seed(seed)


def memory_stats(device: torch.device) -> dict:
    """Memory in MiB for the metrics log: device peak on CUDA, device in use on XLA, process peak RSS on the CPU.

    Host-side queries only: no graph is cut and nothing is read from the device's tensors.
    """
    mib = 2**20
    if device.type == "cuda":
        return {"memory_mib": torch.cuda.max_memory_allocated(device) / mib}
    if is_xla(device):
        used = xla.memory_used_bytes(device)
        if used is not None:  # XLA:CPU has no allocator stats: report the process, as on the CPU
            return {"memory_mib": used / mib}
    import resource

    return {"memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux


def free_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device (the driver's figure plus what torch's allocator holds unused); None
    elsewhere (XLA and the CPU: layer-by-layer passes keep their activations on the host there)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


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


@contextlib.contextmanager
def model_on(model: torch.nn.Module, device: torch.device) -> Iterator[torch.nn.Module]:
    """`model` on `device` inside the block (move_model_), back on the host after it, an error included; a no-op
    on the CPU. For a stage that computes on the device but packs and writes on the host (export's held-out
    report): the host computes everything the files hold, so they are the same bytes whatever the device."""
    if device.type == "cpu":
        yield model
        return
    move_model_(model, device)
    try:
        yield model
    finally:
        move_model_(model, torch.device("cpu"))


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached CPU copies of `tensors`, in order. On XLA all of them come in ONE device-to-host transfer, and
    their pending graph runs once for all (a `.cpu()` each would be a transfer each, and may rerun the graph);
    elsewhere one `.cpu()` each (a CPU tensor is returned as it is).
    """
    on_xla = [t.detach() for t in tensors if is_xla(t.device)]
    fetched = iter(xla.host_copies(on_xla) if on_xla else ())
    return [next(fetched) if is_xla(t.device) else t.detach().cpu() for t in tensors]


def to_host_soon(tensors: Sequence[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
    """Start bringing `tensors` to the host and return the call that ends it (to_host's result), so the device
    computes the next batch while the host waits for, then uses, this one: on XLA their graph is launched now,
    without waiting (the one transfer happens at the call); on CUDA they are copied into pinned host memory
    behind the work already queued, and the call waits for that copy only; on the CPU there is nothing to wait for.
    """
    tensors = [t.detach() for t in tensors]
    if tensors and is_xla(tensors[0].device):
        xla.launch(tensors)
        return lambda: to_host(tensors)
    if tensors and tensors[0].device.type == "cuda":
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
        copied = torch.cuda.Event()
        copied.record()
        return lambda: (copied.synchronize(), host)[1]
    return lambda: to_host(tensors)


def state_dict_to_cpu(state: dict) -> dict:
    """Tensors of a state dict moved to the CPU in one transfer (save_pretrained of a model living on XLA fails
    otherwise)."""
    keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
    return {**state, **dict(zip(keys, to_host([state[k] for k in keys])))}


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
    # (quant/fake_quant.quantized_weights_once_per_step): a cut there would make it a graph of its own.
    never_sync = sys.maxsize
    loader = pl.ParallelLoader(map(_narrow_ids, batches), [device], input_sharding=sharding,
                               batches_per_execution=never_sync, loader_prefetch_size=4, device_prefetch_size=2)
    try:
        yield loader.per_device_loader(device)
    finally:
        loader.close()


# Prompt batches are left-padded to a multiple of this many tokens where decoding has fixed shapes, so a corpus of
# ragged prompts makes a handful of cache sizes (each one graph or one compilation), not one per batch.
PROMPT_BUCKET = 32


def fixed_shape_decoding(device: torch.device) -> bool:
    """Whether generate() decodes with a static KV cache here: on XLA, where every other length is another graph,
    and on CUDA, where transformers then compiles the decode step (torch.compile with CUDA graphs) once per cache
    size. On the CPU the dynamic cache is faster and nothing compiles."""
    return is_xla(device) or device.type == "cuda"


def searchsorted_is_native(device: torch.device) -> bool:
    """Whether torch.searchsorted runs on `device` itself: XLA has no lowering and falls back to the CPU (a host
    round trip inside the graph), so callers use a compare-and-sum there."""
    return not is_xla(device)


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
