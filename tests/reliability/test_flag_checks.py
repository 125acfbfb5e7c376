"""Flag values and named files that used to end in a traceback, a silently wrong run or an error only after the
model had loaded (issue 31): each is now one line on stderr naming the flag or file and the fix, exit 2, nothing
written, and found before any model loads (the model loader is replaced by one that fails the test)."""
from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest

from qat_lora.data import models
from qat_lora.commands.cli import main

from tests.conftest import save_random_adapter
from .test_user_mistakes import run_cli

TRAIN = ["train", "--model", "{teacher}", "--cache", "{cache}", "--out", "{out}", "--max-steps", "2", "--batch-size",
         "2", "--lora-r", "4", "--device", "cpu"]
EVAL = ["eval", "--model", "{teacher}", "--seq-len", "32", "--max-tokens", "200", "--device", "cpu", "--json-out",
        "{out}"]
EXPORT = ["export", "--model", "{teacher}", "--quant", "w3g32", "--out", "{out}"]
RECOVER = ["recover", "--model", "{teacher}", "--cache", "{cache}", "--quant", "w2g32", "--out", "{out}",
           "--calib-sequences", "4", "--lora-steps", "1", "--batch-size", "2"]
GENERATE = ["generate", "--model", "{teacher}", "--prompt", "hi", "--raw", "--max-new-tokens", "2", "--device", "cpu"]

BAD_VALUES = [
    # 1. zero sizes: a ZeroDivisionError traceback (eval), or an export that ignored them.
    (EVAL + ["--text", "{corpus}", "--seq-len", "0"], "--seq-len 0: must be positive"),
    (EVAL + ["--cache", "{cache}", "--batch-size", "0"], "--batch-size 0: must be positive"),
    (EXPORT + ["--batch-size", "0"], "--batch-size 0: must be positive"),
    # 2. seeds outside what numpy, torch_xla and the cache's batch order take.
    (TRAIN + ["--seed", "-1"], "--seed -1: must be in [0, 4294967295]"),
    (TRAIN + ["--seed", str(2 ** 64)], f"--seed {2 ** 64}: must be in [0, 4294967295]"),
    (RECOVER + ["--seed", "-1"], "--seed -1: must be in [0, 4294967295]"),
    (GENERATE + ["--seed", "-1"], "--seed -1: must be in [0, 4294967295]"),
    (["generate-data", "--model", "{teacher}", "--data", "{corpus}", "--out", "{out}", "--seed", "-1"],
     "--seed -1: must be in [0, 4294967295]"),
    # 3. values that trained silently wrong (reversed or erased updates, a dead LoRA) or diverged a step later.
    (TRAIN + ["--max-grad-norm", "-1"], "--max-grad-norm -1.0: must be positive"),
    (TRAIN + ["--lr", "1e308"], "--lr 1e+308: must be at most 1"),
    (TRAIN + ["--temperature", "1e308"], "--temperature 1e+308: must be at most 100"),
    (RECOVER + ["--weight-lr", "2"], "--weight-lr 2.0: must be at most 1"),
    (TRAIN + ["--max-grad-norm", "0"], "--max-grad-norm 0.0: must be positive"),
    (TRAIN + ["--warmup-steps", "-1"], "--warmup-steps -1: must be >= 0"),
    (TRAIN + ["--weight-decay", "-0.1"], "--weight-decay -0.1: must be >= 0"),
    (TRAIN + ["--weight-decay", "nan"], "--weight-decay nan: must be >= 0"),
    (TRAIN + ["--lora-r", "0"], "--lora-r 0: must be positive"),
    (TRAIN + ["--lora-alpha", "0"], "--lora-alpha 0.0: must be positive"),
    (TRAIN + ["--lr", "inf"], "--lr inf: must be positive and finite"),
    (TRAIN + ["--temperature", "inf"], "--temperature inf: must be positive and finite"),
    (TRAIN + ["--dist-timeout-s", "inf"], "--dist-timeout-s inf: must be positive and finite"),
    (TRAIN + ["--dist-timeout-s", "1e20"], "--dist-timeout-s 1e+20: at most 1e9 seconds"),
    (["quantize", "--model", "{teacher}", "--init", "none", "--quant", "w2g32", "--blockwise-lr", "inf", "--out",
      "{out}"], "--blockwise-lr inf: must be positive and finite"),
    (EXPORT + ["--resnap-lr", "0"], "--resnap-lr 0.0: must be positive"),
    (GENERATE + ["--temperature", "inf"], "--temperature inf: must be >= 0 and finite"),
    (["demo", "--lr", "inf", "--work-dir", "{out}"], "--lr inf: must be positive and finite"),
    # 6. checked only once the model had loaded (or, for recover, once its init stage had run).
    (RECOVER + ["--device", "gpu"], "--device 'gpu': choose one of"),
    (["eval", "--model", "{teacher}", "--text", "{corpus}", "--device", "cpu", "--json-out", "{out}"],
     "--seq-len 512: longer than the model's context (128 positions)"),
    (EVAL[:-1] + ["{file}/eval.json", "--text", "{corpus}"], "notes.txt is a file, not a folder"),
    (GENERATE[:-5] + ["--max-new-tokens", "2", "--device", "cpu"], "no chat template; pass --raw"),
    (EXPORT + ["--adapter", "{adapter}", "--cache", "{out}-nope"], "no manifest.json; build one"),
    (EXPORT + ["--adapter", "{cut_adapter}"], "its weights are damaged or truncated"),
    (EVAL + ["--text", "{corpus}", "--quant", "w2g32", "--quantizer", "{cut_quantizer}"], "damaged or truncated"),
    (EXPORT + ["--model", "{mistral}", "--format", "gguf"], "--format gguf: sliding_window 16 < context"),
]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory, teacher_dir) -> dict[str, str]:
    """An adapter of the teacher, the same with its weights cut short, a cut-short quantiser file, and a copy of
    the teacher whose model_type the GGUF writer does not know."""
    import torch
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("artefacts")
    save_random_adapter(teacher_dir, "w3g32", root / "adapter")
    shutil.copytree(root / "adapter", root / "cut_adapter")
    _truncate(root / "cut_adapter" / "adapter_model.safetensors")
    save_file({"a": torch.zeros(256)}, root / "quantizer.safetensors")
    _truncate(root / "quantizer.safetensors")
    shutil.copytree(teacher_dir, root / "mistral")
    config = json.loads((root / "mistral" / "config.json").read_text())
    # A Mistral whose window is shorter than its context: llama.cpp would attend past it, so gguf refuses it.
    (root / "mistral" / "config.json").write_text(json.dumps({**config, "model_type": "mistral", "sliding_window": 16}))
    return {"adapter": str(root / "adapter"), "cut_adapter": str(root / "cut_adapter"),
            "cut_quantizer": str(root / "quantizer.safetensors"), "mistral": str(root / "mistral")}


