"""The host process's own tuning: glibc's allocator keeps the step's large short-lived blocks, and OpenMP's idle
threads sleep instead of spinning, for CPUs that other processes share (no torch, no device)."""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping

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



# OpenMP threads that finish a parallel region first spin on the barrier (GNU libgomp's default) before they
# sleep: on a CPU that another process keeps busy, the spinning thread takes the time slice its sibling needs to
# finish the region. The demo's training step on 2 cores with one core kept busy (`yes`) and the machine shared:
# 2 threads 71 s and 41 s per step, 1 thread 16 s and 3.9 s, 2 threads with OMP_WAIT_POLICY=PASSIVE 9.1 s and
# 3.7 s (two rounds; docs/BENCHMARKS.md, the demo). Passive waiting keeps both cores for when they are free.
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


def omp_wait_policy(environ: Mapping[str, str], torch_loaded: bool) -> str | None:
    """The OpenMP wait policy to set for this process: PASSIVE, or None when the user chose one or torch has
    loaded already (OpenMP reads the variable once, when torch's runtime loads)."""
    return None if WAIT_POLICY_ENV in environ or torch_loaded else "PASSIVE"


def prefer_passive_omp_wait_() -> bool:
    """Set OMP_WAIT_POLICY as omp_wait_policy says (call before torch is imported); whether it was set."""
    policy = omp_wait_policy(os.environ, "torch" in sys.modules)
    if policy is not None:
        os.environ[WAIT_POLICY_ENV] = policy
    return policy is not None
