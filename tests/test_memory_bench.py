"""The real-shape memory benchmark's pure parts (benchmarks/memory_bench.py, issue 29): the configs give the
published parameter counts and exactly the parameters transformers builds, the FLOP count equals the step
harness's on a built model, and the table's formula is the one docs/BENCHMARKS.md states."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("memory_bench")


def test_config_numbers_give_the_published_sizes(bench):
    for name, published in bench.PUBLISHED.items():
        counts = bench.parameter_counts(name)
        # Within one unit of the model card's last digit (Llama-3.2-1B has 1,235,814,400: the card says 1.23B).
        digit = 0.01e9 if published["total"] in (1.23e9, 3.21e9) else 0.1e9
        assert abs(counts["total"] - published["total"]) < digit, (name, counts["total"])
        if "non_embedding" in published:
            assert abs(counts["total"] - counts["embedding"] - published["non_embedding"]) <= 0.05e9, name


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b", "qwen3-1.7b", "llama-3.2-3b"])
def test_counts_match_the_model_transformers_builds(bench, name):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: no memory, no init
        model = AutoModelForCausalLM.from_config(bench.model_config(name, 2, 256))
    counts = bench.parameter_counts(name, layers=2)
    assert sum(p.numel() for p in model.parameters()) == counts["total"]
    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))
    assert linear == counts["linear"]
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied, as in every one of the four


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b"])
def test_lora_count_and_step_flops_equal_the_built_students(bench, name, monkeypatch):
    """The recovery-LoRA student of one layer (a 512-token vocabulary keeps it small: every count is linear in
    V): its trainable parameters are `lora`, and the step harness counts the FLOPs of step_flops_per_token."""
    import sys

    from transformers import AutoModelForCausalLM

    from qat_lora.quant.fake_quant import quantize_
    from qat_lora.train.student import make_trainable_

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_bench import step_flops_per_token

    monkeypatch.setitem(bench.CONFIGS, name, {**bench.CONFIGS[name], "vocab_size": 512})
    model = AutoModelForCausalLM.from_config(bench.model_config(name, 1, 256))
    model = make_trainable_(quantize_(model, bench.QUANT), "recovery-lora", bench.LORA_R)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == bench.parameter_counts(name, 1)["lora"]
    assert bench.step_flops_per_token(name, 1, 256) == step_flops_per_token(model, 256)


@pytest.mark.multiprocess
def test_table_formula_is_the_documented_one(bench):
    p, b, l, v = 1e9, 8, 512, 152064
    logits = 2 * b * l * v * 4  # 5.0 GB: the docs' "B 8, L 512, V 152 k"
    assert logits / 1e9 == pytest.approx(4.98, abs=0.01)
    assert bench.table_bytes("build-fp32", p, b, l, v) == 4 * p + logits
    assert bench.table_bytes("build-bf16", p, b, l, v) == 2 * p + logits
    lora = 16 * 0.006 * p
    assert bench.table_bytes("train-fp32", p, b, l, v) == pytest.approx(8.125 * p + lora)
    assert bench.table_bytes("train-bf16", p, b, l, v) == pytest.approx(2.125 * p + lora)
    assert bench.table_bytes("train-bf16-fp32-compute", p, b, l, v) == bench.table_bytes("train-bf16", p, b, l, v)
    assert bench.table_bytes("fsdp-fp32", p, b, l, v, devices=4) == pytest.approx(8.125 * p / 4 + lora)
    assert bench.table_bytes("fsdp-bf16", p, b, l, v, devices=8) == pytest.approx(2.125 * p / 8 + lora)
    # The docs' v6e rows: 3 B on one chip, fp32 training 24.7 GB; 70 B fsdp bf16 on a v6e-8, 25.3 GB.
    assert bench.table_bytes("train-fp32", 3e9, b, l, v) / 1e9 == pytest.approx(24.7, abs=0.05)
    assert bench.table_bytes("fsdp-bf16", 70e9, b, l, v, devices=8) / 1e9 == pytest.approx(25.3, abs=0.05)


def test_extrapolation_is_linear_in_layers(bench):
    assert bench._extrapolate((2, 10.0), (4, 14.0), 28) == pytest.approx(62.0)
    assert bench._extrapolate((1, 5.0), (2, 7.0), 16) == pytest.approx(35.0)
