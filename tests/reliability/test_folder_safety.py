"""Run and export folders: nothing the user has is wiped or mixed, whatever flags are passed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from qat_lora.commands.cli import main
from qat_lora.runtime.files import owner_stamp
from qat_lora.runtime.runs import RUN_KIND, prepare_run_dir

TRAIN = ["--batch-size", "4", "--lora-r", "4", "--warmup-steps", "1", "--device", "cpu"]


def _train_argv(teacher_dir, cache_dir, out, *extra) -> list[str]:
    return ["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--out", str(out), *TRAIN, *extra]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, teacher_dir, cache_dir) -> Path:
    out = tmp_path_factory.mktemp("runs") / "w2g32"
    assert main(_train_argv(teacher_dir, cache_dir, out, "--quant", "w2g32", "--max-steps", "2")) == 0
    return out


@pytest.mark.parametrize("extra, message", [
    (["--quant", "w3g32", "--max-steps", "2", "--resume", "auto"], "--quant 'w2g32', this run has 'w3g32'"),
    (["--quant", "w2g32", "--max-steps", "2", "--resume", "auto", "--lr", "0.01"], "--lr 0.001, this run has 0.01"),
    (["--quant", "w2g32", "--max-steps", "5", "--resume", "auto"], "--max-steps 2, this run has 5"),
    (["--quant", "w2g32", "--max-steps", "2"], "a run already exists there; pass --overwrite, --resume auto"),
])
def test_another_run_in_out_is_refused_and_kept(extra, message, finished_run, teacher_dir, cache_dir, capsys):
    before = _snapshot(finished_run)
    assert main(_train_argv(teacher_dir, cache_dir, finished_run, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert _snapshot(finished_run) == before


def test_resume_auto_on_the_finished_run_is_a_successful_no_op(finished_run, teacher_dir, cache_dir, capsys):
    before = _snapshot(finished_run)
    argv = _train_argv(teacher_dir, cache_dir, finished_run, "--quant", "w2g32", "--max-steps", "2", "--resume", "auto")
    assert main(argv) == 0
    assert "nothing to resume" in capsys.readouterr().out and _snapshot(finished_run) == before


def test_unfinished_run_without_checkpoint_restarts_only_with_the_same_settings(teacher_dir, cache_dir, tmp_path,
                                                                                capsys):
    out = tmp_path / "run"
    out.mkdir()
    saved = {"model": str(teacher_dir), "cache": str(cache_dir), "quant": "w3g32", "max_steps": 2,
             "preset": "recovery-lora"}  # a run's config.json from before runs were stamped
    (out / "config.json").write_text(json.dumps(saved))  # a run killed before its first checkpoint
    argv = _train_argv(teacher_dir, cache_dir, out, "--quant", "w2g32", "--max-steps", "2", "--resume", "auto")
    assert main(argv) == 2 and json.loads((out / "config.json").read_text()) == saved
    assert "config.json was written with --" in capsys.readouterr().err  # a settings mismatch, not a foreign file


def test_overwrite_removes_a_runs_files_and_save_debris_only(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / ".checkpoint-8.tmp").mkdir()
    run_files = ["config.json", "metrics.jsonl", "quantizer.safetensors", "config.json.tmp", ".tmpQx81Lz"]
    for name in run_files + ["notes.tmp", "mine.txt", ".tmp_keep"]:
        (out / name).write_text(json.dumps(owner_stamp(RUN_KIND)) if name == "config.json" else "x")
    prepare_run_dir(out, overwrite=True, resume_auto=False, resuming=False)
    assert sorted(p.name for p in out.iterdir()) == [".tmp_keep", "mine.txt", "notes.tmp"]


def test_out_that_is_a_file_is_refused(teacher_dir, cache_dir, tmp_path, capsys):
    target = tmp_path / "run.txt"
    target.write_text("notes")
    assert main(_train_argv(teacher_dir, cache_dir, target, "--quant", "w2g32", "--max-steps", "1")) == 2
    assert capsys.readouterr().err.strip().endswith("is a file; pass a folder for the run")
    assert target.read_text() == "notes"


def test_export_never_mixes_with_another_export_or_foreign_files(teacher_dir, tmp_path, capsys):
    out = tmp_path / "export"
    argv = ["export", "--model", str(teacher_dir), "--quant", "w3g32", "--format", "packed", "--out", str(out)]
    assert main(argv) == 0
    first = _snapshot(out)
    assert main([*argv[:-4], "--format", "dense", "--out", str(out)]) == 2  # another export, no --overwrite
    assert "holds an earlier export; pass --overwrite" in capsys.readouterr().err and _snapshot(out) == first
    assert main([*argv[:-4], "--format", "dense", "--out", str(out), "--overwrite"]) == 0
    assert (out / "dense").is_dir() and not (out / "packed").exists()  # replaced, not mixed
    (out / "notes.md").write_text("mine")
    assert main([*argv, "--overwrite"]) == 2
    assert "holds files an export did not write (notes.md)" in capsys.readouterr().err
    assert (out / "notes.md").read_text() == "mine" and (out / "dense").is_dir()
