"""Numeric policy per device: the autocast dtype a --precision resolves to, the fp32 matmul precision inside a
block (--matmul-precision), and how many positions one lm_head + loss chunk computes at once by default."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from qat_lora.runtime import xla
from qat_lora.runtime.device import is_xla

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
    if is_xla(device) and xla.device_hardware(device) == "TPU":
        return torch.bfloat16
    return None


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


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


# Positions per lm_head + loss chunk when --loss-chunk-size is auto (-1). On the CPU small chunks keep each
# chunk's logits in cache and measured fastest (docs/BENCHMARKS.md). On XLA the chunk loop is unrolled into the
# step's graph: B*L/chunk copies of lm_head + loss + its gradient, so compile time and graph size grow with the
# count; 1024 positions keep the graph short while a chunk's fp32 logits stay small (1024 x 49k x 4 B = 200 MB).
LOSS_CHUNK_CPU, LOSS_CHUNK_ACCELERATOR = 128, 1024


def default_loss_chunk_size(device: torch.device) -> int:
    """--loss-chunk-size auto on `device`: 128 positions on the CPU, 1024 on XLA and CUDA."""
    return LOSS_CHUNK_CPU if device.type == "cpu" else LOSS_CHUNK_ACCELERATOR
