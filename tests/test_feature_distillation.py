"""Feature distillation (`train --hidden-weight`): the student's decoder hidden states pulled toward an online
teacher's. The term must be the relative squared error it documents (against a float64 reference), add to the KD
loss with its weight, vanish for the teacher itself, reach the quantiser's parameters, and be refused where there
are no teacher hidden states to match."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import load_benchmark
from qat_lora.cache.builder import build_cache
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.cache.reader import BASE_KEYS, KDCache
from qat_lora.data import models
from qat_lora.train.config import StudentSpec, TrainConfig
from qat_lora.train.loss import KDLossConfig, forward_loss, hidden_state_loss
from qat_lora.train.student import build_student, make_trainable_
from qat_lora.train.trainer import train


@pytest.fixture(scope="module")
def cache(tmp_path_factory, teacher_dir, corpus_dir):
    out = tmp_path_factory.mktemp("feature-cache")
    build_cache(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(out), seq_len=32,
                                 encoding="topk", top_k=8, max_tokens=1_500, batch_size=8, holdout_fraction=0.1,
                                 device="cpu"), log=lambda _: None)
    return out


def test_hidden_state_loss_is_the_masked_relative_squared_error_over_layers():
    g = torch.Generator().manual_seed(0)
    teacher = tuple(torch.randn(2, 5, 6, generator=g, dtype=torch.float64) * (i + 1) for i in range(4))
    student = tuple((t + 0.3 * torch.randn(t.shape, generator=g, dtype=torch.float64)).requires_grad_()
                    for t in teacher)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    got = hidden_state_loss(student, teacher, mask)
    terms = [((s[b, t] - h[b, t]).pow(2).sum() / h[b, t].pow(2).sum()).item()
             for s, h in zip(student[1:], teacher[1:]) for b in range(2) for t in range(5) if mask[b, t]]
    assert got.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)  # the embeddings (index 0) skipped
    got.backward()
    assert student[0].grad is None or float(student[0].grad.abs().max()) == 0.0
    assert float(student[1].grad[1, 3:].abs().max()) == 0.0 and float(student[1].grad[0].abs().max()) > 0  # masked
    assert hidden_state_loss(teacher, teacher, mask).item() == 0.0
    with pytest.raises(ValueError, match=r"^--hidden-weight: the student has 2 layers, the teacher 3"):
        hidden_state_loss(student[:3], teacher, mask)


@pytest.mark.parametrize("chunk_size", [0, 7])
def test_the_term_adds_to_the_kd_loss_with_its_weight_and_trains_the_grid(cache, teacher_dir, chunk_size):
    batch = {k: v for k, v in next(KDCache(cache).batches("train", 2, shuffle=False)).items() if k in BASE_KEYS}
    teacher = models.load_causal_lm(teacher_dir)
    student = make_trainable_(build_student(StudentSpec(str(teacher_dir), "w2g32")), "qat")
    plain = forward_loss(student, batch, KDLossConfig(), chunk_size, teacher=teacher)
    both = forward_loss(student, batch, KDLossConfig(hidden_weight=0.5), chunk_size, teacher=teacher)
    assert "hidden" not in plain and float(both["hidden"].detach()) > 0.01  # a 2-bit student is far from its teacher
    torch.testing.assert_close(both["loss"], plain["loss"] + 0.5 * both["hidden"], rtol=1e-6, atol=1e-6)
    both["hidden"].backward()  # the term alone reaches the grid's scales
    scales = [p for p in student.parameters() if p.requires_grad]
    assert scales and all(p.grad is not None and float(p.grad.abs().max()) > 0 for p in scales)
    itself = forward_loss(teacher, batch, KDLossConfig(hidden_weight=1.0), chunk_size, teacher=teacher)
    assert float(itself["hidden"]) < 1e-10


def test_a_run_with_hidden_weight_trains_and_records_it(tmp_path, cache, teacher_dir):
    summaries = [train(TrainConfig(model=str(teacher_dir), cache=str(cache), quant="w2g32", preset="qat",
                                   out=str(tmp_path / str(w)), max_steps=2, batch_size=2, warmup_steps=1, lr=1e-3,
                                   log_steps=1, device="cpu", online_teacher=str(teacher_dir), hidden_weight=w),
                       log=lambda _: None) for w in (0.0, 1.0)]
    losses = [[json.loads(line)["loss"] for line in (tmp_path / str(w) / "metrics.jsonl").read_text().splitlines()
               if "loss" in json.loads(line)] for w in (0.0, 1.0)]
    assert losses[1][0] > losses[0][0]  # the same first batch, plus the hidden-state term
    assert json.loads((tmp_path / "1.0" / "config.json").read_text())["hidden_weight"] == 1.0
    assert all(s["steps"] == 2 for s in summaries)


@pytest.mark.parametrize("fields, message", [
    (dict(hidden_weight=1.0), r"^--hidden-weight: needs --online-teacher"),
    (dict(online_teacher="TEACHER", hidden_weight=-1.0), r"^--hidden-weight -1.0: must be >= 0"),
])
def test_flag_errors_are_one_line(teacher_dir, fields, message):
    fields = {k: str(teacher_dir) if v == "TEACHER" else v for k, v in fields.items()}
    with pytest.raises(ValueError, match=message):
        TrainConfig(model=str(teacher_dir), quant="w2g32", **fields)


def test_a_teacher_of_another_depth_is_refused_before_training(tmp_path, cache, teacher_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    config = AutoModelForCausalLM.from_pretrained(teacher_dir).config
    config.num_hidden_layers = 3
    deeper = tmp_path / "deeper"
    AutoModelForCausalLM.from_config(config).save_pretrained(deeper)
    tokenizer.save_pretrained(deeper)
    with pytest.raises(ValueError, match=r"^--hidden-weight 1.0: --online-teacher .* has \(layers, width\) \(3, 64\)"):
        train(TrainConfig(model=str(teacher_dir), cache=str(cache), quant="w2g32", preset="qat", out=str(tmp_path / "r"),
                          max_steps=1, batch_size=2, device="cpu", online_teacher=str(deeper), hidden_weight=1.0),
              log=lambda _: None)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_recovery_bench_passes_it_to_online_methods_only(tmp_path, teacher_dir):
    bench = load_benchmark("recovery")
    args = bench.build_parser().parse_args(["--teacher", str(teacher_dir), "--methods", "qat", "--hidden-weight", "1"])
    with pytest.raises(ValueError, match=r"^--hidden-weight: needs the teacher in the step, and qat trains"):
        bench.validate(args)
    record = {"stages": [{"lr": 5e-4, "weight_lr": 1e-3, "hidden_weight": 0.5}]}
    assert bench._lrs(record) == "0.0005 (w 0.001) feat. 0.5"


def test_recovery_bench_refuses_a_negative_weight_in_one_line(teacher_dir):
    bench = load_benchmark("recovery")
    args = bench.build_parser().parse_args(["--teacher", str(teacher_dir), "--methods", "qat-online",
                                            "--hidden-weight", "-1"])
    with pytest.raises(ValueError, match=r"^--hidden-weight -1.0: must be >= 0"):
        bench.validate(args)
