"""The CUDA step's defaults (issue 46 item 3), checked on the CPU: --storage-dtype auto stores the frozen student in
bf16 exactly when recovery-lora computes in bf16, and --compile (torch.compile of each decoder layer) gives the eager
step's loss and LoRA gradients, with no graph break inside a layer and one graph for all the layers."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from qat_lora.cache.reader import KDCache
from qat_lora.quant.blocks import decoder_layers
from qat_lora.train.config import StudentSpec, TrainConfig
from qat_lora.train.loss import KDLossConfig, forward_loss
from qat_lora.train.student import (build_student, compile_decoder_layers_, make_trainable_, resolve_storage_dtype,
                                    set_storage_dtype_)
from qat_lora.train.trainer import train


@pytest.mark.parametrize("preset, amp, expected", [
    ("recovery-lora", torch.bfloat16, "bf16"), ("recovery-lora", None, "fp32"),
    ("qat", torch.bfloat16, "fp32"), ("qat+lora", torch.bfloat16, "fp32"), ("weight-qat", None, "fp32")])
def test_storage_auto_is_bf16_only_for_a_frozen_base_under_bf16(preset, amp, expected):
    assert resolve_storage_dtype("auto", preset, amp) == expected
    assert resolve_storage_dtype("fp32", preset, amp) == "fp32"


def test_compile_flag_is_checked_and_auto_compiles_on_cuda_only(teacher_dir):
    with pytest.raises(ValueError, match=r"^--compile 'yes': choose one of auto, on, off"):
        TrainConfig(model=str(teacher_dir), quant="w4g32", compile="yes")
    student = build_student(StudentSpec(model=str(teacher_dir), quant="w4g32"))
    assert compile_decoder_layers_(student, "auto", torch.device("cpu"), "bf16") == 0
    assert compile_decoder_layers_(student, "auto", torch.device("cuda"), "fp32") == 0
    assert compile_decoder_layers_(student, "off", torch.device("cuda"), "bf16") == 0
    assert compile_decoder_layers_(student, "auto", torch.device("cuda"), "bf16", checkpointing=True) == 0
    assert all(getattr(layer, "_compiled_call_impl", None) is None for layer in decoder_layers(student))


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory, tokenizer):
    """The tiny teacher's shape with four layers: a graph per layer would show as four graphs."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("four-layers")
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.25,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _student(teacher_dir, storage: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = make_trainable_(build_student(StudentSpec(model=str(teacher_dir), quant="w4g32")), "recovery-lora", 4, 8.0)
    with torch.no_grad():  # a non-zero B: the adapter takes part in the forward and in A's gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return set_storage_dtype_(model, storage).train()


def _loss_and_grads(model, batch, amp) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for _ in range(2):  # a compiled model's second call runs the compiled graph (the first compiles it)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            loss = forward_loss(model, batch, KDLossConfig(), chunk_size=64)["loss"]
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _error(grads: dict, reference: dict) -> float:
    return max(float((grads[n] - r).norm() / r.norm()) for n, r in reference.items())


@pytest.mark.parametrize("storage, amp", [("bf16", torch.bfloat16), ("fp32", None)])
def test_compiled_layers_give_the_eager_loss_and_gradients(four_layer_dir, cache_dir, storage, amp):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch._dynamo.config.recompile_limit = 8  # the default, whatever another test set
    batch = next(iter(KDCache(cache_dir).batches("train", 4)))
    eager = _student(four_layer_dir, storage)
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers_(compiled, "on", torch.device("cpu"), storage) == len(decoder_layers(compiled)) == 4
    loss_e, grads_e = _loss_and_grads(eager, batch, amp)
    loss_c, grads_c = _loss_and_grads(compiled, batch, amp)
    assert grads_c.keys() == grads_e.keys() and len(grads_e) == 4 * 7 * 2
    if amp is None:  # fp32: the same maths, fused kernels' rounding only
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=0.0)
        assert _error(grads_c, grads_e) < 1e-4
    else:  # bf16 rounds differently once fused: compiled is no further from the fp32 step than eager is
        loss_ref, grads_ref = _loss_and_grads(_student(four_layer_dir, "fp32"), batch, None)
        assert abs(float(loss_c - loss_ref)) <= 1.5 * abs(float(loss_e - loss_ref)) + 1e-3 * float(loss_ref)
        assert _error(grads_c, grads_ref) <= 1.25 * _error(grads_e, grads_ref)
    if storage == "fp32":
        return  # the cached Wq's bookkeeping breaks the graph (correct, slower): auto compiles bf16 storage only
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # One graph for the first layer (its input needs no gradient), one for every other: no graph per layer (past
    # dynamo's recompile limit, 8, the remaining layers would run eager: the layers get no KV cache).
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    torch._dynamo.reset()


def test_train_records_storage_and_compile_in_config(teacher_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    summary = train(TrainConfig(model=str(teacher_dir), cache=str(cache_dir), quant="w4g32", out=str(out),
                                max_steps=2, batch_size=2, lora_r=4, log_steps=1), log=lambda _: None)
    config = json.loads((out / "config.json").read_text())
    assert config["storage_dtype"] == "auto" and config["compile"] == "auto" and summary["steps"] == 2
    with pytest.raises(ValueError, match=r"^--storage-dtype bf16 --preset qat: "):
        TrainConfig(model=str(teacher_dir), quant="w4g32", preset="qat", storage_dtype="bf16")
    TrainConfig(model=str(teacher_dir), quant="w4g32", preset="qat")  # auto resolves to fp32 there: accepted


@pytest.mark.parametrize("mode", ["on", "graphs"])
def test_compile_on_is_refused_on_xla_before_the_run_folder_is_touched(teacher_dir, cache_dir, tmp_path, monkeypatch,
                                                                      mode):
    from qat_lora.runtime import device as dev

    # an XLA device as the trainer would resolve it, without starting a PJRT client in this process
    monkeypatch.setattr(dev, "resolve_device", lambda _: torch.device("xla"))
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"^--compile {mode}: on XLA"):
        train(TrainConfig(model=str(teacher_dir), cache=str(cache_dir), quant="w4g32", out=str(out), max_steps=1,
                          batch_size=2, lora_r=4, compile=mode), log=lambda _: None)
    assert not out.exists()


def test_compile_graphs_asks_inductor_for_cuda_graphs_and_marks_every_step(teacher_dir, cache_dir, tmp_path,
                                                                         monkeypatch):
    """--compile graphs: each layer compiled with mode reduce-overhead (Inductor's CUDA graphs; on the CPU it has
    none, so the step is --compile on's) and the CUDA-graph runtime told of every optimizer step's start."""
    compiled_with, marks = [], []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled_with.append(kw))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    student = build_student(StudentSpec(model=str(teacher_dir), quant="w4g32"))
    assert compile_decoder_layers_(student, "graphs", torch.device("cuda"), "fp32") == len(decoder_layers(student))
    assert compiled_with == [{"dynamic": False, "mode": "reduce-overhead"}] * len(decoder_layers(student))
    compiled_with.clear()
    out = tmp_path / "run"
    summary = train(TrainConfig(model=str(teacher_dir), cache=str(cache_dir), quant="w4g32", out=str(out),
                                max_steps=3, batch_size=2, lora_r=4, log_steps=1, compile="graphs"), log=lambda _: None)
    assert summary["steps"] == 3 and len(marks) == 3 and len(compiled_with) == len(decoder_layers(student))
    assert json.loads((out / "config.json").read_text())["compile"] == "graphs"
