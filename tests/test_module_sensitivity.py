"""benchmarks/module_sensitivity.py: rows measured on training-side text, never on the evaluation text."""
from __future__ import annotations

import json
import math

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def sensitivity():
    return load_benchmark("module_sensitivity", "module_sensitivity_bench")


def test_rows_on_training_text(sensitivity, tmp_path, teacher_dir, corpus_dir):
    out = tmp_path / "sens.json"
    sensitivity.main(["--model", str(teacher_dir), "--quant", "w2g32", "--text", str(corpus_dir), "--seq-len", "32",
                      "--max-tokens", "512", "--patterns", "*", "*.v_proj", "--json", str(out)])
    record = json.loads(out.read_text())
    rows = {r["restored"]: r for r in record["rows"]}
    assert set(rows) == {"nothing", "*", "*.v_proj"} and all(math.isfinite(r["ppl"]) for r in rows.values())
    # Every linear back at the teacher's weights is the teacher: below the 2-bit student.
    assert rows["*"]["ppl"] < rows["nothing"]["ppl"] and rows["*.v_proj"]["layers"] > 0
    assert record["text"] and all(str(corpus_dir) in t for t in record["text"])


def test_refuses_the_evaluation_text(sensitivity, tmp_path, monkeypatch, teacher_dir):
    monkeypatch.setenv("QAT_LORA_HOME", str(tmp_path))
    eval_dir = tmp_path / "assets" / "text" / "eval"
    eval_dir.mkdir(parents=True)
    (eval_dir / "wikipedia_leads.txt").write_text("held-out prose " * 50)
    with pytest.raises(SystemExit, match="the evaluation text"):
        sensitivity.main(["--model", str(teacher_dir), "--text", str(eval_dir), "--json", str(tmp_path / "s.json")])
    assert not (tmp_path / "s.json").exists()
    with pytest.raises(SystemExit, match="no such file"):
        sensitivity.main(["--model", str(teacher_dir), "--text", str(tmp_path / "missing"),
                          "--json", str(tmp_path / "s.json")])
