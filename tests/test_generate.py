"""`qat-lora generate` / `chat` (issue 18, item 5): streamed greedy replies equal the student's own greedy decode,
from the student's parts or from an export."""
from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoTokenizer

from conftest import save_random_adapter
from helpers_xla import on_xla
from qat_lora.commands.cli import main
from qat_lora.train.config import StudentSpec
from qat_lora.commands.config import GenerateConfig
from qat_lora.commands.generate import chat, generate
from qat_lora.train.student import load_student

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, teacher_dir, tokenizer):
    """The tiny teacher with a chat template, and a non-zero w3g32 recovery adapter over it."""
    root = tmp_path_factory.mktemp("chat")
    shutil.copytree(teacher_dir, root / "model")
    tok = tokenizer.__class__.from_pretrained(str(teacher_dir))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(root / "model"))
    save_random_adapter(root / "model", "w3g32", root / "adapter", seed=3)
    return root


def _greedy(model, ids: torch.Tensor, eos: int) -> list[int]:
    """Reference: full forward each step (no KV cache), argmax, stop at eos."""
    new = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            if token == eos:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return new


def _expected(chat_model, messages) -> tuple[list[int], str]:
    student = load_student(StudentSpec(str(chat_model / "model"), "w3g32"), str(chat_model / "adapter"))
    tok = AutoTokenizer.from_pretrained(str(chat_model / "model"))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    new = _greedy(student, ids["input_ids"], tok.eos_token_id)
    return new, tok.decode(new, skip_special_tokens=True)


def test_generate_streams_the_students_greedy_decode(chat_model):
    pieces: list[str] = []
    cfg = GenerateConfig(model=str(chat_model / "model"), quant="w3g32", adapter=str(chat_model / "adapter"),
                         prompt="the king sees", max_new_tokens=NEW_TOKENS, device="cpu")
    new = generate(cfg, on_text=pieces.append)
    expected_ids, expected_text = _expected(chat_model, [{"role": "user", "content": "the king sees"}])
    eos = AutoTokenizer.from_pretrained(str(chat_model / "model")).eos_token_id
    assert new[:len(expected_ids)] == expected_ids and all(t == eos for t in new[len(expected_ids):])
    assert "".join(pieces) == expected_text + "\n"
    assert len([p for p in pieces if p]) > 2  # streamed token by token, not printed once at the end


@pytest.mark.slow
def test_generate_from_a_packed_export_with_its_adapter(chat_model, tmp_path, capsys):
    out = tmp_path / "e"
    assert main(["export", "--model", str(chat_model / "model"), "--quant", "w3g32", "--adapter",
                 str(chat_model / "adapter"), "--format", "packed", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(out / "packed"), "--adapter", str(out / "adapter"), "--prompt",
                 "the king sees", "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"]) == 0
    _, expected_text = _expected(chat_model, [{"role": "user", "content": "the king sees"}])
    assert capsys.readouterr().out == expected_text + "\n"


@pytest.mark.slow
def test_chat_keeps_the_conversation(chat_model):
    pieces: list[str] = []
    lines = iter(["the queen", "a river", ""])
    cfg = GenerateConfig(model=str(chat_model / "model"), quant="w3g32", adapter=str(chat_model / "adapter"),
                         max_new_tokens=NEW_TOKENS, device="cpu")
    chat(cfg, read=lambda _: next(lines), on_text=pieces.append)
    _, first = _expected(chat_model, [{"role": "user", "content": "the queen"}])
    _, second = _expected(chat_model, [{"role": "user", "content": "the queen"},
                                       {"role": "assistant", "content": first},
                                       {"role": "user", "content": "a river"}])
    assert "".join(pieces) == first + "\n" + second + "\n"


def test_generate_errors_are_one_line(chat_model, teacher_dir, capsys):
    assert main(["generate", "--model", str(chat_model / "model")]) == 2
    assert "--prompt is required" in capsys.readouterr().err
    assert main(["generate", "--model", str(teacher_dir), "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no chat template; pass --raw" in err[0]


GENERATE_ON_XLA = """
import json, sys
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from qat_lora.runtime import xla
from qat_lora.commands.config import GenerateConfig
from qat_lora.commands.generate import generate

model, adapter = sys.argv[1:3]
report = {}
for tokens in (2, 4):
    met.clear_all()
    cfg = GenerateConfig(model=model, quant="w3g32", adapter=adapter, prompt="the king sees", max_new_tokens=tokens,
                         device="xla")
    ids = generate(cfg, on_text=lambda _: None)
    xm.wait_device_ops()
    report[tokens] = {"ids": ids, **xla.compile_metrics()}
print(json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.xla
def test_generate_on_xla_compiles_per_cache_size_not_per_token(chat_model):
    # The static KV cache gives every decode step the same shapes: twice the tokens (a new cache size, so compiled
    # afresh) compile exactly as many graphs, only executing more. Measured on XLA:CPU: 12 graphs either way.
    import importlib.util

    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla not installed (pip install 'qat-lora[xla]')")
    report = on_xla(GENERATE_ON_XLA, str(chat_model / "model"), str(chat_model / "adapter"), timeout=550)
    short, long = report["2"], report["4"]
    assert long["graphs_compiled"] == short["graphs_compiled"] > 0, report
    assert long["graph_executions"] > short["graph_executions"], report
    cpu = generate(GenerateConfig(model=str(chat_model / "model"), quant="w3g32", adapter=str(chat_model / "adapter"),
                                  prompt="the king sees", max_new_tokens=4, device="cpu"), on_text=lambda _: None)
    assert long["ids"] == cpu
