"""No user folder is ever deleted or overwritten, and no run silently mixes with another (issue 31):
--overwrite removes only what the toolkit proves it wrote (its record file), an --out that is, contains or lies
inside an input is refused, two commands never write one folder at once, quantisers and adapters refuse a model
of the same shapes they were not made from, a resume refuses changed inputs, and every file written keeps the
user's umask. Each case failed before its fix."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from qat_lora.commands.cli import main
from qat_lora.runtime.files import FolderLock
from tests.conftest import make_model_dir

FAST = ["--batch-size", "4", "--lora-r", "4", "--warmup-steps", "1", "--device", "cpu"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, [line for line in err.splitlines() if line.strip()]


def _train(teacher, cache, out, *extra) -> list[str]:
    return [str(a) for a in ["train", "--model", teacher, "--cache", cache, "--out", out, "--quant", "w2g32",
                             "--max-steps", "2", *FAST, *extra]]


@pytest.fixture(scope="module")
def twin_dir(tmp_path_factory, tokenizer) -> Path:
    """A model of exactly the teacher's shapes and tokenizer, with other weights."""
    return make_model_dir(tmp_path_factory.mktemp("twin"), tokenizer, "llama", seed=7, init_std=0.25)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, teacher_dir, cache_dir) -> Path:
    out = tmp_path_factory.mktemp("runs") / "w2g32"
    assert main(_train(teacher_dir, cache_dir, out, "--preset", "qat+lora", "--save-steps", "1")) == 0
    return out


@pytest.fixture()
def user_model(tmp_path, teacher_dir) -> Path:
    """The user's own model folder, mymodels/dense (a copy of the tiny teacher)."""
    folder = tmp_path / "mymodels" / "dense"
    shutil.copytree(teacher_dir, folder)
    return folder


# --- --overwrite removes only what the toolkit proves it wrote ---------------------------------------------------

def test_export_into_the_folder_holding_its_model_is_refused(user_model, capsys):
    before = _snapshot(user_model.parent)
    code, err = run_cli(["export", "--model", user_model, "--quant", "w3g32", "--format", "packed",
                         "--out", user_model.parent, "--overwrite"], capsys)
    assert code == 2 and len(err) == 1 and "contains --model" in err[0], err
    assert _snapshot(user_model.parent) == before


@pytest.mark.parametrize("record", [None, {"notes": "mine"}, "not json"])
def test_export_overwrite_needs_an_export_record(record, user_model, teacher_dir, capsys):
    out = user_model.parent  # holds dense/ (and maybe an export.json of the user's), no export wrote it
    if record is not None:
        (out / "export.json").write_text(record if isinstance(record, str) else json.dumps(record))
    before = _snapshot(out)
    code, err = run_cli(["export", "--model", teacher_dir, "--quant", "w3g32", "--format", "packed", "--out", out,
                         "--overwrite"], capsys)
    # A damaged record is said to be damaged (nothing proves the folder an export), not missing.
    expected = "export.json is damaged (cut short?)" if record == "not json" else "no export.json of a qat-lora export"
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert _snapshot(out) == before


def test_train_overwrite_into_another_model_folder_keeps_its_config(user_model, teacher_dir, cache_dir, capsys):
    before = _snapshot(user_model)
    code, err = run_cli(_train(teacher_dir, cache_dir, user_model, "--overwrite"), capsys)
    assert code == 2 and len(err) == 1 and "config.json was not written by a qat-lora run" in err[0], err
    assert _snapshot(user_model) == before


@pytest.mark.parametrize("flags", [[], ["--overwrite"], ["--resume", "auto"]])
def test_train_into_its_own_model_folder_is_refused(flags, user_model, cache_dir, capsys):
    before = _snapshot(user_model)
    code, err = run_cli(_train(user_model, cache_dir, user_model, *flags), capsys)
    assert code == 2 and len(err) == 1 and f"is --model {user_model}" in err[0], err
    assert _snapshot(user_model) == before


@pytest.mark.parametrize("entry", ["adapter", "checkpoint-4", "quantizer.safetensors"])
def test_train_never_writes_over_a_users_run_files(entry, tmp_path, teacher_dir, cache_dir, capsys):
    out = tmp_path / "mine"
    target = out / entry
    if entry.endswith(".safetensors"):
        out.mkdir()
        target.write_bytes(b"the user's")
    else:
        target.mkdir(parents=True)
        (target / "adapter_config.json").write_text("{}")
    before = _snapshot(out)
    for flags in ([], ["--overwrite"]):
        code, err = run_cli(_train(teacher_dir, cache_dir, out, *flags), capsys)
        assert code == 2 and len(err) == 1 and f"holds {entry} that no qat-lora run recorded" in err[0], err
    assert _snapshot(out) == before


