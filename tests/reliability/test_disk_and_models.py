"""No traceback for what a user or the disk causes (issue 50): a model folder whose config.json disagrees with its
weights, a disk that fills up while a command writes (a REAL full file system: a small tmpfs, mounted as root),
`chat` with its input closed, and folders, looping links or cut-short files where a file is expected. Each ends
in one line naming the file or folder (and the fix), never a half-written file under a real name.
"""
from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qat_lora.commands.cli import main

from .conftest import TRAIN
from qat_lora.runtime.files import SAFETENSORS_TEMP
from qat_lora.runtime.writes import disk_error

from .test_user_mistakes import run_cli

EVAL = ["--seq-len", "32", "--max-tokens", "100", "--device", "cpu"]
DISK_FULL = "; the disk is full: free space or write elsewhere"  # cli._OS_FIXES[ENOSPC]



# ---------------------------------------------------------------------------------------------------------------
# A config.json that disagrees with the weights: transformers raises a RuntimeError after a table of every weight
# (a shape edited), or loads with the missing weights left random and only a warning (a layer added, another
# model_type): one line naming the folder, exit 2, nothing written.

def _wide_weights(folder: Path, tokenizer) -> None:
    """The weights of another model (hidden size 96) copied over the folder's own."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    other = folder.parent / "other-model"
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    shutil.copy(other / "model.safetensors", folder / "model.safetensors")


MISMATCHES = {
    "hidden_size edited": lambda config, folder, tok: config.update(hidden_size=96),
    "a layer added": lambda config, folder, tok: config.update(num_hidden_layers=3),
    "a layer removed": lambda config, folder, tok: config.update(num_hidden_layers=1),
    "heads edited": lambda config, folder, tok: config.update(num_attention_heads=8),
    "another model_type": lambda config, folder, tok: config.update(model_type="qwen2",
                                                                   architectures=["Qwen2ForCausalLM"]),
    "another model's weights": lambda config, folder, tok: _wide_weights(folder, tok),
}


def _mismatched(teacher_dir: Path, tmp_path: Path, tokenizer, how: str) -> Path:
    model = tmp_path / "model"
    shutil.copytree(teacher_dir, model)
    config = json.loads((model / "config.json").read_text())
    MISMATCHES[how](config, model, tokenizer)
    (model / "config.json").write_text(json.dumps(config))
    return model


def _assert_refused(code: int, err: list[str], model: Path, out: Path) -> None:
    assert code == 2 and len(err) == 1, err
    assert f"model {model}: its config.json does not match its weights (" in err[0], err
    assert err[0].endswith("restore the config.json that came with the weights, or copy or download the model "
                           "again"), err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("how", list(MISMATCHES))
def test_config_that_disagrees_with_the_weights_is_one_line(how, teacher_dir, tokenizer, corpus_dir, tmp_path,
                                                             capsys):
    model = _mismatched(teacher_dir, tmp_path, tokenizer, how)
    out = tmp_path / "eval.json"
    code, err = run_cli(["eval", "--model", str(model), "--text", str(corpus_dir), "--json-out", str(out), *EVAL],
                        capsys)
    _assert_refused(code, err, model, out)


@pytest.mark.parametrize("command", ["build-cache", "train", "quantize", "export", "generate-data", "generate"])
def test_every_command_refuses_a_config_that_disagrees_with_the_weights(command, teacher_dir, tokenizer, cache_dir,
                                                                        corpus_dir, tmp_path, capsys):
    model = _mismatched(teacher_dir, tmp_path, tokenizer, "a layer added")  # the silent case: random layer 2
    out = tmp_path / "out"
    argv = {"build-cache": ["--teacher", str(model), "--data", str(corpus_dir), "--seq-len", "32", "--max-tokens",
                            "300", "--out", str(out), "--device", "cpu"],
            "train": ["--model", str(model), "--cache", str(cache_dir), "--quant", "w2g32", "--max-steps", "1",
                      "--out", str(out), *TRAIN],
            "quantize": ["--model", str(model), "--quant", "w2g32", "--init", "none", "--out", str(out)],
            "export": ["--model", str(model), "--quant", "w2g32", "--out", str(out)],
            "generate-data": ["--model", str(model), "--data", str(corpus_dir), "--tokens", "50", "--out", str(out),
                              "--device", "cpu"],
            "generate": ["--model", str(model), "--raw", "--prompt", "the king", "--device", "cpu"]}[command]
    code, err = run_cli([command, *argv], capsys)
    _assert_refused(code, err, model, out)


def test_a_sound_model_still_loads_with_every_weight(teacher_dir):
    from safetensors.torch import load_file

    from qat_lora.data.models import load_causal_lm

    stored = load_file(str(teacher_dir / "model.safetensors"))
    loaded = load_causal_lm(teacher_dir).state_dict()
    assert stored.keys() <= loaded.keys() and all(torch.equal(loaded[k], v) for k, v in stored.items())


# ---------------------------------------------------------------------------------------------------------------
# A full disk, for real: a tmpfs of a few dozen KiB. Every library's own error (safetensors' SafetensorError,
# tokenizers' bare Exception, numpy's short write in the GGUF writer) ends in one line naming the path, exit 1,
# and no half-written file under a real name, no temp debris, the earlier files intact.

@pytest.fixture
def small_disk(tmp_path):
    """small_disk(kib): a tmpfs of that size mounted under tmp_path (unmounted at teardown, whatever happened)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a real full disk) needs root")
    mounted: list[Path] = []

    def mount(kib: int) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(point)],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot mount a tmpfs here ({e})")
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        if subprocess.run(["umount", str(point)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(point)], capture_output=True)  # still busy: detach it


