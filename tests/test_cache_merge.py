"""Cache builds across hosts (issue 29): each host builds its ranks into its own folder with `--rank R
--world-size W`; `qat-lora cache merge DEST --from OTHER ...` brings the other hosts' ranks in (each shard checked
against its sha256) and writes one manifest that verifies and trains."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qat_lora.commands.cli import main

from tests.reliability.test_user_mistakes import run_cli


def _build(teacher_dir, corpus_dir, out: Path, rank: int, *extra: str) -> None:
    assert main(["build-cache", "--teacher", str(teacher_dir), "--data", str(corpus_dir), "--out", str(out),
                 "--seq-len", "32", "--encoding", "topk", "--top-k", "8", "--max-tokens", "3000", "--holdout-fraction", "0.1",
                 "--device", "cpu", "--rank", str(rank), "--world-size", "2", *extra]) == 0


@pytest.fixture(scope="module")
def host_builds(tmp_path_factory, teacher_dir, corpus_dir) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hosts")
    _build(teacher_dir, corpus_dir, root / "host0", 0)
    _build(teacher_dir, corpus_dir, root / "host1", 1)
    return root / "host0", root / "host1"


@pytest.mark.multiprocess
def test_two_hosts_folders_merge_into_one_cache_that_verifies_and_trains(host_builds, teacher_dir, tmp_path, capsys):
    host0, host1 = (shutil.copytree(p, tmp_path / p.name) for p in host_builds)
    assert not (host0 / "manifest.json").exists()
    assert main(["cache", "merge", str(host0), "--from", str(host1)]) == 0
    manifest = json.loads((host0 / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and {sh["rank"] for sh in manifest["splits"]["train"]["shards"]} == {0, 1}
    assert main(["cache", "verify", str(host0)]) == 0
    assert main(["cache", "merge", str(host0), "--from", str(host1)]) == 0  # a rerun changes nothing
    assert main(["train", "--model", str(teacher_dir), "--cache", str(host0), "--quant", "w2g32", "--out",
                 str(tmp_path / "run"), "--max-steps", "2", "--batch-size", "2", "--lora-r", "4", "--device", "cpu"]) == 0
    capsys.readouterr()


@pytest.mark.multiprocess
def test_a_changed_shard_is_refused_and_nothing_is_merged(host_builds, tmp_path, capsys):
    host0, host1 = (shutil.copytree(p, tmp_path / p.name) for p in host_builds)
    shard = next(host1.glob("train-r001-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    code, err = run_cli(["cache", "merge", str(host0), "--from", str(host1)], capsys)
    assert code == 2 and len(err) == 1 and f"shard {shard.name} differs from its manifest" in err[0], err
    assert not (host0 / "manifest.json").exists() and not list(host0.glob("*r001*"))


@pytest.mark.multiprocess
def test_ranks_of_another_build_are_refused(host_builds, teacher_dir, corpus_dir, tmp_path, capsys):
    host0 = shutil.copytree(host_builds[0], tmp_path / "host0")
    other = tmp_path / "other"
    _build(teacher_dir, corpus_dir, other, 1, "--top-k", "4")
    capsys.readouterr()
    code, err = run_cli(["cache", "merge", str(host0), "--from", str(other)], capsys)
    assert code == 2 and len(err) == 1 and "another build than" in err[0], err
    assert not list(host0.glob("*r001*"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("source", ["empty", "self"])
def test_a_source_without_ranks_is_one_line(source, host_builds, tmp_path, capsys):
    host0 = shutil.copytree(host_builds[0], tmp_path / "host0")
    folder = host0 if source == "self" else tmp_path / "empty"
    folder.mkdir(exist_ok=True)
    code, err = run_cli(["cache", "merge", str(host0), "--from", str(folder)], capsys)
    assert code == 2 and len(err) == 1 and "no manifest-r*.json of another folder" in err[0], err


@pytest.mark.multiprocess
def test_hosts_may_share_one_folder_while_another_host_builds(host_builds, teacher_dir, corpus_dir, tmp_path):
    """A bucket or NFS folder every host writes: one host's lock on it does not stop another host's ranks."""
    from qat_lora.runtime.files import FolderLock

    shared = shutil.copytree(host_builds[0], tmp_path / "shared")  # host 0 is done; host 1 builds beside it
    with FolderLock(shared):  # host 0's command, still holding the folder (on file systems whose locks span hosts)
        _build(teacher_dir, corpus_dir, shared, 1)
    manifest = json.loads((shared / "manifest.json").read_text())  # the last host to finish merged
    assert {sh["rank"] for sh in manifest["splits"]["train"]["shards"]} == {0, 1}