@pytest.fixture
def paths(tmp_path, teacher_dir, cache_dir, corpus_dir, artefacts) -> dict[str, str]:
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's file\n")
    return {"teacher": str(teacher_dir), "cache": str(cache_dir), "corpus": str(corpus_dir),
            "out": str(tmp_path / "out"), "file": str(notes), **artefacts}


@pytest.fixture
def no_model_load(monkeypatch):
    """Every check must come before the model loads: loading one fails the test."""
    def load(*_, **__):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(models, "load_causal_lm", load)


@pytest.mark.parametrize("argv, message", BAD_VALUES, ids=[" ".join(a[:1] + a[-2:]) + f" [{i}]"
                                                           for i, (a, _) in enumerate(BAD_VALUES)])
def test_bad_value_is_one_line_before_the_model_loads(argv, message, paths, tmp_path, capsys, no_model_load):
    code, err = run_cli([a.format(**paths) for a in argv], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"qat-lora {argv[0]}: error: ") and message in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing written, not even a folder
    assert Path(paths["file"]).read_text() == "the user's file\n"


DAMAGED_CONFIG = [
    (lambda text: text[:20], "config.json is not valid JSON (truncated?); copy or download the model again"),
    (lambda text: "[1, 2]", "config.json is not a JSON object"),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "model_type"}),
     "config.json has no model_type"),
]
COMMANDS = {
    "train": ["train", "--model", "{model}", "--cache", "{cache}", "--out", "{out}"],
    "eval": ["eval", "--model", "{model}", "--text", "{corpus}", "--seq-len", "32", "--json-out", "{out}"],
    "export": ["export", "--model", "{model}", "--quant", "w3g32", "--out", "{out}"],
    "quantize": ["quantize", "--model", "{model}", "--cache", "{cache}", "--quant", "w3g32", "--out", "{out}"],
    "recover": ["recover", "--model", "{model}", "--cache", "{cache}", "--quant", "w3g32", "--out", "{out}"],
    "generate": ["generate", "--model", "{model}", "--prompt", "hi", "--raw"],
    "chat": ["chat", "--model", "{model}", "--raw"],
    "build-cache": ["build-cache", "--teacher", "{model}", "--data", "{corpus}", "--out", "{out}"],
    "generate-data": ["generate-data", "--model", "{model}", "--data", "{corpus}", "--out", "{out}"],
}


