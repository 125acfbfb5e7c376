"""export on a device (issue 46): --device and --precision reach the held-out report's forwards and the re-snap,
while everything the files hold is computed and written on the host, so they are the same bytes on every device;
a bad value is one line naming the flag, exit 2, as in the other commands."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers_xla import on_xla, require_torch_xla
from qat_lora.commands.cli import main
from qat_lora.runtime import device as dev
from tests.conftest import save_random_adapter

QUANT = "w3g32"
# Every metric of the report: the student and its base, the grid merge (--merge-adapter) and --merge-fp.
REPORT_METRICS = ("kd_kl", "kd_soft_ce", "ppl")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, teacher_dir) -> str:
    path = tmp_path_factory.mktemp("adapter") / "adapter"
    save_random_adapter(teacher_dir, QUANT, path)  # a non-zero B: the merges and the report have work to do
    return str(path)


def _export_argv(teacher_dir, adapter, cache_dir, out: Path, *extra: str) -> list[str]:
    return ["export", "--model", str(teacher_dir), "--quant", QUANT, "--adapter", adapter, "--cache", str(cache_dir),
            "--merge-adapter", "--merge-fp", "--out", str(out), *extra]


def _files(out: Path) -> dict[str, bytes]:
    """{path under out: bytes} of every file an export wrote, its record (which holds the config) left out."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != "export.json"}


def _metrics(out: Path) -> dict[str, float]:
    """{"heldout.student.kd_kl": value, ...}: every number of the held-out report in out/export.json."""
    adapter = json.loads((out / "export.json").read_text())["adapter"]
    parts = {"heldout.student": adapter["heldout"]["student"], "heldout.base": adapter["heldout"]["base"],
             "merge": adapter["merge"]["merged"], "merge_fp": adapter["merge_fp"]["merged"]}
    return {f"{part}.{key}": values[key] for part, values in parts.items() for key in REPORT_METRICS}


def _default_is_the_cpu() -> bool:
    # --device auto picks a TPU or CUDA first (asked without starting any runtime)
    return not torch.cuda.is_available() and not dev.wants_xla("auto")


def test_cpu_device_writes_the_same_files_and_report_as_the_default(teacher_dir, adapter, cache_dir, tmp_path):
    default, cpu = tmp_path / "default", tmp_path / "cpu"
    assert main(_export_argv(teacher_dir, adapter, cache_dir, default)) == 0
    assert main(_export_argv(teacher_dir, adapter, cache_dir, cpu, "--device", "cpu", "--precision", "fp32")) == 0
    written = _files(cpu)
    assert {"packed/model.safetensors", "dense/model.safetensors", "merged-fp/model.safetensors"} <= set(written)
    assert written == _files(default)  # byte for byte, whatever device the default resolves to
    config = json.loads((cpu / "export.json").read_text())["config"]
    assert (config["device"], config["precision"]) == ("cpu", "fp32")
    if _default_is_the_cpu():  # the same forwards on the same device: the same numbers, exactly
        assert _metrics(cpu) == _metrics(default)


def test_resnap_trains_on_the_export_device_and_precision(teacher_dir, adapter, cache_dir, tmp_path):
    out = tmp_path / "e"
    argv = ["export", "--model", str(teacher_dir), "--quant", QUANT, "--adapter", adapter, "--cache", str(cache_dir),
            "--merge-adapter", "--resnap-steps", "2", "--format", "packed", "--out", str(out), "--device", "cpu",
            "--precision", "fp32"]
    assert main(argv) == 0
    run = json.loads((out / "resnap" / "run" / "config.json").read_text())  # the trainer's own record of its config
    assert (run["device"], run["precision"]) == ("cpu", "fp32")
    assert json.loads((out / "export.json").read_text())["adapter"]["merge"]["resnap"]["steps"] == 2


