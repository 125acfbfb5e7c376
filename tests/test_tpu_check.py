"""scripts/tpu_check.sh (issue 47, item 7), the script a user runs on a v6e host, run end to end on XLA:CPU with
a tiny teacher: a cache built on 2 chips, training on 1 and on 2 (one SPMD process), a SIGTERM stop and resume,
and the report (graphs compiled, step time, tokens/s, MFU) written as JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers_xla import require_torch_xla

require_torch_xla()
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
@pytest.mark.timeout(1500)  # five XLA processes, each compiling its graphs
def test_tpu_check_runs_every_stage_and_reports_on_xla_cpu(teacher_dir, corpus_dir, tmp_path):
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1", "INSTALL": "0", "PYTHON": sys.executable,
           "MODEL": str(teacher_dir), "DATA": str(corpus_dir), "WORK": str(tmp_path / "check"), "STEPS": "6",
           "BATCH": "2", "SEQ_LEN": "32", "DEVICE": "xla", "CHIPS": "2", "XDG_CACHE_HOME": str(tmp_path / "home")}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "tpu_check.sh")], env=env, capture_output=True,
                            text=True, timeout=1200)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads((tmp_path / "check" / "tpu_check.json").read_text())
    runs = report["runs"]
    assert runs["one"]["chips"] == 1 and runs["all"]["chips"] == 2, runs
    assert runs["stopped"]["steps"] == 18 and 0 < runs["stopped"]["steps_this_process"] < 18, runs  # resumed
    for row in runs.values():
        assert row["graphs_compiled"] >= 1 and row["cpu_fallback_ops"] == [], row
        assert row["tokens_per_s"] > 0 and row["step_s"] > 0 and 0 < row["mfu"] < 1, row
    assert "one " in result.stdout and "mfu=" in result.stdout
    assert (tmp_path / "check" / "cache" / "manifest.json").is_file()
