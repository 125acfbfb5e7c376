"""benchmarks/token_split.py: the per-class gap shares add up to recovery.py's nats share on the same windows."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import load_benchmark, save_random_adapter
from qat_lora.data import models
from qat_lora.train.config import StudentSpec
from qat_lora.train.metrics import perplexity
from qat_lora.train.student import load_student


def test_classes_partition_the_tokens_and_all_matches_the_perplexity_gap(teacher_dir, cache_dir, corpus_dir, tmp_path):
    bench = load_benchmark("token_split")
    adapter = tmp_path / "adapter"
    save_random_adapter(teacher_dir, "w2g32", adapter)
    text = corpus_dir / "a.txt"
    out = tmp_path / "split.json"
    result = bench.main(["--teacher", str(teacher_dir), "--quant", "w2g32", "--adapter", str(adapter), "--cache",
                         str(cache_dir), "--text", str(text), "--eval-tokens", "600", "--seq-len", "64", "--json",
                         str(out)])
    shares = result["texts"]["a.txt"]
    assert json.loads(out.read_text())["texts"] == result["texts"]
    assert shares["seen"]["tokens"] + shares["unseen"]["tokens"] == shares["all"]["tokens"] > 0
    tokenizer = models.load_tokenizer(str(teacher_dir))
    nll = {name: perplexity(load_student(StudentSpec(str(teacher_dir), quant), adapter_dir), tokenizer, [str(text)],
                            64, 600, 4, torch.device("cpu"))["nll"]
           for name, quant, adapter_dir in (("teacher", "", ""), ("start", "w2g32", ""),
                                            ("trained", "w2g32", str(adapter)))}
    expected = (nll["start"] - nll["trained"]) / (nll["start"] - nll["teacher"])
    assert shares["all"]["share_closed"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert shares["all"]["gap_nats_per_token"] == pytest.approx(nll["start"] - nll["teacher"], rel=1e-4)
