"""Damaged or mismatched inputs a user meets after a bad copy, a full disk or a mix-up of folders: each is one
line naming the file and the fix (exit 2; 1 for the disk itself), never a traceback, never a half-written output.

Faults are made the way they happen: files cut short (truncated), bytes in another encoding, an artefact of
another model or preset, a disk that fills up mid-write (simulated: everything runs as root here, so a real
read-only or full disk cannot be provoked with chmod; the OSError the kernel would raise is injected)."""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

import safetensors.numpy
from qat_lora.commands.cli import main

from .conftest import TRAIN

from .test_user_mistakes import run_cli



def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])



@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, tokenizer) -> Path:
    """Another model with the same tokenizer but hidden size 96: adapters and quantisers of the teacher misfit."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("wide")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def latin_text(tmp_path) -> Path:
    path = tmp_path / "latin1.txt"
    path.write_bytes("Un caf\u00e9 au bord de la rivi\u00e8re.\n\nLa ville est grande.\n".encode("latin-1"))
    return path


def _eval(model, *extra) -> list[str]:
    return ["eval", "--model", str(model), "--seq-len", "32", "--max-tokens", "200", "--device", "cpu", *extra]


@pytest.mark.parametrize("damaged, message", [
    ("model.safetensors", "a weights file is damaged or truncated"),
    ("tokenizer.json", "cannot load"),
    ("config.json", "cannot load"),
])
@pytest.mark.parametrize("command", ["build-cache", "eval"])
def test_truncated_teacher_is_one_line_and_nothing_is_written(command, damaged, message, teacher_dir, corpus_dir,
                                                              tmp_path, capsys):
    model = tmp_path / "teacher"
    shutil.copytree(teacher_dir, model)
    _truncate(model / damaged)
    out = tmp_path / "out"
    argv = (["build-cache", "--teacher", str(model), "--data", str(corpus_dir), "--seq-len", "32", "--out", str(out),
             "--device", "cpu"] if command == "build-cache" else
            _eval(model, "--text", str(corpus_dir), "--json-out", str(out)))
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1 and f"{model}" in err[0] and message in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("command", ["build-cache", "eval", "generate-data"])
def test_text_that_is_not_utf8_names_the_file_and_the_flags(command, latin_text, teacher_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = {"build-cache": ["build-cache", "--teacher", str(teacher_dir), "--data", str(latin_text), "--seq-len", "32",
                            "--out", str(out), "--device", "cpu"],
            "eval": _eval(teacher_dir, "--text", str(latin_text), "--json-out", str(out)),
            "generate-data": ["generate-data", "--model", str(teacher_dir), "--prompts", str(latin_text), "--out",
                              str(out), "--device", "cpu"]}[command]
    code, err = run_cli(argv, capsys)
    assert code == 2 and err == [f"qat-lora {command}: error: {latin_text}: not utf-8 text (byte 0xe9 does not "
                                 "decode); pass --text-encoding (e.g. latin-1) or --text-errors replace"]
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("flags", [["--text-encoding", "latin-1"], ["--text-errors", "replace"]])
def test_the_named_flags_read_that_file(flags, latin_text, teacher_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code, _ = run_cli(_eval(teacher_dir, "--text", str(latin_text), "--json-out", str(out), *flags), capsys)
    result = json.loads(out.read_text())
    assert code == 0 and result["tokens"] > 10
    assert result["config"][flags[0].removeprefix("--").replace("-", "_")] == flags[1]


@pytest.mark.parametrize("command", ["eval", "export"])
def test_adapter_of_another_model_is_one_line(command, run_w2, wide_model, corpus_dir, tmp_path, capsys):
    """An adapter that records no model signature (written before they were recorded, or by other tools) is
    still refused by shape (test_ownership.py covers the signature)."""
    out = tmp_path / "out"
    adapter = tmp_path / "unrecorded" / "adapter"
    shutil.copytree(run_w2 / "adapter", adapter)
    (adapter / "qat_lora.json").unlink()
    tail = ["--text", str(corpus_dir), "--json-out", str(out)] if command == "eval" else ["--out", str(out)]
    argv = [command, "--model", str(wide_model), "--quant", "w2g32", "--adapter", str(adapter), *tail] + (
        ["--seq-len", "32", "--device", "cpu"] if command == "eval" else [])
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1, err
    assert f"--adapter {adapter}: made for another model (" in err[0] and "pass the --model its run" in err[0]
    assert not out.exists()


def test_truncated_adapter_is_one_line(run_w2, teacher_dir, corpus_dir, tmp_path, capsys):
    adapter = tmp_path / "run" / "adapter"
    shutil.copytree(run_w2, adapter.parent)
    _truncate(adapter / "adapter_model.safetensors")
    code, err = run_cli(_eval(teacher_dir, "--adapter", str(adapter), "--text", str(corpus_dir)), capsys)
    assert code == 2 and len(err) == 1 and f"--adapter {adapter}: its weights are damaged or truncated" in err[0]


@pytest.fixture(scope="module")
def loose_quantizer(tmp_path_factory, teacher_dir) -> Path:
    """A w2g32 quantizer.safetensors copied out of its run (nothing records its preset any more)."""
    from qat_lora.train.config import StudentSpec
    from qat_lora.quant.state import save_quantizer_state
    from qat_lora.train.student import build_student

    path = tmp_path_factory.mktemp("loose") / "quantizer.safetensors"
    save_quantizer_state(build_student(StudentSpec(str(teacher_dir), "w2g32")), path)
    return path


def test_quantizer_of_another_preset_names_the_tensor(loose_quantizer, teacher_dir, corpus_dir, capsys):
    code, err = run_cli(_eval(teacher_dir, "--quant", "w4pc", "--quantizer", str(loose_quantizer), "--text",
                              str(corpus_dir)), capsys)
    assert code == 2 and len(err) == 1 and f"{loose_quantizer}: model.layers.0." in err[0], err
    assert "build the student with the run's --model and --quant" in err[0]


def test_truncated_quantizer_is_one_line(loose_quantizer, teacher_dir, corpus_dir, tmp_path, capsys):
    cut = tmp_path / "quantizer.safetensors"
    shutil.copy(loose_quantizer, cut)
    _truncate(cut)
    code, err = run_cli(_eval(teacher_dir, "--quant", "w2g32", "--quantizer", str(cut), "--text", str(corpus_dir)),
                        capsys)
    assert code == 2 and err == [f"qat-lora eval: error: --quantizer {cut}: damaged or truncated (Error while "
                                 "deserializing header: incomplete metadata, file not fully covered); use the run's "
                                 "intact copy or rerun the stage that wrote it"]


@pytest.mark.parametrize("command", ["eval", "export"])
def test_quant_other_than_the_runs_is_refused(command, run_w2, teacher_dir, corpus_dir, tmp_path, capsys):
    out = tmp_path / "out"
    tail = ["--text", str(corpus_dir), "--json-out", str(out)] if command == "eval" else ["--out", str(out)]
    code, err = run_cli([command, "--model", str(teacher_dir), "--quant", "w3g32", "--adapter",
                         str(run_w2 / "adapter"), *tail], capsys)
    assert code == 2 and err == [f"qat-lora {command}: error: --quant w3g32: --adapter {run_w2 / 'adapter'} was "
                                 f"trained with --quant w2g32 ({run_w2.resolve() / 'config.json'}); drop --quant or "
                                 "pass --quant w2g32"]
    assert not out.exists()


def test_eval_reads_quant_from_the_run(run_w2, teacher_dir, corpus_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code, _ = run_cli(_eval(teacher_dir, "--adapter", str(run_w2 / "adapter"), "--text", str(corpus_dir),
                            "--json-out", str(out)), capsys)
    assert code == 0 and json.loads(out.read_text())["quant"] == "w2g32"


def test_truncated_shard_during_training_names_it(cache_dir, teacher_dir, tmp_path, capsys):
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    shard = json.loads((cache / "manifest.json").read_text())["splits"]["train"]["shards"][0]["file"]
    _truncate(cache / shard)
    code, err = run_cli(["train", "--model", str(teacher_dir), "--cache", str(cache), "--out", str(tmp_path / "run"),
                         "--quant", "w2g32", "--max-steps", "2", *TRAIN], capsys)
    assert code == 2 and err[-1].startswith(f"qat-lora train: error: --cache {cache}: shard {shard} is damaged (")
    assert err[-1].endswith("run `qat-lora cache verify` and rebuild the cache with --resume or --overwrite")
    assert main(["cache", "verify", str(cache)]) == 2 and shard in capsys.readouterr().err


def test_disk_full_while_building_a_cache_is_one_line_exit_1_and_leaves_no_half_shard(
        teacher_dir, corpus_dir, tmp_path, monkeypatch, capsys):
    def full(arrays, path, metadata=None):
        Path(path).write_bytes(b"\0" * 100)  # the kernel wrote part of it, then the disk filled up
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    out = tmp_path / "cache"
    code, err = run_cli(["build-cache", "--teacher", str(teacher_dir), "--data", str(corpus_dir), "--seq-len", "32",
                         "--max-tokens", "600", "--out", str(out), "--device", "cpu"], capsys)
    assert code == 1 and err[-1].startswith("qat-lora build-cache: error: [Errno 28] No space left on device: ")
    assert err[-1].endswith("; the disk is full: free space or write elsewhere")
    assert not out.exists() or not [p for p in out.iterdir() if p.suffix in (".safetensors", ".tmp")
                                    or p.name == "manifest.json"]


@pytest.mark.parametrize("command", ["train", "build-cache", "export", "quantize", "eval"])
def test_read_only_output_folder_is_one_line_exit_1(command, teacher_dir, cache_dir, corpus_dir, tmp_path,
                                                    monkeypatch, capsys):
    """A folder on a read-only mount: running as root, chmod cannot make one, so os.mkdir raises what the
    kernel would (EROFS) for any path under it."""
    read_only = tmp_path / "mnt"
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(str(read_only)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    out = read_only / "out"
    argv = {"train": ["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--quant", "w2g32",
                      "--max-steps", "1", "--out", str(out), *TRAIN],
            "build-cache": ["build-cache", "--teacher", str(teacher_dir), "--data", str(corpus_dir), "--seq-len", "32",
                            "--max-tokens", "300", "--out", str(out), "--device", "cpu"],
            "export": ["export", "--model", str(teacher_dir), "--quant", "w2g32", "--out", str(out)],
            "quantize": ["quantize", "--model", str(teacher_dir), "--quant", "w2g32", "--init", "none", "--out",
                         str(out)],
            "eval": _eval(teacher_dir, "--text", str(corpus_dir), "--json-out", str(out / "eval.json"))}[command]
    code, err = run_cli(argv, capsys)
    assert code == 1 and err[-1].startswith(f"qat-lora {command}: error: [Errno 30] Read-only file system: ")
    assert err[-1].endswith("; a read-only file system: pass a folder you can write to")
    assert not read_only.exists()
