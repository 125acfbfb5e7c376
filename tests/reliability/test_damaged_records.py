"""A record file the toolkit wrote, then damaged or hand-edited (valid JSON of the wrong shape, a field missing or
of another type), is one line naming it, or is treated as absent where that is safe; never a KeyError or
TypeError traceback, and never a download (found by a careless-user probe, issue 31)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qat_lora.commands.cli import main

from .test_user_mistakes import run_cli

TRAIN = ["--quant", "w2g32", "--batch-size", "4", "--lora-r", "4", "--warmup-steps", "1", "--device", "cpu",
         "--max-steps", "2", "--save-steps", "1"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, teacher_dir, cache_dir) -> Path:
    out = tmp_path_factory.mktemp("runs") / "run"
    assert main(["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--out", str(out), *TRAIN]) == 0
    return out


def _copy(finished: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "run"))


def _resume(teacher_dir, cache_dir, run: Path) -> list[str]:
    return ["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--out", str(run), *TRAIN,
            "--resume", "auto"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("state", [[], {"files": {}}, {"files": {"../x": "0"}, "step": 1}])
def test_a_damaged_checkpoint_state_is_named_and_the_run_kept(state, finished, teacher_dir, cache_dir, tmp_path,
                                                             capsys):
    run = _copy(finished, tmp_path)
    (run / "summary.json").unlink()  # unfinished: --resume auto looks at its checkpoint
    (run / "checkpoint-1" / "state.json").write_text(json.dumps(state))
    before = _snapshot(run)
    code = main(_resume(teacher_dir, cache_dir, run))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "checkpoint-1 cannot be resumed (state.json" in captured.out
    # Its only checkpoint is damaged: starting over would delete it and the metrics, which takes --overwrite.
    assert code == 2 and "every checkpoint in" in captured.err and _snapshot(run) == before


@pytest.mark.parametrize("summary", [[], {"steps": "2"}, {"steps": None}])
def test_a_damaged_summary_is_not_a_finished_run(summary, finished, teacher_dir, cache_dir, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    (run / "summary.json").write_text(json.dumps(summary))
    code = main(_resume(teacher_dir, cache_dir, run))
    assert "Traceback" not in capsys.readouterr().err
    assert code == 0 and json.loads((run / "summary.json").read_text())["steps"] == 2  # resumed and finished


@pytest.mark.parametrize("damage, message", [
    (lambda a: (a / "adapter_config.json").write_text("[]"), "is not a PEFT LoRA config"),
    (lambda a: (a / "adapter_config.json").write_text('{"r": 4}'), "is not a PEFT LoRA config"),
    (lambda a: (a / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
])
@pytest.mark.parametrize("command", ["eval", "export"])
def test_a_damaged_adapter_is_one_line_and_never_a_download(command, damage, message, finished, teacher_dir,
                                                            corpus_dir, tmp_path, capsys):
    adapter = _copy(finished, tmp_path) / "adapter"
    damage(adapter)
    out = tmp_path / "out"
    tail = ["--text", str(corpus_dir), "--seq-len", "32", "--json-out", str(out)] if command == "eval" else \
        ["--out", str(out)]
    code, err = run_cli([command, "--model", str(teacher_dir), "--adapter", str(adapter), *tail], capsys)
    assert code == 2 and len(err) == 1 and f"--adapter {adapter}: " in err[0] and message in err[0], err
    assert not out.exists()


def test_a_damaged_adapter_record_checks_nothing_but_loads(finished, teacher_dir, corpus_dir, tmp_path, capsys):
    adapter = _copy(finished, tmp_path) / "adapter"
    (adapter / "qat_lora.json").write_text(json.dumps({"qat_lora.model_signature": 12}))
    code, err = run_cli(["eval", "--model", str(teacher_dir), "--adapter", str(adapter), "--text", str(corpus_dir),
                         "--seq-len", "32", "--json-out", str(tmp_path / "e.json")], capsys)
    assert code == 0, err


@pytest.mark.parametrize("records", [[{"step": 1, "loss": 2.0}], [{"step": "1", "loss": 2.0, "lr": 1e-3}], [[1, 2]]])
def test_plot_skips_records_of_another_shape(records, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    good = {"step": 2, "loss": 1.5, "lr": 1e-3}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*records, good]))
    code, err = run_cli(["plot", str(run)], capsys)
    assert code == 0 and (run / "curves.png").stat().st_size > 0, err


@pytest.mark.parametrize("resume, message", [("{other}/checkpoint-1", "not a checkpoint-N folder of --out"),
                                             ("checkpoint-1", None)])
def test_resume_names_only_this_runs_checkpoints(resume, message, finished, teacher_dir, cache_dir, tmp_path, capsys):
    run, other = _copy(finished, tmp_path), Path(shutil.copytree(finished, tmp_path / "other"))
    (run / "summary.json").unlink()
    before = _snapshot(run)
    argv = _resume(teacher_dir, cache_dir, run)
    argv[-1] = resume.format(other=other)  # a name is looked up in --out, not in the working folder
    code, err = run_cli(argv, capsys)
    if message:
        assert code == 2 and len(err) == 1 and message in err[0] and _snapshot(run) == before, err
    else:
        assert code == 0 and json.loads((run / "summary.json").read_text())["steps"] == 2, err


def test_eval_json_out_replaces_only_an_earlier_result(finished, teacher_dir, corpus_dir, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    argv = ["eval", "--model", str(teacher_dir), "--text", str(corpus_dir), "--seq-len", "32", "--json-out"]
    code, err = run_cli([*argv, str(notes)], capsys)
    assert code == 2 and len(err) == 1 and "is not an earlier `qat-lora eval` result" in err[0] and \
        notes.read_text() == "mine"
    result = tmp_path / "eval.json"
    assert run_cli([*argv, str(result)], capsys)[0] == 0 and run_cli([*argv, str(result)], capsys)[0] == 0


def test_plot_replaces_a_link_never_what_it_points_to(finished, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = _copy(finished, tmp_path)
    target = tmp_path / "heldout.txt"
    target.write_text("the user's text")
    (run / "curves.png").symlink_to(target)
    assert run_cli(["plot", str(run)], capsys)[0] == 0
    assert target.read_text() == "the user's text" and not (run / "curves.png").is_symlink()


def test_overwrite_keeps_lookalikes_and_never_follows_links(finished, teacher_dir, cache_dir, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    (run / "checkpoint-notes.txt").write_text("mine")
    elsewhere = Path(shutil.copytree(run / "checkpoint-1", tmp_path / "backup"))
    (run / "checkpoint-7").symlink_to(elsewhere)
    argv = ["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--out", str(run), *TRAIN, "--overwrite"]
    assert run_cli(argv, capsys)[0] == 0
    assert (run / "checkpoint-notes.txt").read_text() == "mine" and (elsewhere / "state.json").is_file()


def test_train_refuses_a_quantizer_of_another_preset(finished, teacher_dir, cache_dir, tmp_path, capsys):
    out = tmp_path / "qat"
    qat = TRAIN[:TRAIN.index("--lora-r")] + TRAIN[TRAIN.index("--lora-r") + 2:]  # qat trains no LoRA: no --lora-r
    assert main(["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--out", str(out), *qat,
                 "--preset", "qat"]) == 0
    argv = ["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--out", str(tmp_path / "next"),
            *TRAIN, "--quantizer", str(out / "quantizer.safetensors")]
    argv[argv.index("w2g32")] = "w3g32"
    capsys.readouterr()
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1 and "was trained with --quant w2g32" in err[0], err


def test_quantize_never_saves_a_nan_init(teacher_dir, cache_dir, tmp_path, capsys, monkeypatch):
    import qat_lora.commands.quantize as ptq

    def explode(model, *args, **kwargs):  # a block-wise stage that diverged
        for name, p in ptq.quantizer_state_dict(model).items():
            p.data.fill_(float("nan"))
        return {}

    monkeypatch.setattr(ptq, "reconstruct_blocks_", explode)
    out = tmp_path / "init"
    code, err = run_cli(["quantize", "--model", str(teacher_dir), "--quant", "w2g32", "--init", "none", "--cache",
                         str(cache_dir), "--blockwise-steps", "1", "--calib-sequences", "4", "--batch-size", "4",
                         "--out", str(out)], capsys)
    assert code == 1 and len(err) == 1 and "is not finite after the init" in err[0], err
    assert not (out / "quantizer.safetensors").exists()


@pytest.mark.parametrize("found", ["config.json", "demo.json"])
def test_demo_never_writes_into_a_model_folder_or_over_a_users_demo_json(found, tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / found).write_text('{"notes": "mine"}')
    code, err = run_cli(["demo", "--work-dir", str(work), "--assets-dir", str(tmp_path / "assets")], capsys)
    assert code == 2 and len(err) == 1 and f"--work-dir {work}: holds a" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]  # nothing downloaded, nothing written
    assert (work / found).read_text() == '{"notes": "mine"}'


def test_plot_out_naming_a_folder_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run, folder = tmp_path / "run", tmp_path / "figures"
    run.mkdir()
    folder.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "lr": 1e-3}) + "\n")
    code, err = run_cli(["plot", str(run), "--out", str(folder)], capsys)
    assert code == 2 and err == [f"qat-lora plot: error: plot --out {folder}: is a folder; pass a file name such as "
                                 f"{folder / 'curves.png'}"], err
    assert list(folder.iterdir()) == []  # no temp file left behind