def _assert_nothing_half_written(root: Path) -> None:
    """Every file under `root` is whole (each safetensors, JSON, JSONL and GGUF file reads to its end) and no
    temporary file or folder is left."""
    from safetensors import safe_open

    for path in sorted(root.rglob("*")):
        assert not (path.name.endswith(".tmp") or SAFETENSORS_TEMP.fullmatch(path.name)), f"debris: {path}"
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    f.get_tensor(key)
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".jsonl":
            [json.loads(line) for line in path.read_text().splitlines() if line]
        elif path.suffix == ".gguf":
            import gguf

            gguf.GGUFReader(str(path))


EXPORT = ["export", "--model", "{teacher}", "--out", "{out}"]
# (KiB of disk, command, what the one line names below --out, a regex): each size fills the disk in that write.
DISK_FULL_CASES = {
    "export dense": (128, EXPORT + ["--quant", "w2g32", "--format", "dense"], r"dense"),
    "export gguf": (64, EXPORT + ["--quant", "q4_0", "--format", "gguf"], r"gguf/model\.gguf"),
    "export adapter": (40, EXPORT + ["--quant", "w2g32", "--adapter", "{adapter}", "--format", "packed"],
                       r"adapter"),
    "export after its adapter": (200, EXPORT + ["--quant", "w2g32", "--adapter", "{adapter}", "--format", "packed"],
                                 r"packed(/model\.safetensors)?"),
    "train checkpoint": (60, ["train", "--model", "{teacher}", "--cache", "{cache}", "--out", "{out}", "--quant",
                              "w2g32", "--max-steps", "4", "--save-steps", "2", *TRAIN],
                         r"\.checkpoint-2\.tmp/\w+\.safetensors"),
    "build-cache shard": (24, ["build-cache", "--teacher", "{teacher}", "--data", "{corpus}", "--seq-len", "32",
                               "--max-tokens", "3000", "--out", "{out}", "--device", "cpu"],
                          r"(train|heldout)-r000-\d{5}\.safetensors|progress-r000\.json"),
    "generate-data shard": (8, ["generate-data", "--model", "{teacher}", "--data", "{corpus}", "--tokens", "3000",
                                "--max-new-tokens", "16", "--shard-samples", "20", "--out", "{out}", "--device",
                                "cpu"], r"part-\d{5}\.jsonl|generate\.json"),
}


