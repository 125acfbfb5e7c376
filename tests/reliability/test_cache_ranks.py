"""Cache builds whose ranks share one folder (issue 50): --overwrite of one rank never touches another's files and
drops the merged manifest it makes stale; one builder per rank (a lock file per rank, released however its process
ends) while other ranks build on; shards of two builds under one manifest refused by merge, verify and the reader;
a damaged progress record named with its fix; and target flags that the chosen --encoding ignores refused."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qat_lora.cache import builder
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.cache.folder import prepare_out
from qat_lora.cache.reader import KDCache, verify_cache
from qat_lora.commands.cli import build_parser, config_from_args, main
from qat_lora.data import models
from qat_lora.runtime.options import to_argv

from tests.reliability.test_user_mistakes import run_cli


def _argv(teacher, data, out, *extra) -> list[str]:
    return ["build-cache", "--teacher", str(teacher), "--data", str(data), "--out", str(out), "--seq-len", "16",
            "--encoding", "topk", "--top-k", "4", "--max-tokens", "1200", "--batch-size", "4", "--holdout-fraction",
            "0.1", "--shard-sequences", "16", "--device", "cpu", *map(str, extra)]


def _rank(rank: int) -> tuple[str, ...]:
    return "--rank", str(rank), "--world-size", "2"


def _files(folder: Path, rank: int) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if f"-r{rank:03d}" in p.name}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, teacher_dir, corpus_dir) -> Path:
    """Both ranks of a 2-rank build in one folder, merged by the last to finish."""
    out = tmp_path_factory.mktemp("ranks") / "cache"
    assert main(_argv(teacher_dir, corpus_dir, out, *_rank(0))) == 0
    assert main(_argv(teacher_dir, corpus_dir, out, *_rank(1))) == 0
    assert (out / "manifest.json").exists() and not list(out.glob("*.lock"))
    return out


# --- data loss: a rank's --overwrite removes only its own files ---------------------------------------------------

def test_overwrite_of_an_unfinished_rank_keeps_the_finished_rank_s_files(two_ranks, teacher_dir, corpus_dir,
                                                                         tmp_path, capsys):
    out = shutil.copytree(two_ranks, tmp_path / "cache")
    for name in ("manifest.json", "manifest-r001.json"):  # rank 1 was killed before its partial manifest
        (out / name).unlink()
    rank0 = _files(out, 0)
    code, err = run_cli(_argv(teacher_dir, corpus_dir, out, *_rank(1)), capsys)
    assert code == 2 and "unfinished build of rank 1; pass --resume or --overwrite" in err[-1], err
    assert main(_argv(teacher_dir, corpus_dir, out, *_rank(1), "--overwrite")) == 0  # what that refusal suggests
    assert _files(out, 0) == rank0  # rank 0's shards, progress and partial manifest, byte for byte
    manifest = json.loads((out / "manifest.json").read_text())
    assert {sh["rank"] for sh in manifest["splits"]["train"]["shards"]} == {0, 1} and verify_cache(out) == []


def test_a_rank_rebuild_drops_the_merged_manifest_it_makes_stale(two_ranks, teacher_dir, corpus_dir, tmp_path,
                                                                 capsys, monkeypatch):
    out = shutil.copytree(two_ranks, tmp_path / "cache")
    rank0 = _files(out, 0)

    def fail(*_args, **_kwargs):
        raise ValueError("the teacher failed mid-build")

    monkeypatch.setattr(builder, "_run_teacher", fail)
    code, err = run_cli(_argv(teacher_dir, corpus_dir, out, *_rank(1), "--overwrite"), capsys)
    assert code == 2 and "the teacher failed mid-build" in err[-1], err
    # The merged manifest listed rank 1's old shards: gone with them, so nothing reads a cache that is not there.
    assert not (out / "manifest.json").exists() and _files(out, 0) == rank0
    assert not [p.name for p in out.iterdir() if "-r001" in p.name]
    monkeypatch.undo()
    assert main(_argv(teacher_dir, corpus_dir, out, *_rank(1), "--resume")) == 0  # the last rank merges again
    assert verify_cache(out) == [] and _files(out, 0) == rank0


def test_a_rank_rebuild_refuses_to_strand_a_rank_whose_partial_manifest_is_gone(two_ranks, teacher_dir, corpus_dir,
                                                                                tmp_path, capsys):
    out = shutil.copytree(two_ranks, tmp_path / "cache")
    (out / "manifest-r000.json").unlink()  # the merged manifest is now the only record of rank 0's shards
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, err = run_cli(_argv(teacher_dir, corpus_dir, out, *_rank(1), "--overwrite"), capsys)
    assert code == 2 and len(err) == 1 and "lists rank 0, whose manifest-r000.json is gone" in err[0], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _config(teacher_dir, corpus_dir, out, **kw) -> CacheBuildConfig:
    return CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(out), encoding="topk", top_k=4,
                            **kw)


def test_a_rank_removes_only_what_its_own_records_list_as_its_own(two_ranks, teacher_dir, corpus_dir, tmp_path):
    out = shutil.copytree(two_ranks, tmp_path / "cache")
    rank0 = _files(out, 0)
    forged = json.loads((out / "progress-r001.json").read_text())  # a hostile record naming rank 0's shards
    forged["shards"]["train"] += [{"file": name} for name in rank0 if name.endswith(".safetensors")]
    (out / "progress-r001.json").write_text(json.dumps(forged))
    unlisted = out / "train-r001-00099.safetensors"  # no record of rank 1 says it wrote this one
    unlisted.write_bytes(b"unrecorded")
    prepare_out(_config(teacher_dir, corpus_dir, out, rank=1, world_size=2, overwrite=True))
    assert _files(out, 0) == rank0 and unlisted.exists()
    assert sorted(p.name for p in out.iterdir() if "-r001" in p.name) == [unlisted.name]
    assert not (out / "manifest.json").exists()


def test_a_whole_build_s_overwrite_clears_every_rank_unless_one_is_being_built(two_ranks, teacher_dir, corpus_dir,
                                                                               tmp_path):
    """--world-size 1 (every rank from this command, e.g. --num-chips N) owns the folder: it clears all ranks, but
    never under a builder that holds one of them now."""
    out = shutil.copytree(two_ranks, tmp_path / "cache")
    with _lock_held_elsewhere(out, 1):
        with pytest.raises(ValueError, match=f"--out {out}: another builder of rank 1 is writing there now"):
            prepare_out(_config(teacher_dir, corpus_dir, out, overwrite=True))
        assert (out / "manifest.json").exists() and _files(out, 0)
    prepare_out(_config(teacher_dir, corpus_dir, out, overwrite=True))
    assert list(out.iterdir()) == []


# --- one builder per rank -------------------------------------------------------------------------------------------

class _lock_held_elsewhere:
    """Rank `rank`'s lock held by another process (a second builder of that rank), killed with SIGKILL on exit."""

    def __init__(self, out: Path, rank: int) -> None:
        code = ("import time; from qat_lora.runtime.files import LockFile\n"
                f"LockFile({str(out / f'build-r{rank:03d}.lock')!r}, 'busy').acquire()\n"
                "print('held', flush=True); time.sleep(120)")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                     cwd=Path(__file__).resolve().parents[2])

    def __enter__(self):
        assert self.proc.stdout.readline().strip() == "held"
        return self

    def __exit__(self, *_exc) -> None:
        self.proc.send_signal(signal.SIGKILL)  # the kernel drops its flock: no clean release ran
        self.proc.wait()


