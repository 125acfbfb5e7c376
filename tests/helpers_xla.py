"""What the XLA:CPU tests share: skipping where torch_xla is missing, and a script run on XLA:CPU in a process of its
own that reports JSON (the device count, SPMD mode and compile counters are fixed per process; DESIGN §6)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest


def require_torch_xla() -> None:
    """Skip the calling test module where torch_xla is not installed; in CI that is an error instead."""
    if importlib.util.find_spec("torch_xla") is None:
        if os.environ.get("CI"):
            raise RuntimeError("torch_xla is not installed; CI must install the [xla] extra")
        pytest.skip("torch_xla not installed (pip install 'qat-lora[xla]')", allow_module_level=True)


def on_xla(script: str, *args: str, devices: int = 1, timeout: int = 500, cache_home=None) -> dict:
    """Run `script` (Python source, argv = args) on `devices` XLA:CPU devices; its last stdout line is the JSON it
    reports. cache_home: the child's XDG_CACHE_HOME (default: this process's)."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "OMP_NUM_THREADS": "1"}
    if cache_home is not None:
        env["XDG_CACHE_HOME"] = str(cache_home)
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