def test_recover_refuses_a_users_stage_folder_before_any_work(tmp_path, teacher_dir, cache_dir, capsys):
    out = tmp_path / "rec"
    (out / "lora" / "adapter").mkdir(parents=True)
    (out / "lora" / "adapter" / "adapter_config.json").write_text("{}")
    code, err = run_cli(["recover", "--model", teacher_dir, "--cache", cache_dir, "--quant", "w2g32", "--out", out,
                         "--device", "cpu"], capsys)
    assert code == 2 and len(err) == 1 and "holds adapter that no qat-lora run recorded" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["lora"]  # no init/ computed first


def test_quantize_overwrite_keeps_a_users_quantizer(tmp_path, teacher_dir, capsys):
    out = tmp_path / "init"
    out.mkdir()
    (out / "quantizer.safetensors").write_bytes(b"the user's")
    code, err = run_cli(["quantize", "--model", teacher_dir, "--quant", "w2g32", "--init", "none", "--out", out,
                         "--overwrite"], capsys)
    assert code == 2 and len(err) == 1 and "that `qat-lora quantize` did not write" in err[0], err
    assert (out / "quantizer.safetensors").read_bytes() == b"the user's"


# --- an --out that is, contains or lies inside an input ------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["train", "--model", "{teacher}", "--cache", "{cache}", "--quant", "w2g32", "--out", "{cache}"], "is --cache"),
    (["train", "--model", "{teacher}", "--cache", "{cache}", "--quant", "w2g32", "--out", "{cache}/run"],
     "lies inside --cache"),
    (["quantize", "--model", "{teacher}", "--quant", "w2g32", "--init", "none", "--out", "{teacher}"], "is --model"),
    (["quantize", "--model", "{teacher}", "--quant", "w2g32", "--init", "none", "--out", "{teacher}/.."],
     "contains --model"),
    (["recover", "--model", "{teacher}", "--cache", "{cache}", "--quant", "w2g32", "--out", "{teacher}/rec"],
     "lies inside --model"),
    (["export", "--model", "{teacher}", "--quant", "w2g32", "--out", "{teacher}"], "is --model"),
])
def test_out_overlapping_an_input_is_refused(argv, message, teacher_dir, cache_dir, capsys):
    paths = {"teacher": teacher_dir, "cache": cache_dir}
    before = {name: _snapshot(p) for name, p in paths.items()}
    code, err = run_cli([a.format(**paths) for a in argv], capsys)
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert {name: _snapshot(p) for name, p in paths.items()} == before


# --- one command per folder at a time -----------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["train", "export", "quantize", "recover"])
def test_a_second_command_into_a_busy_folder_fails_at_once(command, tmp_path, teacher_dir, cache_dir, capsys):
    out = tmp_path / "busy"
    argv = {"train": _train(teacher_dir, cache_dir, out),
            "export": ["export", "--model", teacher_dir, "--quant", "w2g32", "--out", out],
            "quantize": ["quantize", "--model", teacher_dir, "--quant", "w2g32", "--init", "none", "--out", out],
            "recover": ["recover", "--model", teacher_dir, "--cache", cache_dir, "--quant", "w2g32", "--out", out,
                        "--device", "cpu"]}[command]
    with FolderLock(out):  # the first command, still writing
        code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1 and "another qat-lora command is writing there now" in err[0], err
    assert list(out.iterdir()) == []


# --- quantisers and adapters belong to one model --------------------------------------------------------------------

@pytest.mark.parametrize("command", ["train", "eval", "export"])
def test_a_quantizer_refuses_a_model_of_the_same_shapes(command, finished_run, twin_dir, cache_dir, corpus_dir,
                                                        tmp_path, capsys):
    quantizer = finished_run / "quantizer.safetensors"
    argv = {"train": _train(twin_dir, cache_dir, tmp_path / "out", "--quantizer", quantizer),
            "eval": ["eval", "--model", twin_dir, "--quantizer", quantizer, "--text", corpus_dir, "--seq-len", "32",
                     "--json-out", tmp_path / "out.json"],
            "export": ["export", "--model", twin_dir, "--quantizer", quantizer, "--out", tmp_path / "out"]}[command]
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1 and f"--quantizer {quantizer}: made from other weights" in err[0], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["eval", "export"])
def test_an_adapter_refuses_a_model_of_the_same_shapes(command, finished_run, twin_dir, corpus_dir, tmp_path, capsys):
    adapter = finished_run / "adapter"
    argv = {"eval": ["eval", "--model", twin_dir, "--adapter", adapter, "--text", corpus_dir, "--seq-len", "32",
                     "--json-out", tmp_path / "out.json"],
            "export": ["export", "--model", twin_dir, "--adapter", adapter, "--out", tmp_path / "out"]}[command]
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1 and f"--adapter {adapter}: made from other weights" in err[0], err