@pytest.mark.multiprocess
def test_a_second_builder_of_a_rank_fails_at_once_while_other_ranks_build(teacher_dir, corpus_dir, tmp_path, capsys,
                                                                           monkeypatch):
    out = tmp_path / "shared"
    with _lock_held_elsewhere(out, 1):
        monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
        code, err = run_cli(_argv(teacher_dir, corpus_dir, out, *_rank(1), "--top-k", "8", "--overwrite"), capsys)
        assert code == 2 and err == [f"qat-lora build-cache: error: --out {out}: another builder of rank 1 is writing "
                                     "there now; wait for it to end or choose another --out"], err
        monkeypatch.undo()
        assert main(_argv(teacher_dir, corpus_dir, out, *_rank(0))) == 0  # another rank is free to build
    # The holder was killed: its lock went with it, and its lock file is one a build writes.
    assert main(_argv(teacher_dir, corpus_dir, out, *_rank(1))) == 0
    assert verify_cache(out) == [] and not list(out.glob("*.lock"))


# --- shards of two builds under one manifest --------------------------------------------------------------------

@pytest.mark.multiprocess
def test_shards_of_two_builds_under_one_manifest_are_refused_by_merge_verify_and_the_reader(
        two_ranks, teacher_dir, corpus_dir, tmp_path, capsys):
    other = tmp_path / "other"  # the same rank of another build (--top-k 8), as a second builder would write it
    assert main(_argv(teacher_dir, corpus_dir, other, *_rank(0), "--top-k", "8")) == 0
    mixed = shutil.copytree(two_ranks, tmp_path / "mixed")
    shard = "train-r000-00001.safetensors"
    shutil.copyfile(other / shard, mixed / shard)
    capsys.readouterr()
    for argv in (["cache", "verify", str(mixed)], ["cache", "merge", str(mixed)]):
        code, err = run_cli(argv, capsys)
        assert code == 2 and len(err) == 1 and "written by another build" in err[0], (argv, err)
        assert "truncated" not in err[0]
    cache = KDCache(mixed)
    with pytest.raises(ValueError, match=f"shard {shard} was written by another build"):
        for index in range(cache.num_sequences("train")):
            cache.sequence(index)


