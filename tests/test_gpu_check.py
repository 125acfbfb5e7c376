"""benchmarks/gpu_check.py (issue 46 item 5), the script a session runs when it is lent a GPU, run end to end on
the CPU at its tiny shape: every stage in its own process, each recorded with exit code 0, its time and peak
memory, the baselines' tokens/s and the ratios. A benchmark is not a test: this only proves the script runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("setup", "forward", "peft", "cache", "quantize", "train", "eval", "export", "train_graphs", "profile",
          "generate", "train_eager", "train_fp32")


@pytest.mark.slow
@pytest.mark.timeout(900)  # eight processes, each importing torch and transformers
def test_gpu_check_runs_every_stage_on_the_cpu(tmp_path):
    out = tmp_path / "report" / "gpu_check.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--shape", "tiny",
                             "--device", "cpu", "--steps", "3", "--work", str(tmp_path / "work"), "--json", str(out)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads(out.read_text())
    stages = report["stages"]
    assert tuple(stages) == STAGES
    for name, record in stages.items():
        assert record["rc"] == 0 and record["child_rc"] == 0, (name, record)
        assert record["wall_s"] > 0 and record["host_peak_rss_mib"] > 0, (name, record)
        assert record["gpu_peak_mib"] is None, (name, record)  # nothing touched CUDA on a CPU run
    for name in ("forward", "peft", "cache", "train", "train_graphs", "train_eager", "train_fp32", "generate"):
        assert stages[name]["tokens_per_s"] > 0 and 0 < stages[name]["mfu"] < 1, (name, stages[name])
    assert stages["train"]["result"]["steps"] == 3 and stages["train"]["result"]["calibrated_init_s"] is not None
    assert stages["cache"]["result"]["tokens"] > 0 and stages["eval"]["result"]["ppl"] > 0
    assert stages["setup"]["result"]["model_vocab"] > stages["setup"]["result"]["tokenizer_vocab"]  # padded logits
    assert stages["export"]["result"]["format"] == report["export_format"] and stages["export"]["result"]["bytes"] > 0
    assert stages["generate"]["result"]["generated_tokens"] >= 512 and stages["generate"]["result"]["complete"]
    assert all(stages[n]["result"]["steps"] == 3 for n in ("train_graphs", "train_eager", "train_fp32"))
    profile = stages["profile"]["result"]  # on the CPU the host's op times stand in for the device's kernels
    assert profile["profiled_steps"] == 5 and profile["step_ms"] > 0 and profile["top"][0]["ms_per_step"] > 0
    assert (tmp_path / "work" / "logs" / "profile_table.txt").stat().st_size > 0
    assert (tmp_path / "work" / "logs" / "profile_table_cpu.txt").stat().st_size > 0
    assert set(report["ratios"]) == {"train_vs_peft", "cache_vs_forward", "train_vs_train_eager", "train_vs_train_fp32",
                                     "train_eager_vs_peft", "train_fp32_vs_peft", "train_graphs_vs_train",
                                     "train_graphs_vs_peft"}
    assert report["chain_s"] == pytest.approx(sum(stages[k]["wall_s"] for k in ("cache", "quantize", "train", "eval",
                                                                              "export")), abs=0.2)
    assert report["card"] == "cpu" and report["versions"]["torch"] and report["date"]
    assert "train_vs_peft" in result.stdout and "written" in result.stdout


@pytest.mark.slow
def test_a_failed_stage_is_recorded_and_later_stages_go_on_where_they_can(tmp_path):
    """A stage whose command is refused keeps its exit code and one-line error; the stages needing its output are
    skipped with the reason; the script exits 1. Only the forward baseline really runs (forced to fail here)."""
    out = tmp_path / "gpu_check.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--shape", "tiny",
                             "--device", "no-such-device", "--steps", "1", "--work", str(tmp_path / "work"),
                             "--json", str(out), "--skip", "peft", "cache", "export", "--budget-s", "300"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, (result.stdout[-3000:], result.stderr[-3000:])
    stages = json.loads(out.read_text())["stages"]
    assert stages["setup"]["rc"] not in (0, None) and stages["setup"]["error"], stages["setup"]
    assert stages["forward"] == {"rc": None, "skipped": "needs setup"}
    assert stages["peft"]["skipped"] == "--skip" and stages["quantize"]["skipped"] == "needs cache"


def test_a_rerun_replaces_only_its_own_work_folder(tmp_path):
    gpu_check = load_benchmark("gpu_check")
    mine, foreign = tmp_path / "mine", tmp_path / "foreign"
    gpu_check._prepare_work(mine)
    (mine / "model").mkdir()
    gpu_check._prepare_work(mine)  # a rerun starts empty
    assert sorted(p.name for p in mine.iterdir()) == [gpu_check.MARKER, "logs", "stages"]
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit, match="did not write"):
        gpu_check._prepare_work(foreign)
    assert (foreign / "notes.txt").read_text() == "keep"
