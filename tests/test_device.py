"""runtime helpers that touch the host process: run in subprocesses (they change process-wide state)."""
import os
import subprocess
import sys

import pytest

_PROBE = "from qat_lora.runtime.host import tune_host_allocator; print(tune_host_allocator())"


def _probe(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt exists only on Linux")
def test_host_allocator_is_tuned_on_glibc_unless_the_user_set_malloc_variables():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    libc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else ""
    assert _probe(env) == ("True" if libc.startswith("glibc") else "False")
    assert _probe({**env, "MALLOC_TOP_PAD_": "0"}) == "False"  # the user's own setting wins, untouched


@pytest.mark.slow
def test_a_cpu_run_neither_imports_torch_xla_nor_warns_about_it(teacher_dir):
    # accelerate imports torch_xla whenever it is installed, which prints "Defaulting to PJRT_DEVICE=CPU" on
    # every plain CPU run; loading a model for the CPU must keep it out.
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "USE_TORCH_XLA")}
    probe = ("import sys; from qat_lora.runtime import device; from qat_lora.data import models; "
             "device.resolve_device('cpu'); "
             f"models.load_causal_lm({str(teacher_dir)!r}); import peft; print('torch_xla' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False" and "PJRT" not in out.stderr