# --- a damaged progress record ----------------------------------------------------------------------------------

@pytest.mark.parametrize("damage, problem", [
    ('{"fingerprint": ', "not a JSON object"),
    ("[1, 2]", "not a JSON object"),
    ('{"rank": 0}', "no `fingerprint` or `shards`"),
    ('{"fingerprint": "f", "shards": {"train": []}}', "no `shards.heldout` list"),
    ('{"fingerprint": "f", "shards": {"train": [{"file": "../x", "sha256": "0", "rows": [0, 1, 1]}], "heldout": []}}',
     "a bad `shards.train` entry"),
])
def test_a_damaged_progress_record_on_resume_is_one_line_naming_it(damage, problem, two_ranks, teacher_dir, corpus_dir,
                                                                   tmp_path, capsys, monkeypatch):
    out = shutil.copytree(two_ranks, tmp_path / "cache")
    (out / "manifest.json").unlink()
    (out / "progress-r001.json").write_text(damage)
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    code, err = run_cli(_argv(teacher_dir, corpus_dir, out, *_rank(1), "--resume"), capsys)
    assert code == 2 and err == [f"qat-lora build-cache: error: --resume: {out / 'progress-r001.json'} is damaged "
                                 f"({problem}); rebuild rank 1 with --overwrite instead of --resume"], err


# --- target flags the encoding ignores ------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--top-k", "16"], "--top-k: needs --encoding topk (this build is --encoding sampled); with these options it "
                        "does nothing, so drop it"),
    (["--top-k", "64"], "--top-k: needs --encoding topk"),  # typed, even at its default
    (["--value-bits", "8"], "--value-bits: needs --encoding topk"),
    (["--encoding", "topk", "--num-samples", "32"], "--num-samples: needs --encoding sampled (this build is --encoding "
                                                    "topk)"),
    (["--encoding", "topk", "--seed", "3"], "--seed: needs --encoding sampled"),
])
def test_a_target_flag_the_encoding_ignores_is_refused(flags, message, teacher_dir, corpus_dir, tmp_path, capsys,
                                                       monkeypatch):
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    argv = ["build-cache", "--teacher", str(teacher_dir), "--data", str(corpus_dir), "--out", str(tmp_path / "c"),
            *flags]
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"qat-lora build-cache: error: {message}"), err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("given", [{}, {"num_samples": 16, "seed": 5}, {"encoding": "topk"},
                                   {"encoding": "topk", "top_k": 8, "value_bits": 32, "seed": 5}, {"top_k": 8}])
def test_the_launcher_s_command_line_rebuilds_the_same_build(given):
    """--num-chips N reruns each builder with to_argv(cfg): a config built in Python (the demo passes both
    encodings' flags) must not turn into typed flags the builders refuse."""
    cfg = CacheBuildConfig(teacher="t", data=["d"], **given)
    again = config_from_args(CacheBuildConfig, build_parser().parse_args(["build-cache", *to_argv(cfg)]))
    assert again.target_encoding() == cfg.target_encoding() and again.fingerprint() == cfg.fingerprint()