@pytest.mark.parametrize("case", list(DISK_FULL_CASES))
def test_a_full_disk_is_one_line_naming_the_path_and_leaves_nothing_half_written(
        case, small_disk, teacher_dir, cache_dir, corpus_dir, run_w2, tmp_path, capsys):
    kib, argv, named = DISK_FULL_CASES[case]
    disk = small_disk(kib)
    notes = disk / "notes.txt"  # the user's earlier file on the same disk
    notes.write_text("the user's notes\n" * 64)
    out = disk / "out"
    paths = {"teacher": teacher_dir, "cache": cache_dir, "corpus": corpus_dir, "out": out,
             "adapter": run_w2 / "adapter"}
    code, err = run_cli([a.format(**paths) for a in argv], capsys)
    assert code == 1, err
    line = err[-1]
    said = re.fullmatch(rf"qat-lora {argv[0]}: error: \[Errno 28\] No space left on device: '{re.escape(str(out))}/"
                        rf"({named})'{re.escape(DISK_FULL)}", line)
    assert said, err
    assert not [e for e in err if "Traceback" in e or e.startswith("  File ")], err
    _assert_nothing_half_written(disk)
    assert notes.read_text() == "the user's notes\n" * 64
    if case == "export after its adapter":  # written whole before the disk filled: still loadable
        assert {p.name for p in (out / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}


# How the libraries word a full disk, and what each becomes: an OSError naming the path.
LIBRARY_ERRORS = [
    (lambda: __import__("safetensors").SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"), errno.ENOSPC),
    (lambda: Exception("No space left on device (os error 28)"), errno.ENOSPC),  # tokenizers
    (lambda: RuntimeError("[enforce fail at inline_container.cc:664] . No space left on device"), errno.ENOSPC),
    (lambda: OSError(errno.EDQUOT, "Disk quota exceeded"), errno.EDQUOT),
    (lambda: Exception("Read-only file system (os error 30)"), errno.EROFS),
    (lambda: ValueError("--lr nan: must be positive"), None),
    (lambda: KeyboardInterrupt(), None),
]


@pytest.mark.parametrize("make, code", LIBRARY_ERRORS, ids=lambda x: str(x) if isinstance(x, int) else None)
def test_disk_error_reads_each_librarys_wording(make, code, tmp_path):
    error = disk_error(make(), tmp_path / "model.safetensors")
    if code is None:
        assert error is None
    else:
        assert isinstance(error, OSError) and error.errno == code and error.filename == str(tmp_path /
                                                                                        "model.safetensors")


def test_a_short_write_on_a_disk_with_room_is_not_called_full(tmp_path):
    error = disk_error(OSError("4608 requested and 1984 written"), tmp_path / "model.gguf.tmp")
    assert error is not None and error.errno == errno.EIO  # tmp_path's disk has far more than 4608 bytes free


def test_a_safetensors_error_past_the_writers_is_still_one_line(monkeypatch, capsys):
    from safetensors import SafetensorError

    import qat_lora.commands.cli as cli

    def full(args):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(cli, "_presets", full)
    code, err = run_cli(["presets"], capsys)
    assert code == 1 and err == ["qat-lora presets: error: Error while serializing: I/O error: No space left on "
                                 "device (os error 28)" + DISK_FULL]


# ---------------------------------------------------------------------------------------------------------------
# chat with its input closed.

def test_chat_at_the_end_of_its_input_ends_cleanly(teacher_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # `< /dev/null`, Ctrl-D, a piped file that ended
    code, err = run_cli(["chat", "--model", str(teacher_dir), "--raw", "--device", "cpu"], capsys)
    assert code == 0 and err == ["qat-lora chat: end of input; conversation ended"], err


def test_chat_with_stdin_closed_ends_cleanly_without_loading_the_model(teacher_dir, monkeypatch, capsys):
    import qat_lora.commands.generate as generate

    def no_load(cfg):
        raise AssertionError("the model loaded for a chat that can read nothing")

    monkeypatch.setattr(sys, "stdin", None)  # `qat-lora chat <&-`: Python has no stdin at all
    monkeypatch.setattr(generate, "load_generator", no_load)
    code, err = run_cli(["chat", "--model", str(teacher_dir), "--raw", "--device", "cpu"], capsys)
    assert code == 0 and err == ["qat-lora chat: no input (stdin is closed); nothing to reply to"], err


# ---------------------------------------------------------------------------------------------------------------
# Something else where a file is expected: a folder by its name, a link that loops (running as root, chmod 000
# cannot make a file unreadable; these are what an open() then fails on), a file cut short.

def _as_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _as_loop(path: Path) -> None:
    path.unlink()
    os.symlink(path.name, path)


@pytest.mark.parametrize("spoil", [_as_folder, _as_loop], ids=["folder", "looping link"])
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json"])
def test_a_model_file_that_cannot_be_read_is_named(name, spoil, teacher_dir, corpus_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(teacher_dir, model)
    spoil(model / name)  # tokenizer_config.json: transformers skipped it and loaded another tokenizer, exit 0
    code, err = run_cli(["eval", "--model", str(model), "--text", str(corpus_dir), *EVAL], capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{model / name} is not a readable file; copy or download the model again" in err[0], err


def test_a_truncated_packed_export_is_named(teacher_dir, tmp_path, capsys):
    out = tmp_path / "export"
    assert main(["export", "--model", str(teacher_dir), "--quant", "w2g32", "--format", "packed", "--out",
                 str(out)]) == 0
    weights = out / "packed" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    capsys.readouterr()
    code, err = run_cli(["generate", "--model", str(out / "packed"), "--raw", "--prompt", "the king", "--device",
                         "cpu"], capsys)
    assert code == 2 and err[-1].startswith(f"qat-lora generate: error: {weights}: damaged or truncated ("), err
    assert err[-1].endswith("; export it again"), err
