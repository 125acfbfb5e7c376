"""`--online-teacher`: the teacher runs inside the step and its whole distribution is the target. It must be the
K = V cached loss exactly (same maths, same tokens), refuse a teacher of another vocabulary, and be part of what a
resume checks."""
from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import load_benchmark, make_model_dir, make_tokenizer, synthetic_text
from helpers_xla import on_xla
from qat_lora.data import models
from qat_lora.cache.reader import BASE_KEYS, KDCache
from qat_lora.cache.builder import build_cache
from qat_lora.train.config import StudentSpec, TrainConfig
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.train.loss import KDLossConfig, forward_loss, full_soft_ce
from qat_lora.train.student import build_student
from qat_lora.train.trainer import train


@pytest.fixture(scope="module")
def full_cache(tmp_path_factory, teacher_dir, corpus_dir, tokenizer):
    """A cache holding the teacher's whole distribution: top-K with K = V at 32 bits."""
    out = tmp_path_factory.mktemp("kv-cache")
    build_cache(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(out), seq_len=32,
                                 encoding="topk", top_k=len(tokenizer), value_bits=32, max_tokens=2_000, batch_size=8,
                                 holdout_fraction=0.1, device="cpu"), log=lambda _: None)
    return out


def test_full_soft_ce_is_the_float64_full_vocabulary_cross_entropy():
    student, teacher = (torch.randn(3, 5, 13, generator=torch.Generator().manual_seed(s), dtype=torch.float64) * 3
                        for s in (0, 1))
    for temperature in (1.0, 2.0):
        soft_ce, kl = full_soft_ce(student, teacher, temperature)
        q = torch.softmax(teacher / temperature, -1)
        reference = -(q * torch.log_softmax(student / temperature, -1)).sum(-1) * temperature**2
        torch.testing.assert_close(soft_ce, reference, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(kl, reference + (q * q.log()).sum(-1) * temperature**2, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("chunk_size", [0, 7])
def test_online_loss_equals_the_k_equal_v_cache_loss(full_cache, teacher_dir, temperature, chunk_size):
    cache = KDCache(full_cache)
    batch = next(cache.batches("train", 3, shuffle=False))
    assert batch["topk_ids"].shape[-1] == cache.vocab_size  # the cache does hold every token's log-prob
    student = build_student(StudentSpec(str(teacher_dir), "w2g32"))  # the quantised teacher: another distribution
    teacher = models.load_causal_lm(teacher_dir)
    cfg = KDLossConfig(temperature=temperature, alpha=0.7)
    cached = forward_loss(student, batch, cfg, chunk_size)
    online = forward_loss(student, {k: batch[k] for k in BASE_KEYS}, cfg, chunk_size, teacher=teacher)
    assert float(cached["kl"].detach()) > 0.05  # a real gap to match, not 0 == 0
    assert ("top1" in online) == ("top1" in cached)  # a training step (with a gradient) computes no top-1
    for key in ("loss", "soft_ce", "kl", "ce", "top1", "kd_tokens"):
        if key in cached:
            torch.testing.assert_close(online[key], cached[key], rtol=1e-5, atol=1e-5, msg=key)
    # The cached targets in a batch are ignored when a teacher is given.
    again = forward_loss(student, batch, cfg, chunk_size, teacher=teacher)
    torch.testing.assert_close(again["loss"], online["loss"], rtol=0, atol=0)


def test_a_bf16_teacher_gives_the_fp32_loss_to_bf16_precision(full_cache, teacher_dir):
    batch = {k: v for k, v in next(KDCache(full_cache).batches("train", 2, shuffle=False)).items() if k in BASE_KEYS}
    student = build_student(StudentSpec(str(teacher_dir), "w2g32"))
    losses = [forward_loss(student, batch, KDLossConfig(), 7, teacher=models.load_causal_lm(teacher_dir, dtype=dtype))
              for dtype in (torch.float32, torch.bfloat16)]
    assert torch.isfinite(losses[1]["loss"]) and losses[1]["soft_ce"].dtype == torch.float32  # the loss stays fp32
    torch.testing.assert_close(losses[1]["kl"], losses[0]["kl"], rtol=0.05, atol=0.01)


def test_a_soft_capped_teacher_is_capped_inside_the_chunk_loop_as_in_its_own_forward(full_cache, teacher_dir,
                                                                                    tokenizer):
    from transformers import AutoModelForCausalLM, Gemma2Config

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.5,
        final_logit_softcapping=2.0, attn_implementation="eager")).eval()  # a cap low enough to bite
    batch = {k: v for k, v in next(KDCache(full_cache).batches("train", 2, shuffle=False)).items() if k in BASE_KEYS}
    student = build_student(StudentSpec(str(teacher_dir), "w2g32"))
    native = forward_loss(student, batch, KDLossConfig(), 0, teacher=teacher)  # Gemma 2's own capped logits
    chunked = forward_loss(student, batch, KDLossConfig(), 7, teacher=teacher)
    torch.testing.assert_close(chunked["kl"], native["kl"].detach(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        uncapped = teacher.lm_head(teacher.model(input_ids=batch["input_ids"]).last_hidden_state)
    assert float(uncapped.abs().max()) > 2.0  # the cap changed the teacher's logits


def _train(out, cache, **kwargs) -> dict:
    return train(TrainConfig(model=kwargs.pop("model"), cache=str(cache), quant="w2g32", out=str(out), max_steps=2,
                             batch_size=2, warmup_steps=1, lr=1e-3, log_steps=1, device="cpu", **kwargs),
                 log=lambda _: None)


def test_two_online_steps_train_the_adapter_a_k_equal_v_cache_trains(tmp_path, full_cache, teacher_dir):
    _train(tmp_path / "cached", full_cache, model=str(teacher_dir))
    _train(tmp_path / "online", full_cache, model=str(teacher_dir), online_teacher=str(teacher_dir))
    cached = load_file(tmp_path / "cached" / "adapter" / "adapter_model.safetensors")
    online = load_file(tmp_path / "online" / "adapter" / "adapter_model.safetensors")
    assert cached.keys() == online.keys()
    for name, tensor in online.items():
        torch.testing.assert_close(tensor, cached[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(float(t.abs().max()) > 1e-4 for k, t in online.items() if "lora_B" in k)  # the steps moved B
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
               if "loss" in json.loads(line)] for run in ("cached", "online")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    config = json.loads((tmp_path / "online" / "config.json").read_text())
    assert config["online_teacher"] == str(teacher_dir) and config["inputs"]["teacher"]


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, full_cache, teacher_dir):
    other = make_model_dir(tmp_path / "other", make_tokenizer(synthetic_text(60, seed=9)), seed=3)
    with pytest.raises(ValueError, match=r"^--online-teacher .*: its tokenizer differs from --model's"):
        _train(tmp_path / "run", full_cache, model=str(teacher_dir), online_teacher=str(other))
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_resume_on_another_teacher_is_refused(tmp_path, full_cache, teacher_dir, tokenizer):
    teacher = tmp_path / "teacher"
    shutil.copytree(teacher_dir, teacher)
    _train(tmp_path / "run", full_cache, model=str(teacher_dir), online_teacher=str(teacher), save_steps=1)
    assert (tmp_path / "run" / "checkpoint-1").is_dir()
    shutil.rmtree(teacher)
    make_model_dir(teacher, tokenizer, seed=5, init_std=0.25)  # same path and shapes, other weights
    with pytest.raises(ValueError, match=r"^--resume: checkpoint-1 was trained on --online-teacher .*contents differ"):
        _train(tmp_path / "run", full_cache, model=str(teacher_dir), online_teacher=str(teacher),
               resume="checkpoint-1", save_steps=1)


@pytest.mark.parametrize("fields, message", [
    (dict(online_teacher_dtype="bf16"), r"^--online-teacher-dtype needs --online-teacher"),
    (dict(online_teacher="TEACHER", online_teacher_dtype="fp16"), r"^--online-teacher-dtype 'fp16': choose"),
    (dict(online_teacher="TEACHER", renormalize_topk=True), r"^--renormalize-topk is a top-K baseline"),
    (dict(online_teacher="./no/such/teacher"), r"^model ./no/such/teacher: no such model folder"),
])
def test_flag_errors_are_one_line(teacher_dir, fields, message):
    fields = {k: str(teacher_dir) if v == "TEACHER" else v for k, v in fields.items()}
    with pytest.raises(ValueError, match=message):
        TrainConfig(model=str(teacher_dir), quant="w2g32", **fields)


ONLINE_ON_XLA = """
import json, sys
from qat_lora.train.config import TrainConfig
from qat_lora.train.trainer import train

teacher, cache, out, online = sys.argv[1:5]  # online: 0 (the cache), 1 (a teacher), 2 (+ its hidden states)
summary = train(TrainConfig(model=teacher, cache=cache, quant="w2g32", out=out, max_steps=4, batch_size=2,
                            warmup_steps=1, log_steps=1, device="xla", attn_implementation="eager",
                            xla_cache_dir="off", online_teacher=teacher if online != "0" else "",
                            hidden_weight=1.0 if online == "2" else 0.0), log=lambda _: None)
print(json.dumps(summary["compile"]))
"""


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla not installed")
def test_the_online_step_on_xla_compiles_and_runs_as_many_graphs_as_the_cached_step(tmp_path, full_cache,
                                                                                     teacher_dir):
    reports = {}
    for online in ("0", "1", "2"):  # each in its own process: the counters and the in-memory graph cache are global
        reports[online] = on_xla(ONLINE_ON_XLA, str(teacher_dir), str(full_cache), str(tmp_path / online), online,
                                 timeout=600)
    cached = reports["0"]
    # The teacher (and feature distillation on its hidden states) joins the step's graph: no graph of its own, no
    # host read, nothing after step 2.
    for online in (reports["1"], reports["2"]):
        assert online["graphs_compiled"] == cached["graphs_compiled"], reports
        assert online["graph_executions"] == cached["graph_executions"], reports
        assert online["transfers_from_device"] == cached["transfers_from_device"], reports
        assert online["graphs_compiled_after_step_2"] == 0 and online["cpu_fallback_ops"] == [], online


@pytest.mark.slow
def test_target_bench_times_a_cached_and_an_online_variant(tmp_path, full_cache, teacher_dir):
    bench = load_benchmark("target_bench")
    result = bench.main(["--teacher", str(teacher_dir), "--variant", f"kv:{full_cache}", "--variant",
                         f"online:{full_cache}", "--quant", "w2g32", "--batch-size", "2", "--steps", "4", "--skip",
                         "1", "--work", str(tmp_path / "work"), "--json", str(tmp_path / "steps.json")])
    kv, online = result["rows"]
    assert json.loads((tmp_path / "steps.json").read_text()) == result
    assert kv["encoding"]["top_k"] == KDCache(full_cache).vocab_size
    assert kv["bytes_per_token"] > 4 * kv["encoding"]["top_k"]  # 32-bit log-probs of every token
    assert online["encoding"] == {"name": "online"} and online["bytes_per_token"] == 5
    assert kv["step_time_vs_first"] == 1.0 and online["step_s"] > 0 and kv["tokens_per_step"] == 2 * 32
    config = json.loads((tmp_path / "work" / "online-0" / "config.json").read_text())
    assert config["online_teacher"] == str(teacher_dir)