def test_resnap_passes_the_device_on_rather_than_leaving_it_to_the_trainer(teacher_dir, adapter, cache_dir, tmp_path,
                                                                          monkeypatch):
    from qat_lora.export import exporter

    seen = []

    def no_training(cfg, log):  # the stage stops at the trainer's door: the config it was handed is the point
        seen.append(cfg)
        raise ValueError("stop here")

    monkeypatch.setattr(exporter, "train", no_training)
    argv = ["export", "--model", str(teacher_dir), "--quant", QUANT, "--adapter", adapter, "--cache", str(cache_dir),
            "--merge-adapter", "--resnap-steps", "5", "--format", "packed", "--out", str(tmp_path / "e"),
            "--device", "cpu", "--precision", "bf16"]
    assert main(argv) == 2
    assert [(c.device, c.precision, c.max_steps) for c in seen] == [("cpu", "bf16", 5)]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("flags,message", [
    (["--device", "gpu"], "--device 'gpu': choose one of auto, cpu, cuda, xla, tpu"),
    (["--precision", "fp16"], "--precision 'fp16': choose one of auto, fp32, bf16"),
])
def test_a_bad_device_or_precision_is_one_line_and_exit_2_as_in_eval(flags, message, teacher_dir, adapter, cache_dir,
                                                                     tmp_path, capsys):
    out = tmp_path / "e"
    assert main(_export_argv(teacher_dir, adapter, cache_dir, out, *flags)) == 2
    assert _one_line(capsys) == f"qat-lora export: error: {message}"
    assert not out.exists()  # refused before anything loads or is written
    eval_argv = ["eval", "--model", str(teacher_dir), "--quant", QUANT, "--cache", str(cache_dir), *flags]
    assert main(eval_argv) == 2 and _one_line(capsys) == f"qat-lora eval: error: {message}"  # the same words


@pytest.mark.parametrize("flag,value", [("--device", "cpu"), ("--precision", "bf16")])
def test_device_and_precision_without_a_cache_are_refused_as_doing_nothing(flag, value, teacher_dir, tmp_path,
                                                                          capsys):
    out = tmp_path / "e"
    argv = ["export", "--model", str(teacher_dir), "--quant", QUANT, "--out", str(out), flag, value]
    assert main(argv) == 2
    line = _one_line(capsys)
    assert line.startswith(f"qat-lora export: error: {flag}: needs --cache ("), line
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_a_device_this_host_lacks_fails_before_an_earlier_export_is_touched(teacher_dir, adapter, cache_dir, tmp_path,
                                                                           capsys):
    out = tmp_path / "e"
    assert main(["export", "--model", str(teacher_dir), "--quant", QUANT, "--format", "packed", "--out", str(out)]) == 0
    before = {**_files(out), "export.json": (out / "export.json").read_bytes()}
    capsys.readouterr()
    assert main(_export_argv(teacher_dir, adapter, cache_dir, out, "--format", "packed", "--overwrite",
                             "--device", "cuda")) == 2
    assert _one_line(capsys).startswith("qat-lora export: error: --device cuda: no CUDA device is visible")
    assert {**_files(out), "export.json": (out / "export.json").read_bytes()} == before


ON_XLA = """
import json, sys
from qat_lora.commands.cli import main
from qat_lora.runtime import xla

code = main(sys.argv[1:])
print(json.dumps({"code": code, "graphs": xla.compile_metrics().get("graphs_compiled", 0)}))
"""


@pytest.mark.slow
@pytest.mark.xla
def test_heldout_report_on_an_xla_device_matches_the_cpu_and_writes_the_same_files(teacher_dir, adapter, cache_dir,
                                                                                  tmp_path):
    require_torch_xla()
    cpu, xla_out = tmp_path / "cpu", tmp_path / "xla"
    assert main(_export_argv(teacher_dir, adapter, cache_dir, cpu, "--device", "cpu")) == 0
    result = on_xla(ON_XLA, *_export_argv(teacher_dir, adapter, cache_dir, xla_out, "--device", "xla"))
    assert result["code"] == 0 and result["graphs"] > 0, result  # the forwards really ran through XLA
    expected, measured = _metrics(cpu), _metrics(xla_out)
    assert measured == pytest.approx(expected, rel=1e-4), (measured, expected)
    assert _files(xla_out) == _files(cpu)  # the model came back to the host before anything was written
