"""KD cache faults found by probing the CLI (issue 31): manifests that name a shard twice, overlap, forge counts or
lack fields; a folder where a shard should be; --resume over a changed corpus or teacher; a stop signal to a
multi-chip build; two commands writing one folder; an --out inside an input; and the ownership stamps of the
records build-cache and generate-data write. Every fault ends in one line (or 128 + signal for a stop), and
nothing is lost or half-written."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from qat_lora.data import models
from qat_lora.cache.reader import KDCache, verify_cache
from qat_lora.commands.cli import main
from qat_lora.runtime.files import OWNER_KEY, FolderLock

ROOT = Path(__file__).resolve().parents[2]


def _build_argv(teacher, data, out, *extra) -> list[str]:
    return ["build-cache", "--teacher", str(teacher), "--data", str(data), "--out", str(out), "--seq-len", "16",
            "--encoding", "topk", "--top-k", "4", "--max-tokens", "1500", "--batch-size", "4", "--holdout-fraction", "0.1",
            "--shard-sequences", "16", "--device", "cpu", *map(str, extra)]


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory, teacher_dir, corpus_dir) -> Path:
    out = tmp_path_factory.mktemp("small") / "cache"
    assert main(_build_argv(teacher_dir, corpus_dir, out)) == 0
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir()}


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def _train(m: dict) -> list[dict]:
    return m["splits"]["train"]["shards"]


def _shift_first(m: dict) -> None:
    start, stop, step = _train(m)[0]["rows"]
    _train(m)[0]["rows"] = [start + 1, stop + 1, step]  # row 0 left out, the next shard's first row read twice


def _forge_rows(m: dict) -> None:
    _train(m)[0]["rows"] = [0, 10**15, 1]
    m["splits"]["train"]["sequences"] = 10**15


MANIFEST_FAULTS = {
    "shard listed twice": (lambda m: _train(m).append(dict(_train(m)[0])), "is listed twice"),
    "overlapping rows": (_shift_first, "both hold row 16"),
    "forged sequences": (lambda m: m["splits"]["train"].update(sequences=10**15), "shards hold"),
    "forged rows": (_forge_rows, "fewer than they take"),
    "no sha256": (lambda m: _train(m)[0].pop("sha256"), "has `sha256` None, not a string"),
    "no bytes": (lambda m: _train(m)[0].pop("bytes"), "has `bytes` None, not a non-negative integer"),
    "bytes a string": (lambda m: _train(m)[0].update(bytes="12"), "has `bytes` '12'"),
    "seq_len a string": (lambda m: m.update(seq_len="16"), "`seq_len` is '16', not a positive integer"),
    "teacher a string": (lambda m: m.update(teacher="t"), "`teacher` is 't', not a JSON object"),
    "not an object": (lambda m: [m], "not a JSON object"),
}


@pytest.mark.parametrize("fault", list(MANIFEST_FAULTS))
def test_manifest_faults_are_one_line_in_the_reader_and_in_verify(fault, small_cache, tmp_path, capsys):
    change, message = MANIFEST_FAULTS[fault]
    copy = _copy(small_cache, tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    changed = change(manifest)  # the changes edit in place; one returns a new document (a list)
    manifest = changed if isinstance(changed, list) else manifest
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="manifest.json: ") as raised:
        KDCache(copy)
    assert message in str(raised.value) and len(str(raised.value).splitlines()) == 1
    problems = verify_cache(copy)
    assert len(problems) == 1 and message in problems[0]
    assert main(["cache", "verify", str(copy)]) == 2
    assert message in _one_error(capsys)


def test_a_folder_in_place_of_a_shard_is_one_line(small_cache, tmp_path, capsys):
    copy = _copy(small_cache, tmp_path / "copy")
    shard = copy / _train(json.loads((copy / "manifest.json").read_text()))[0]["file"]
    shard.unlink()
    shard.mkdir()
    with pytest.raises(ValueError, match=f"shard {shard.name} is a folder, not a shard file"):
        KDCache(copy).sequence(0, "train")  # the first train shard holds row 0
    assert main(["cache", "verify", str(copy)]) == 2
    assert f"{shard}: is a folder, not a shard file" in _one_error(capsys)


def _perturb_teacher(teacher: Path) -> None:
    weights = load_file(str(teacher / "model.safetensors"))
    key = min(weights)
    weights[key] = weights[key] + 0.01
    save_file(weights, str(teacher / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("change, message", [
    ("corpus", "--data {data}: the corpus changed since this build started; rebuild with --overwrite or restore it"),
    ("teacher", ("--teacher {teacher}: the teacher changed since this build started (weights or config); rebuild "
                 "with --overwrite or restore it")),
])
def test_resume_refuses_a_changed_corpus_or_teacher_before_writing(change, message, teacher_dir, corpus_dir,
                                                                    tmp_path, capsys, monkeypatch):
    teacher, data, out = _copy(teacher_dir, tmp_path / "t"), _copy(corpus_dir, tmp_path / "d"), tmp_path / "cache"
    assert main(_build_argv(teacher, data, out)) == 0
    for name in ("manifest.json", "manifest-r000.json"):  # as if stopped after its last shard
        (out / name).unlink()
    before = _snapshot(out)
    if change == "corpus":
        with (data / "a.txt").open("a") as f:
            f.write("\n\nA new document appended after the build started.\n")
        monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("the teacher loaded"))
    else:
        _perturb_teacher(teacher)
    capsys.readouterr()
    assert main(_build_argv(teacher, data, out, "--resume")) == 2
    assert _one_error(capsys) == "qat-lora build-cache: error: " + message.format(data=data, teacher=teacher)
    assert _snapshot(out) == before  # not a shard, progress or manifest written


def test_cache_records_carry_the_owner_stamp_and_unstamped_ones_still_read(small_cache, tmp_path):
    for name in ("manifest.json", "manifest-r000.json", "progress-r000.json"):
        assert json.loads((small_cache / name).read_text())[OWNER_KEY]["kind"] == "cache", name
    copy = _copy(small_cache, tmp_path / "old")
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest[OWNER_KEY]  # a cache built before the stamp
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert verify_cache(copy) == [] and KDCache(copy).num_sequences("train") > 0


def _children(pid: int, count: int, deadline_s: float = 120) -> list[int]:
    stop = time.monotonic() + deadline_s
    while time.monotonic() < stop:
        pids = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        if len(pids) == count:
            return pids
        time.sleep(0.05)
    raise AssertionError("the builders never started")


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # this builder already finished its share
        pass


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", ["sigterm-launcher", "sigkill-builder"])
def test_a_stop_signal_ends_a_multi_chip_build_with_143_and_resume_completes_it(fault, teacher_dir, corpus_dir,
                                                                                 tmp_path, capsys):
    out = tmp_path / "cache"
    argv = ["build-cache", "--num-chips", "2", "--device", "cpu", "--teacher", str(teacher_dir), "--data",
            str(corpus_dir), "--out", str(out), "--seq-len", "32", "--encoding", "topk", "--top-k", "4", "--max-tokens", "0",
            "--batch-size", "1", "--shard-sequences", "2"]
    launcher = subprocess.Popen([sys.executable, "-m", "qat_lora", *argv], env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        builders = _children(launcher.pid, 2)
        deadline = time.monotonic() + 120
        while not (out / "progress-r000.json").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.01)
        # The tiny teacher finishes in about a second: freeze the builders so the signal lands mid-build.
        for pid in builders:
            _signal(pid, signal.SIGSTOP)
        if fault == "sigterm-launcher":
            launcher.send_signal(signal.SIGTERM)  # forwarded to the builders, pending until they run again
            time.sleep(0.5)
        else:
            _signal(builders[1], signal.SIGKILL)  # killed from outside (the OOM killer): a failure, not a stop
        for pid in builders:
            _signal(pid, signal.SIGCONT)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    if fault == "sigterm-launcher":
        assert launcher.returncode == 143, output[-3000:]
        assert "stopped by SIGTERM; rerun the same command with --resume" in output, output[-3000:]
        assert not (out / "manifest.json").exists()
    else:
        assert launcher.returncode == 2 and "rank 1 was killed by SIGKILL" in output, output[-3000:]
    assert main(argv + ["--resume"]) == 0
    assert verify_cache(out) == [] and main(["cache", "verify", str(out)]) == 0
    if fault == "sigterm-launcher":  # a preemption loop may rerun it once more: a no-op that succeeds
        assert main(argv + ["--resume"]) == 0 and verify_cache(out) == []


@pytest.mark.parametrize("command", ["build-cache", "generate-data"])
def test_a_second_command_into_a_locked_folder_fails_at_once_and_writes_nothing(command, teacher_dir, corpus_dir,
                                                                                tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    argv = _build_argv(teacher_dir, corpus_dir, out) if command == "build-cache" else [
        "generate-data", "--model", str(teacher_dir), "--data", str(corpus_dir), "--out", str(out), "--tokens", "40",
        "--device", "cpu"]
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    with FolderLock(out):  # the first command, still writing
        assert main(argv) == 2
        assert _one_error(capsys) == (f"qat-lora {command}: error: --out {out}: another qat-lora command is writing "
                                      "there now; wait for it to end or choose another folder")
        assert list(out.iterdir()) == []


def _inputs(teacher_dir, corpus_dir, tmp_path) -> dict[str, Path]:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "prompts.txt").write_text("tell of the king\n")
    return {"teacher": _copy(teacher_dir, tmp_path / "t"), "data": _copy(corpus_dir, tmp_path / "d"),
            "prompts": tmp_path / "p" / "prompts.txt", "prompts_dir": tmp_path / "p"}


OUT_IN_INPUT = [
    (["build-cache", "--teacher", "{teacher}", "--data", "{data}", "--out", "{data}/cache"],
     "--out {data}/cache: lies inside --data {data}"),
    (["build-cache", "--teacher", "{teacher}", "--data", "{data}", "--out", "{teacher}"],
     "--out {teacher}: is --teacher {teacher}"),
    (["build-cache", "--teacher", "{teacher}", "--data", "{data}/a.txt", "--out", "{data}"],
     "--out {data}: contains --data {data}/a.txt"),
    (["generate-data", "--model", "{teacher}", "--data", "{data}", "--out", "{data}/self"],
     "--out {data}/self: lies inside --data {data}"),
    (["generate-data", "--model", "{teacher}", "--data", "{data}", "--out", "{teacher}"],
     "--out {teacher}: is --model {teacher}"),
    (["generate-data", "--model", "{teacher}", "--prompts", "{prompts}", "--out", "{prompts_dir}"],
     "--out {prompts_dir}: contains --prompts {prompts}"),
]


@pytest.mark.parametrize("argv, message", OUT_IN_INPUT)
def test_an_out_inside_or_equal_to_an_input_is_refused_before_any_model_loads(argv, message, teacher_dir, corpus_dir,
                                                                               tmp_path, capsys, monkeypatch):
    paths = _inputs(teacher_dir, corpus_dir, tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    assert main([a.format(**paths) for a in argv] + ["--device", "cpu"]) == 2
    assert message.format(**paths) in _one_error(capsys)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert not (paths["data"] / "cache").exists() and not (paths["data"] / "self").exists()


def _generate_argv(teacher_dir, corpus_dir, out) -> list[str]:
    return ["generate-data", "--model", str(teacher_dir), "--data", str(corpus_dir), "--out", str(out),
            "--prefix-tokens", "8", "--tokens", "40", "--max-new-tokens", "10", "--batch-size", "4",
            "--shard-samples", "4", "--device", "cpu"]


def test_generate_data_stamps_its_report_and_never_writes_among_a_users_files(teacher_dir, corpus_dir, tmp_path,
                                                                              capsys):
    out = tmp_path / "self"
    assert main(_generate_argv(teacher_dir, corpus_dir, out)) == 0
    report = json.loads((out / "generate.json").read_text())
    assert report[OWNER_KEY]["kind"] == "generate-data" and report["complete"]
    del report[OWNER_KEY]  # a report written before the stamp: still continued
    (out / "generate.json").write_text(json.dumps(report))
    assert main(_generate_argv(teacher_dir, corpus_dir, out)) == 0
    for name, text in [("generate.json", '{"settings": "mine"}'), ("part-notes.txt", "my notes")]:
        mine = tmp_path / name.split(".")[0]
        mine.mkdir()
        (mine / name).write_text(text)
        capsys.readouterr()
        assert main(_generate_argv(teacher_dir, corpus_dir, mine)) == 2
        assert "pass an empty or new folder" in _one_error(capsys)
        assert [p.name for p in mine.iterdir()] == [name] and (mine / name).read_text() == text


@pytest.mark.multiprocess
def test_a_builder_among_several_clears_only_its_own_rank_s_temp_files(teacher_dir, corpus_dir, tmp_path):
    from qat_lora.cache.builder import prepare_out
    from qat_lora.cache.config import CacheBuildConfig

    out = tmp_path / "cache"
    out.mkdir()
    names = ["progress-r000.json.tmp", "train-r000-00001.safetensors.tmp", "progress-r001.json.tmp",
             "train-r001-00003.safetensors.tmp", "manifest-r001.json.tmp"]
    for name in names:
        (out / name).write_text("being written by its rank right now")
    prepare_out(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(out), rank=0,
                                 world_size=2, resume=True))
    assert sorted(p.name for p in out.iterdir()) == sorted(names[2:])  # rank 1's in-flight files are its own