@pytest.mark.parametrize("damage, message", DAMAGED_CONFIG, ids=["truncated", "not-an-object", "no-model-type"])
@pytest.mark.parametrize("command", COMMANDS)
def test_damaged_config_json_names_the_file(command, damage, message, teacher_dir, cache_dir, corpus_dir, tmp_path,
                                           capsys):
    model = tmp_path / "model"
    shutil.copytree(teacher_dir, model)
    (model / "config.json").write_text(damage((teacher_dir / "config.json").read_text()))
    out = tmp_path / "out"
    argv = [a.format(model=model, cache=cache_dir, corpus=corpus_dir, out=out) for a in COMMANDS[command]]
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"qat-lora {command}: error: model {model}: cannot load: {model}/") and message in err[0]
    assert not out.exists()


def test_truncated_tokenizer_json_names_the_file(teacher_dir, corpus_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(teacher_dir, model)
    _truncate(model / "tokenizer.json")
    code, err = run_cli([a.format(model=model, corpus=corpus_dir) for a in COMMANDS["eval"][:-2]], capsys)
    assert code == 2 and len(err) == 1, err
    assert f"tokenizer of {model}: cannot load: {model / 'tokenizer.json'} is not valid JSON (truncated?)" in err[0]


def test_chat_replaces_bytes_that_are_not_utf8_and_goes_on(teacher_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe bad\n/exit\n"), encoding="utf-8",
                                                       errors="strict"))
    code = main(["chat", "--model", str(teacher_dir), "--raw", "--max-new-tokens", "2", "--device", "cpu"])
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 0 and "Traceback" not in captured.err
    assert len(err) == 1 and err[0].startswith("qat-lora chat: warning: the input is not utf-8") and "U+FFFD" in err[0]
    assert captured.out.count("> ") == 2  # a reply to the first line, then the prompt that read /exit


@pytest.mark.parametrize("raised, code, message", [
    (KeyboardInterrupt, 130, "interrupted (Ctrl-C)"),
    (MemoryError, 1, "out of host memory; lower --batch-size"),
])
def test_interrupt_or_memory_error_while_loading_is_one_line(raised, code, message, teacher_dir, corpus_dir,
                                                            monkeypatch, capsys):
    def load(*_, **__):
        raise raised

    monkeypatch.setattr(models, "load_causal_lm", load)
    try:
        got, err = run_cli(["eval", "--model", str(teacher_dir), "--text", str(corpus_dir), "--seq-len", "32",
                            "--device", "cpu"], capsys)
    except raised:  # escaping main() is the traceback a user would see (and would end pytest's own session)
        pytest.fail(f"{raised.__name__} escaped main()")
    assert got == code and len(err) == 1 and err[0].startswith(f"qat-lora eval: error: {message}"), err


@pytest.mark.parametrize("argv, message", [
    (["train", "--max-steps", "abc"], "qat-lora train: error: argument --max-steps: invalid int value: 'abc'"),
    (["frob"], "qat-lora: error: argument command: invalid choice: 'frob'"),
])
def test_a_flag_argparse_cannot_read_is_one_line_too(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stop.value.code == 2 and len(err) == 1 and err[0].startswith(message) and "--help" in err[0], err