def test_the_same_model_copied_elsewhere_is_accepted(finished_run, teacher_dir, corpus_dir, tmp_path, capsys):
    copy = tmp_path / "moved-teacher"
    shutil.copytree(teacher_dir, copy)
    code, _ = run_cli(["eval", "--model", copy, "--quantizer", finished_run / "quantizer.safetensors", "--adapter",
                       finished_run / "adapter", "--text", corpus_dir, "--seq-len", "32",
                       "--json-out", tmp_path / "out.json"], capsys)
    assert code == 0 and json.loads((tmp_path / "out.json").read_text())


# --- a resume never mixes two sets of inputs ------------------------------------------------------------------------

def _interrupted(finished_run, tmp_path) -> Path:
    """The finished run as a kill after checkpoint-1 would have left it."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    for name in ("summary.json", "adapter", "quantizer.safetensors"):
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    return run


def _rebuilt_cache(cache_dir, tmp_path) -> Path:
    """A copy of the cache whose manifest says its shards changed (as a rebuild on another corpus would)."""
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["corpus_sha256"] = "0" * 64
    (cache / "manifest.json").write_text(json.dumps(manifest))
    return cache


@pytest.mark.parametrize("changed", ["cache", "model"])
@pytest.mark.parametrize("finished", [False, True])
def test_resume_after_an_input_changed_is_refused(changed, finished, finished_run, teacher_dir, twin_dir, cache_dir,
                                                  tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run) if finished else _interrupted(finished_run, tmp_path)
    model, cache = tmp_path / "model", cache_dir
    shutil.copytree(teacher_dir, model)
    argv = _train(model, cache, run, "--preset", "qat+lora", "--save-steps", "1", "--resume", "auto")
    config = json.loads((run / "config.json").read_text())
    config.update(model=str(model))  # the run was made from this very copy, which then changes
    (run / "config.json").write_text(json.dumps(config))
    if changed == "cache":
        argv[argv.index("--cache") + 1] = str(_rebuilt_cache(cache_dir, tmp_path))
        config.update(cache=argv[argv.index("--cache") + 1])
        (run / "config.json").write_text(json.dumps(config))
    else:
        shutil.rmtree(model)
        shutil.copytree(twin_dir, model)  # same shapes, other weights, same path
    for state in run.glob("checkpoint-*/state.json"):  # the checkpoint's flags name the same paths
        saved = json.loads(state.read_text())
        saved["config"].update(model=config["model"], cache=config["cache"])
        state.write_text(json.dumps(saved))
    before = _snapshot(run)
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1 and f"--{changed} " in err[0] and "whose contents differ" in err[0], err
    assert _snapshot(run) == before


# --- files keep the user's umask ------------------------------------------------------------------------------------

def test_every_file_written_follows_the_umask(finished_run, teacher_dir, tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "export"
        assert main(["export", "--model", str(teacher_dir), "--quantizer", str(finished_run / "quantizer.safetensors"),
                     "--adapter", str(finished_run / "adapter"), "--format", "both", "--out", str(out)]) == 0
        init = tmp_path / "init"
        assert main(["quantize", "--model", str(teacher_dir), "--quant", "w2g32", "--init", "none",
                     "--out", str(init)]) == 0
    finally:
        os.umask(old)
    written = [p for folder in (finished_run, out, init) for p in folder.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in written)
    wrong = {str(p): oct(p.stat().st_mode & 0o777) for p in written if p.stat().st_mode & 0o777 != 0o644}
    assert not wrong


@pytest.mark.parametrize("target", ["{teacher}/config.json", "{quantizer}"])
def test_eval_json_out_onto_an_input_is_refused(target, finished_run, teacher_dir, corpus_dir, capsys):
    paths = {"teacher": teacher_dir, "quantizer": finished_run / "quantizer.safetensors"}
    json_out = Path(target.format(**paths))
    before = json_out.read_bytes()
    code, err = run_cli(["eval", "--model", teacher_dir, "--quantizer", paths["quantizer"], "--text", corpus_dir,
                         "--seq-len", "32", "--json-out", json_out], capsys)
    assert code == 2 and len(err) == 1 and f"--json-out {json_out}: " in err[0], err
    assert json_out.read_bytes() == before
