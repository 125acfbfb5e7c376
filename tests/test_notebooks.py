"""The notebooks in notebooks/ run headless, top to bottom, on the CPU (issue 16): each in its own kernel with the
tiny teacher and corpus of conftest.py, its knobs overridden by a cell injected after the `parameters` cell, and
XLA:CPU (PJRT_DEVICE=CPU, CPU_NUM_DEVICES) wherever the notebook trains on XLA. A notebook passes when no cell
errors and the artefacts it promises are on disk. The stored notebooks carry no outputs and no local paths.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path

import pytest

from conftest import synthetic_text

pytestmark = pytest.mark.notebook  # every test here reads or executes notebooks/

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 900

nbformat = pytest.importorskip("nbformat", reason="pip install 'qat-lora[dev]' (nbformat, nbclient, ipykernel)")


def _parameters_index(nb) -> int:
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "a notebook has exactly one cell tagged `parameters`"
    return tagged[0]


def _execute(name: str, workdir: Path, params: dict, devices: int = 1) -> tuple[Path, float]:
    """Run notebooks/`name` in `workdir` with `params` injected; returns (WORK_DIR, seconds)."""
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    injected = "\n".join(f"{key} = {value!r}" for key, value in params.items())
    nb.cells.insert(_parameters_index(nb) + 1, nbformat.v4.new_code_cell("# injected by the test\n" + injected))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "TQDM_MININTERVAL": "5"}
    for key in ("COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE"):  # the install cell must take the local path
        env.pop(key, None)
    started = time.perf_counter()
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    client.execute(env=env)
    seconds = time.perf_counter() - started
    (workdir / "executed.ipynb").write_text(nbformat.writes(nb))  # for a failure's post-mortem
    print(f"{name}: executed in {seconds:.0f} s")
    return workdir / params["WORK_DIR"], seconds


@pytest.fixture(scope="module")
def tiny(corpus_dir, teacher_dir, tmp_path_factory) -> dict:
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    eval_text = tmp_path_factory.mktemp("eval") / "heldout.txt"
    eval_text.write_text(synthetic_text(20, seed=7))
    return {"MODEL": str(teacher_dir), "TEXT_DIR": str(corpus_dir), "EVAL_TEXT": str(eval_text), "WORK_DIR": "work",
            "SEQ_LEN": 32, "NUM_SAMPLES": 16, "TOP_K": 8, "CACHE_TOKENS": 3_000, "CALIB_SEQUENCES": 8, "BATCH_SIZE": 2, "LORA_R": 4,
            "EVAL_TOKENS": 256, "MAX_NEW_TOKENS": 8}


def _xla_or_skip() -> None:
    if importlib.util.find_spec("torch_xla") is None:
        if os.environ.get("CI"):
            raise RuntimeError("torch_xla is not installed; CI must install the [xla] extra")
        pytest.skip("torch_xla not installed (pip install 'qat-lora[xla]')")


def _assert_chain(work: Path, run: Path) -> dict:
    """The artefacts every chain notebook promises: cache, adapter, curves, results table, export, generated text."""
    manifest = json.loads((work / "cache" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["tokens"] > 0
    assert manifest["encoding"] == {"name": "sampled", "num_samples": 16}  # the notebooks' default targets
    assert (run / "adapter" / "adapter_model.safetensors").stat().st_size > 0
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((work / "results.json").read_text())
    assert [r["model"] for r in results["rows"]] == ["teacher", f"PTQ {'w3g64'}", "recovered"]
    assert all(r["ppl"] > 1 for r in results["rows"])
    assert "| recovered |" in (work / "results.md").read_text()
    export = work / "export"
    assert (export / "export.json").exists() and (export / "packed").is_dir()
    assert (export / "dense" / "config.json").exists() and (export / "adapter" / "adapter_config.json").exists()
    assert len((work / "generated.txt").read_text().strip()) > 0
    return results


@pytest.mark.slow
def test_01_quickstart_runs_the_chain_on_the_cpu(tmp_path, tiny):
    work, _ = _execute("01_quickstart.ipynb", tmp_path, {**tiny, "DEVICE": "cpu", "MAX_STEPS": 6, "EVAL_STEPS": 3})
    run = work / "run-w3g64"
    _assert_chain(work, run)
    assert (work / "init-w3g64-gptq" / "quantizer.safetensors").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["device"] == "cpu"
    assert json.loads((run / "config.json").read_text())["lr"] == 8e-3  # LR = 0: SmolLM2's 2e-3 at r16, x 16 / 4
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert [e["step"] for e in evals] == [3, 6]  # the eval curve the plot cell draws


@pytest.mark.slow
@pytest.mark.xla
def test_02_tpu_single_chip_stops_resumes_and_reports_compiles_on_xla(tmp_path, tiny):
    _xla_or_skip()
    # Enough steps after the first checkpoint that the stop lands mid-run; evaluations on the CPU keep it short.
    work, _ = _execute("02_tpu_single_chip.ipynb", tmp_path,
                       {**tiny, "DEVICE": "xla", "EVAL_DEVICE": "cpu", "MAX_STEPS": 24, "SAVE_STEPS": 4,
                        "EVAL_STEPS": 12, "TEACHER_DTYPE": "bf16", "STORAGE_DTYPE": "bf16"})
    run = work / "run-w3g64"
    _assert_chain(work, run)
    manifest = json.loads((work / "cache" / "manifest.json").read_text())
    assert manifest["teacher_dtype"] == "bf16"
    resume = json.loads((work / "resume.json").read_text())
    assert resume["stop_exit_code"] == 143, resume  # SIGTERM: checkpoint saved, then exit 143
    assert resume["steps"] == 24 and 0 < resume["steps_after_resume"] < 24, resume
    report = json.loads((run / "compile_report.json").read_text())
    assert {"graphs_compiled", "graphs_compiled_after_step_2", "compile_seconds", "uncached_compiles",
            "cpu_fallback_ops"} <= set(report)  # the keys the notebook reads
    assert any((work / "xla-cache").iterdir())  # the persistent compile cache was written
    config = json.loads((run / "config.json").read_text())
    assert config["device"] == "xla" and config["storage_dtype"] == "bf16"


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_03_multi_chip_builds_on_two_devices_trains_spmd_and_plots_throughput(tmp_path, tiny):
    _xla_or_skip()
    work, _ = _execute("03_multi_chip.ipynb", tmp_path,
                       {**tiny, "DEVICE": "xla", "NUM_CHIPS": 2, "MODES": ["spmd"], "MAX_STEPS": 24,
                        "SAVE_STEPS": 4}, devices=2)
    manifest = json.loads((work / "cache" / "manifest.json").read_text())
    assert manifest["world_size"] == 1  # on XLA one SPMD process builds over the 2 devices
    resume = json.loads((work / "resume.json").read_text())
    assert resume["stop_exit_code"] == 143 and 0 < resume["steps_after_resume"] < resume["steps"] == 24, resume
    for run in ("run-1chip", "run-2chips-spmd"):
        summary = json.loads((work / run / "summary.json").read_text())
        assert summary["steps"] == 24
        assert (work / run / "adapter" / "adapter_model.safetensors").exists()
    assert json.loads((work / "run-2chips-spmd" / "summary.json").read_text())["world_size"] == 2
    throughput = json.loads((work / "throughput.json").read_text())
    assert set(throughput) == {"1 chip", "2 chips spmd"} and all(v > 0 for v in throughput.values())
    assert (work / "throughput.png").read_bytes()[:4] == b"\x89PNG"


# Local paths a stored notebook must not carry (Colab's own /content/drive is fine: it is the same everywhere).
_LOCAL_PATH = re.compile(r"(?<![\w.])(/home/|/Users/|/tmp/|/work/|/root/|/var/|[A-Z]:\\\\)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_notebook_is_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    _parameters_index(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "strip outputs before committing"
    text = path.read_text()
    assert not _LOCAL_PATH.search(text), f"{path.name}: a local absolute path: {_LOCAL_PATH.search(text).group()}"
    assert not re.search(r"(?i)(api[_-]?key|token\s*=\s*['\"][A-Za-z0-9_]{16,}|hf_[A-Za-z0-9]{20,})", text)


def test_there_are_three_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_tpu_single_chip.ipynb", "03_multi_chip.ipynb"]


def _install_cell(path: Path) -> str:
    cells = [c.source for c in nbformat.read(path, as_version=4).cells if "IN_COLAB =" in c.source]
    assert len(cells) == 1, f"{path.name}: one install cell"
    return cells[0]


_REAL_FIND_SPEC = importlib.util.find_spec


def _run_install_cell(monkeypatch, env: dict, installed_xla: str | None, colab: bool = False,
                      qat_lora_installed: bool = True) -> list[list[str]]:
    """Execute the install cell with pip intercepted; returns the pip requirement lists it would install."""
    import importlib.metadata
    import importlib.util
    import subprocess
    import sys
    import types

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, check: calls.append(cmd[cmd.index("-q") + 1:]))
    for key in ("COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)

    def find_spec(name, *args):
        if name == "torch_xla":
            return object() if installed_xla else None
        if name == "qat_lora" and not qat_lora_installed:
            return None
        return _REAL_FIND_SPEC(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed_xla)
    exec(_install_cell(NOTEBOOKS[0]), {"QAT_LORA_REQUIREMENT": "qat-lora[gguf,plot]", "print": lambda *a: None})
    return calls


def test_install_cell_pins_torch_xla_to_the_runtimes_torch(monkeypatch):
    import torch

    version = torch.__version__.split("+")[0]
    # A laptop / CI: nothing installed.
    assert _run_install_cell(monkeypatch, {}, installed_xla=None) == []
    # Colab on a TPU without qat-lora or torch-xla: qat-lora (no torch pin of its own), then torch-xla[tpu] at the
    # runtime's torch version with torch pinned to itself, so pip keeps the runtime's torch.
    calls = _run_install_cell(monkeypatch, {"COLAB_TPU_ADDR": "10.0.0.2:8470"}, installed_xla=None, colab=True,
                              qat_lora_installed=False)
    assert calls == [["qat-lora[gguf,plot]"], [f"torch=={version}", f"torch-xla[tpu]=={version}"]]
    # A TPU VM whose torch-xla matches torch: nothing to do; one of another minor version: replaced.
    assert _run_install_cell(monkeypatch, {"TPU_ACCELERATOR_TYPE": "v6e-8"}, installed_xla=version) == []
    major, minor = version.split(".")[:2]
    other = f"{major}.{int(minor) - 1}.0"
    assert _run_install_cell(monkeypatch, {"TPU_ACCELERATOR_TYPE": "v6e-1"}, installed_xla=other) == [
        [f"torch=={version}", f"torch-xla[tpu]=={version}"]]


def test_notebooks_share_one_install_cell():
    assert len({_install_cell(p) for p in NOTEBOOKS}) == 1
