"""A student is its base (preset + quantiser) and its adapter (issue 50): an adapter brings the quantiser it was
trained over (used when --quantizer is left out, a different one refused, a missing one named), demo.json names
every path its student needs, an --out inside a fetched teacher's asset folder is refused when --model names the
teacher, a finished recover folder given by another path or copied is accepted while a changed one is refused, and
recover's LoRA start keeps the umask's file modes. Each case failed before its fix."""
from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from qat_lora.commands.cli import main

TRAIN = ["--batch-size", "4", "--lora-r", "4", "--lora-alpha", "8", "--warmup-steps", "1", "--device", "cpu"]
EVAL = ["--seq-len", "32", "--max-tokens", "400", "--device", "cpu"]
INFO = "trained over --quantizer"


def run_cli(argv: list, capsys) -> tuple[int, list[str], str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, [line for line in captured.err.splitlines() if line.strip()], captured.out


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def gptq_run(tmp_path_factory, teacher_dir, cache_dir) -> dict[str, Path]:
    """A GPTQ init, a recovery-lora run over it (the demo's chain), and a round-to-nearest init of the same preset."""
    root = tmp_path_factory.mktemp("student")
    assert main(["quantize", "--model", str(teacher_dir), "--quant", "w2g32", "--init", "gptq", "--cache",
                 str(cache_dir), "--calib-sequences", "8", "--out", str(root / "init")]) == 0
    assert main(["quantize", "--model", str(teacher_dir), "--quant", "w2g32", "--init", "none",
                 "--out", str(root / "rtn")]) == 0
    assert main(["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--quant", "w2g32", "--quantizer",
                 str(root / "init" / "quantizer.safetensors"), "--max-steps", "2", "--out", str(root / "run"),
                 *TRAIN]) == 0
    return {"root": root, "init": root / "init" / "quantizer.safetensors",
            "rtn": root / "rtn" / "quantizer.safetensors", "adapter": root / "run" / "adapter"}


def _eval(teacher_dir, corpus_dir, adapter, *extra) -> list:
    return ["eval", "--model", teacher_dir, "--adapter", adapter, "--text", corpus_dir / "b.txt", *EVAL, *extra]


# --- an adapter brings the base it was trained over ------------------------------------------------------------------

def test_eval_of_an_adapter_loads_the_quantiser_it_was_trained_over(gptq_run, teacher_dir, corpus_dir, tmp_path,
                                                                    capsys):
    named, left_out = tmp_path / "named.json", tmp_path / "left-out.json"
    code, err, _ = run_cli(_eval(teacher_dir, corpus_dir, gptq_run["adapter"], "--quantizer", gptq_run["init"],
                                 "--json-out", named), capsys)
    assert code == 0 and not any(INFO in line for line in err), err
    code, err, _ = run_cli(_eval(teacher_dir, corpus_dir, gptq_run["adapter"], "--json-out", left_out), capsys)
    assert code == 0 and sum(INFO in line and str(gptq_run["init"]) in line for line in err) == 1, err
    named, left_out = json.loads(named.read_text()), json.loads(left_out.read_text())
    assert left_out["quantizer"] == str(gptq_run["init"])  # was None: the adapter over round-to-nearest weights
    assert left_out["ppl"] == pytest.approx(named["ppl"], rel=1e-6)


@pytest.mark.parametrize("command", ["eval", "generate", "export"])
def test_another_quantiser_under_the_adapter_is_refused(command, gptq_run, teacher_dir, corpus_dir, tmp_path, capsys):
    out = tmp_path / "out"
    tail = {"eval": ["--text", corpus_dir / "b.txt", *EVAL, "--json-out", out],
            "generate": ["--raw", "--prompt", "the king", "--max-new-tokens", "2"], "export": ["--out", out]}[command]
    code, err, _ = run_cli([command, "--model", teacher_dir, "--adapter", gptq_run["adapter"], "--quantizer",
                            gptq_run["rtn"], *tail], capsys)
    assert code == 2 and len(err) == 1, err
    record = gptq_run["adapter"].resolve() / "qat_lora.json"
    assert err[0].endswith(f"--quantizer {gptq_run['rtn']}: --adapter {gptq_run['adapter']} was trained over another "
                           f"quantiser ({gptq_run['init'].resolve()}, {record}); drop --quantizer to load that one, "
                           "or pass a copy of it")
    assert not out.exists()


def test_a_copy_of_the_quantiser_passes(gptq_run, teacher_dir, corpus_dir, tmp_path, capsys):
    copy = tmp_path / "elsewhere" / "quantizer.safetensors"
    copy.parent.mkdir()
    shutil.copy2(gptq_run["init"], copy)
    code, err, _ = run_cli(_eval(teacher_dir, corpus_dir, gptq_run["adapter"], "--quantizer", copy), capsys)
    assert code == 0, err


def _without_the_original_init(gptq_run, argv: list, capsys) -> tuple[int, list[str], str]:
    """Run `argv` while the init the run was trained over is moved away (its record's absolute path is gone)."""
    moved = gptq_run["root"] / "moved.safetensors"
    os.replace(gptq_run["init"], moved)
    try:
        return run_cli(argv, capsys)
    finally:
        os.replace(moved, gptq_run["init"])


def test_a_missing_base_quantiser_is_named(gptq_run, teacher_dir, corpus_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(gptq_run["root"] / "run", run)  # the run alone: neither of its init's paths holds the file
    code, err, _ = _without_the_original_init(gptq_run, _eval(teacher_dir, corpus_dir, run / "adapter"), capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].endswith(f"--adapter {run / 'adapter'}: its base quantiser {gptq_run['init'].resolve()} "
                           f"({run.resolve() / 'adapter' / 'qat_lora.json'}) is missing; pass --quantizer with an "
                           "intact copy of the file it was trained over"), err


@pytest.mark.parametrize("damage", ["truncated", "folder", "loop"])
def test_a_damaged_adapter_record_is_refused_not_skipped(damage, gptq_run, teacher_dir, corpus_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(gptq_run["root"] / "run", run)
    record = run / "adapter" / "qat_lora.json"
    if damage == "truncated":
        record.write_text(record.read_text()[:20])
    else:
        record.unlink()
        record.mkdir() if damage == "folder" else record.symlink_to(record)
    code, err, _ = run_cli(_eval(teacher_dir, corpus_dir, run / "adapter"), capsys)
    # The record names the model and base the adapter was trained on: damaged, it must not silently check nothing.
    assert code == 2 and len(err) == 1 and "qat_lora.json is damaged or unreadable" in err[0], err


def test_a_changed_base_quantiser_is_refused(gptq_run, teacher_dir, corpus_dir, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(gptq_run["root"], copy)
    tensors = load_file(copy / "init" / "quantizer.safetensors")
    name = next(k for k in tensors if tensors[k].is_floating_point())
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, copy / "init" / "quantizer.safetensors")  # other bytes where the run's relative path points
    code, err, _ = _without_the_original_init(gptq_run, _eval(teacher_dir, corpus_dir, copy / "run" / "adapter"),
                                              capsys)
    assert code == 2 and len(err) == 1 and "has changed since the adapter was trained" in err[0], err


def test_a_copied_run_and_init_find_each_other(gptq_run, teacher_dir, corpus_dir, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(gptq_run["root"], copy)
    code, err, _ = run_cli(_eval(teacher_dir, corpus_dir, copy / "run" / "adapter", "--json-out", tmp_path / "e.json"),
                           capsys)
    assert code == 0 and json.loads((tmp_path / "e.json").read_text())["quantizer"] == str(
        (copy / "init" / "quantizer.safetensors").resolve()), err


def test_an_adapter_written_before_it_recorded_its_base_falls_back_to_its_run(gptq_run, teacher_dir, corpus_dir,
                                                                              tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(gptq_run["root"] / "run", run)
    record = json.loads((run / "adapter" / "qat_lora.json").read_text())
    (run / "adapter" / "qat_lora.json").write_text(json.dumps({k: v for k, v in record.items() if k != "base"}))
    code, err, _ = run_cli(_eval(teacher_dir, corpus_dir, run / "adapter", "--json-out", tmp_path / "e.json"), capsys)
    assert code == 0 and json.loads((tmp_path / "e.json").read_text())["quantizer"] == str(gptq_run["init"]), err
    assert sum(f"({run.resolve() / 'config.json'})" in line for line in err) == 1, err
    code, err, _ = run_cli(_eval(teacher_dir, corpus_dir, run / "adapter", "--quantizer", gptq_run["rtn"]), capsys)
    assert code == 2 and len(err) == 1 and "was trained over another quantiser" in err[0], err


def test_generate_from_the_demos_recorded_command_answers_as_with_its_quantiser(gptq_run, teacher_dir, tmp_path,
                                                                                capsys):
    from qat_lora.commands.config import DemoConfig
    from qat_lora.commands.demo import student_record

    student = student_record(DemoConfig(quant="w2g32", work_dir=str(tmp_path)), str(teacher_dir),
                             str(gptq_run["init"]), str(gptq_run["adapter"]), "", "")
    assert student["quantizer"] == str(gptq_run["init"])  # demo.json named no quantiser under the adapter
    recorded = shlex.split(student["commands"]["generate"])[1:]
    code, _, with_quantizer = run_cli([*recorded, "--raw", "--max-new-tokens", "6"], capsys)
    assert code == 0
    prompt = recorded[recorded.index("--prompt") + 1]
    typed = ["generate", "--model", teacher_dir, "--adapter", gptq_run["adapter"], "--prompt", prompt,
             "--raw", "--max-new-tokens", "6"]  # what a user types after the demo: no --quant, no --quantizer
    code, err, left_out = run_cli(typed, capsys)
    assert code == 0 and left_out == with_quantizer and sum(INFO in line for line in err) == 1, err


def test_export_of_an_adapter_records_and_uses_its_quantiser(gptq_run, teacher_dir, tmp_path, capsys):
    out = tmp_path / "export"
    code, err, _ = run_cli(["export", "--model", teacher_dir, "--adapter", gptq_run["adapter"], "--format", "packed",
                            "--out", out], capsys)
    assert code == 0 and json.loads((out / "export.json").read_text())["config"]["quantizer"] == \
        str(gptq_run["init"]), err


def test_train_from_an_adapter_refuses_another_quantiser(gptq_run, teacher_dir, cache_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code, err, _ = run_cli(["train", "--model", teacher_dir, "--cache", cache_dir, "--quant", "w2g32", "--quantizer",
                            gptq_run["rtn"], "--lora-init", gptq_run["adapter"], "--max-steps", "1", "--out", out,
                            *TRAIN], capsys)
    assert code == 2 and len(err) == 1 and err[0].endswith(
        f"--quantizer {gptq_run['rtn']}: --lora-init {gptq_run['adapter']} was trained over another quantiser "
        f"({gptq_run['init'].resolve()}, {gptq_run['adapter'].resolve() / 'qat_lora.json'}); drop --quantizer to "
        "load that one, or pass a copy of it"), err
    assert not out.exists()


# --- a fetched teacher's name stands for its folder ------------------------------------------------------------------

@pytest.fixture()
def fetched_teacher(tmp_path, teacher_dir, monkeypatch) -> Path:
    """A fetch-assets folder under QAT_LORA_HOME whose smollm2-135m is the tiny teacher; returns its folder."""
    from qat_lora.data import assets

    root = tmp_path / "home" / "assets"
    folder = root / assets.TEACHER_DIR
    shutil.copytree(teacher_dir, folder)
    for name in assets.TEXT_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("text\n")
    (root / assets.MANIFEST).write_text(json.dumps({
        "format": assets.FORMAT, "text": {name: {} for name in assets.TEXT_FILES},
        "teachers": {"smollm2-135m": {"folder": assets.TEACHER_DIR,
                                      "files": sorted(p.name for p in folder.iterdir())}}}))
    monkeypatch.setenv("QAT_LORA_HOME", str(tmp_path / "home"))
    assert assets.assets_ready(root, "smollm2-135m")
    return folder


@pytest.mark.parametrize("command", ["quantize", "export", "train", "recover"])
def test_out_inside_a_fetched_teachers_folder_is_refused_by_its_name(command, fetched_teacher, cache_dir, capsys):
    out = fetched_teacher / "student"
    before = _snapshot(fetched_teacher)
    tail = {"quantize": ["--quant", "w2g32", "--init", "none"], "export": ["--quant", "w2g32"],
            "train": ["--cache", cache_dir, "--quant", "w2g32", "--max-steps", "1", *TRAIN],
            "recover": ["--cache", cache_dir, "--quant", "w2g32", "--device", "cpu"]}[command]
    code, err, _ = run_cli([command, "--model", "smollm2-135m", "--out", out, *tail], capsys)
    assert code == 2 and len(err) == 1, err
    assert f"--out {out}: lies inside --model smollm2-135m ({fetched_teacher}); writing there" in err[0], err
    assert _snapshot(fetched_teacher) == before and not out.exists()


# --- a finished recover folder is the same folder by any path, and copied ---------------------------------------------

RECOVER = ["--quant", "w2g32", "--calib-sequences", "8", "--lora-steps", "2", "--lr", "1e-3", "--lora-r", "4",
           "--batch-size", "4", "--save-steps", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def recovered(tmp_path_factory, teacher_dir, cache_dir) -> Path:
    """A finished recover run (GPTQ init, calibrated LoRA start, 2 LoRA steps), its --out given as a relative path,
    written under umask 022."""
    out = tmp_path_factory.mktemp("recover") / "rec"
    old = os.umask(0o022)
    try:
        assert main(["recover", "--model", str(teacher_dir), "--cache", str(cache_dir), *RECOVER,
                     "--out", os.path.relpath(out)]) == 0
    finally:
        os.umask(old)
    return out


def _recover(teacher_dir, cache_dir, out) -> list:
    return ["recover", "--model", teacher_dir, "--cache", cache_dir, *RECOVER, "--out", out]


def test_a_finished_recover_folder_by_its_absolute_path_is_done_already(recovered, teacher_dir, cache_dir, capsys):
    before = {p: p.stat().st_mtime_ns for p in recovered.rglob("*") if p.name != "recover.json"}
    code, err, out = run_cli(_recover(teacher_dir, cache_dir, recovered.resolve()), capsys)
    assert code == 0, err
    assert {p: p.stat().st_mtime_ns for p in before} == before  # no stage ran again
    summary = json.loads((recovered / "recover.json").read_text())
    assert summary["adapter"] == str(recovered.resolve() / "lora" / "adapter")


def test_a_copied_recover_folder_is_done_already_and_names_its_own_files(recovered, teacher_dir, cache_dir, tmp_path,
                                                                         capsys):
    copy = tmp_path / "copy"
    shutil.copytree(recovered, copy)
    before = _snapshot(copy)
    code, err, _ = run_cli(_recover(teacher_dir, cache_dir, copy), capsys)
    assert code == 0, err
    summary = json.loads((copy / "recover.json").read_text())
    assert summary["adapter"] == str(copy / "lora" / "adapter")
    assert summary["quantizer"] == str(copy / "init" / "quantizer.safetensors")
    assert {k: v for k, v in _snapshot(copy).items() if k != "recover.json"} == \
        {k: v for k, v in before.items() if k != "recover.json"}


def test_a_copied_recover_folder_whose_init_changed_is_refused(recovered, teacher_dir, cache_dir, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(recovered, copy)
    quantizer = copy / "init" / "quantizer.safetensors"
    tensors = load_file(quantizer)
    name = next(k for k in tensors if tensors[k].is_floating_point())
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, quantizer)
    adapter = _snapshot(copy / "lora")
    code, err, _ = run_cli(_recover(teacher_dir, cache_dir, copy), capsys)
    assert code == 2 and len(err) == 1 and "--quantizer" in err[0] and "whose contents differ" in err[0], err
    assert _snapshot(copy / "lora") == adapter


# --- every file written keeps the umask's mode ------------------------------------------------------------------------

def test_recovers_lora_start_follows_the_umask(recovered):
    start = recovered / "lora-init"
    assert (start / "adapter_model.safetensors").is_file()  # the calibrated start, saved through safetensors
    wrong = {str(p): oct(p.stat().st_mode & 0o777) for p in recovered.rglob("*")
             if p.is_file() and p.stat().st_mode & 0o777 != 0o644}
    assert not wrong
