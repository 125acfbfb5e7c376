"""benchmarks/position_gap.py: per-band NLL that adds up to `qat-lora eval`'s, on training-side text only."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from qat_lora.data import models
from qat_lora.data import text as data
from qat_lora.train.metrics import perplexity

from conftest import load_benchmark


@pytest.fixture
def position_gap(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # its sibling import
    return load_benchmark("position_gap", "position_gap_bench")


def test_one_band_is_the_perplexity_nll(position_gap, teacher_dir, corpus_dir):
    tokenizer, model = models.load_tokenizer(str(teacher_dir)), models.load_causal_lm(str(teacher_dir)).eval()
    stream = data.token_stream(data.list_text_files([str(corpus_dir)]), tokenizer, 600)
    ids, mask = data.pack(stream, 32, prefix=models.sequence_prefix(tokenizer))
    ids, mask = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))
    whole = perplexity(model, tokenizer, [str(corpus_dir)], 32, 600, 4, torch.device("cpu"))["nll"]
    assert position_gap.band_nll(model, ids, mask, 31) == pytest.approx([whole], rel=1e-5)
    bands = position_gap.band_nll(model, ids, mask, 8)
    # Bands of 8 target positions: 31 = 8 + 8 + 8 + 7; their token-weighted mean is the whole window's.
    counts = [mask[:, 1 + i:1 + min(i + 8, 31)].sum().item() for i in range(0, 31, 8)]
    assert len(bands) == 4 and sum(b * c for b, c in zip(bands, counts)) / sum(counts) == pytest.approx(whole, rel=1e-5)


def test_gaps_recorded_and_evaluation_text_refused(position_gap, tmp_path, monkeypatch, teacher_dir, corpus_dir):
    out = tmp_path / "gap.json"
    position_gap.main(["--model", str(teacher_dir), "--quant", "w2g32", "--student", "rtn=", "--text",
                       str(corpus_dir), "--seq-len", "32", "--band", "16", "--max-tokens", "512", "--json", str(out)])
    record = json.loads(out.read_text())
    assert record["gap_nats"]["teacher"] == [0.0, 0.0] and len(record["nll"]["rtn"]) == 2
    assert all(math.isfinite(g) and g > 0 for g in record["gap_nats"]["rtn"])  # 2-bit RTN loses in every band
    monkeypatch.setenv("QAT_LORA_HOME", str(tmp_path))
    eval_dir = tmp_path / "assets" / "text" / "eval"
    eval_dir.mkdir(parents=True)
    (eval_dir / "wikipedia_leads.txt").write_text("held-out prose " * 50)
    with pytest.raises(SystemExit, match="the evaluation text"):
        position_gap.main(["--model", str(teacher_dir), "--quant", "w2g32", "--student", "rtn=", "--text",
                           str(eval_dir), "--json", str(tmp_path / "g.json")])
    assert not (tmp_path / "g.json").exists()
    with pytest.raises(SystemExit):
        position_gap.main(["--model", str(teacher_dir), "--quant", "w2g32", "--student", "rtn", "--text",
                           str(corpus_dir), "--json", str(tmp_path / "g.json")])
