"""What the long stages show and write beside their work: OpenMP threads that sleep rather than spin on a shared
CPU, the per-layer bar of GPTQ and the calibrated LoRA start, the adapter's own README.md, and no torch_xla warning
from a CPU-only fetch-assets."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qat_lora.data.models import load_causal_lm
from qat_lora.quant import blocks
from qat_lora.quant.fake_quant import quantize_
from qat_lora.quant.gptq import gptq_
from qat_lora.runtime import host
from qat_lora.train.adapter import ADAPTER_CARD, base_record


@pytest.mark.parametrize("environ, torch_loaded, policy", [
    ({}, False, "PASSIVE"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, False, None),  # the user's choice stands
    ({}, True, None),  # too late: OpenMP read the environment when torch loaded
])
def test_openmp_threads_wait_passively_unless_the_user_chose_or_torch_has_loaded(environ, torch_loaded, policy):
    assert host.omp_wait_policy(environ, torch_loaded) == policy


@pytest.mark.slow
def test_the_cli_sets_the_wait_policy_before_torch_loads_its_openmp_runtime():
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}, "OMP_DISPLAY_ENV": "TRUE"}
    out = subprocess.run([sys.executable, "-m", "qat_lora", "presets"], env=env, capture_output=True, text=True,
                         check=True)
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in out.stderr  # what libgomp itself read at start-up


def test_layer_bar_counts_each_decoder_layer_once_and_not_the_capture(teacher_dir, cache_dir, capsys):
    from qat_lora.quant.calibration import calibration_batches

    model = quantize_(load_causal_lm(teacher_dir), "w3g64")
    layers = len(blocks.decoder_layers(model))
    lines: list[str] = []
    with blocks.layer_progress(model, "gptq init") as above:
        gptq_(model, calibration_batches(str(cache_dir), 8, 4), log=above(lines.append))  # its lines above the bar
    err = capsys.readouterr().err
    assert len(lines) == layers + 1 and lines[0].startswith("gptq layer 0:")
    assert lines[-1].startswith("gptq phases: capture ")  # where the pass's time went
    assert "gptq init: 100%" in err and f"{layers}/{layers}" in err
    assert f"{layers - 1}/{layers}" in err.split(f"{layers}/{layers}")[0]  # the last layer started before the end
    with blocks.layer_progress(model, "quiet", disable=True):
        blocks.capture_block_inputs(model, calibration_batches(str(cache_dir), 4, 4))
    assert "quiet" not in capsys.readouterr().err and not any(
        layer_child._forward_pre_hooks for layer in blocks.decoder_layers(model) for layer_child in layer.children())


def test_a_saved_adapter_names_its_real_base_not_the_full_precision_model(tmp_path, teacher_dir):
    from qat_lora.train.config import StudentSpec
    from qat_lora.train.student import build_student, make_trainable_, save_adapter

    quantizer = tmp_path / "quantizer.safetensors"
    quantizer.write_bytes(b"stand-in")  # base_record reads its sha256 only
    model = make_trainable_(build_student(StudentSpec(str(teacher_dir), "w3g64")), "recovery-lora", 4, 8.0)
    save_adapter(model, tmp_path / "adapter", base=base_record("w3g64", str(quantizer), tmp_path / "adapter"))
    card = (tmp_path / "adapter" / ADAPTER_CARD).read_text()
    assert "rank-4 LoRA adapter" in card and "`w3g64` preset" in card and str(quantizer) in card
    assert f"--model {teacher_dir} --quant w3g64 --quantizer {quantizer} --adapter" in card
    assert "[More Information Needed]" not in card  # PEFT's template is gone
    save_adapter(model, tmp_path / "plain")  # no base recorded (an export's adapter): says where the base is
    assert "exported beside it" in (tmp_path / "plain" / ADAPTER_CARD).read_text()


@pytest.mark.slow
def test_converting_a_teacher_on_the_cpu_keeps_torch_xla_unloaded(tmp_path):
    # transformers' GGUF loading imports accelerate, which imports torch_xla when it is installed: a warning
    # ("Defaulting to PJRT_DEVICE=CPU") and seconds, on a command that asked for no XLA device.
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "USE_TORCH_XLA")}
    probe = ("import sys; from pathlib import Path; from qat_lora.data import teachers\n"
             f"try: teachers.convert_gguf_teacher(Path({str(tmp_path / 'missing.gguf')!r}), Path('out'), log=print)\n"
             "except Exception: pass\n"
             "import transformers.modeling_utils, peft; print('torch_xla' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False" and "PJRT" not in out.stderr
