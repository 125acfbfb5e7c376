"""KD cache faults: a build never deletes what it did not write, and a damaged, hostile or NaN-carrying cache
is reported in one line by `cache verify` (which never crashes) and refused by the reader."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from qat_lora.cache.reader import KDCache, verify_cache
from qat_lora.cache.builder import build_cache
from qat_lora.commands.cli import main
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.runtime.files import sha256_file


def _config(teacher_dir, corpus_dir, out, **kw) -> CacheBuildConfig:
    base = dict(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(out), seq_len=16, encoding="topk", top_k=4, max_tokens=1_500,
                batch_size=4, holdout_fraction=0.1, shard_sequences=16, device="cpu")
    return CacheBuildConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory, teacher_dir, corpus_dir) -> Path:
    out = tmp_path_factory.mktemp("small") / "cache"
    build_cache(_config(teacher_dir, corpus_dir, out), log=lambda _: None)
    return out


def _copy(cache: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(cache, copy)
    return copy


@pytest.mark.parametrize("overwrite", [False, True])
def test_build_refuses_a_folder_holding_other_files_and_deletes_nothing(teacher_dir, corpus_dir, tmp_path, overwrite):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="holds files a cache build did not write .*config.json, model.safetensors"):
        build_cache(_config(teacher_dir, corpus_dir, model, overwrite=overwrite), log=lambda _: None)
    assert (model / "model.safetensors").read_bytes() == b"weights" and (model / "config.json").exists()


def test_overwrite_replaces_a_cache_built_there(small_cache, teacher_dir, corpus_dir, tmp_path):
    copy = _copy(small_cache, tmp_path)
    (copy / "train-r000-00099.safetensors").write_bytes(b"stale shard of an older build")
    build_cache(_config(teacher_dir, corpus_dir, copy, overwrite=True, top_k=8), log=lambda _: None)
    assert not (copy / "train-r000-00099.safetensors").exists() and verify_cache(copy) == []
    assert KDCache(copy).manifest["encoding"]["top_k"] == 8


def test_out_that_is_a_file_is_a_one_line_error(teacher_dir, corpus_dir, tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    code = main(["build-cache", "--teacher", str(teacher_dir), "--data", str(corpus_dir), "--out", str(target),
                 "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"qat-lora build-cache: error: --out {target}: is a file; pass a folder for the cache"]
    assert target.read_text() == "mine"


def _edit_manifest(cache: Path, change) -> None:
    manifest = json.loads((cache / "manifest.json").read_text())
    change(manifest)
    (cache / "manifest.json").write_text(json.dumps(manifest))


def _first_shard(m: dict) -> dict:
    return m["splits"]["train"]["shards"][0]


MANIFEST_FAULTS = {
    "parent-path shard": (lambda m: _first_shard(m).update(file="../outside.safetensors"), "is not a file inside"),
    "absolute shard": (lambda m: _first_shard(m).update(file="/etc/passwd"), "is not a file inside"),
    "nested shard": (lambda m: _first_shard(m).update(file="sub/x.safetensors"), "is not a file inside"),
    "rows past the split": (lambda m: _first_shard(m).update(rows=[0, 10_000, 1]), "row range"),
    "negative rows": (lambda m: _first_shard(m).update(rows=[-1, 3, 1]), "row range"),
    "zero step": (lambda m: _first_shard(m).update(rows=[0, 3, 0]), "row range"),
    "rows not a list": (lambda m: _first_shard(m).update(rows="0:3"), "row range"),
    "no splits": (lambda m: m.pop("splits"), "no `splits` entry"),
    "no encoding": (lambda m: m.pop("encoding"), "no `encoding` entry"),
    "split without shards": (lambda m: m["splits"]["train"].pop("shards"), "lacks `sequences` or `shards`"),
    "shard without name": (lambda m: _first_shard(m).pop("file"), "is not a file inside"),
}


@pytest.mark.parametrize("fault", list(MANIFEST_FAULTS))
def test_damaged_or_hostile_manifests_are_one_line_problems(fault, small_cache, tmp_path, capsys):
    change, message = MANIFEST_FAULTS[fault]
    copy = _copy(small_cache, tmp_path)
    _edit_manifest(copy, change)
    problems = verify_cache(copy)
    assert len(problems) == 1 and message in problems[0]
    with pytest.raises(ValueError, match=message.replace("`", ".").replace("(", ".")):
        KDCache(copy)
    assert main(["cache", "verify", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_manifest_that_is_not_json_is_one_line(small_cache, tmp_path):
    copy = _copy(small_cache, tmp_path)
    (copy / "manifest.json").write_text("{ not json")
    problems = verify_cache(copy)
    assert len(problems) == 1 and "not valid JSON" in problems[0]


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_teacher_values_fail_verify_even_with_a_valid_checksum(bad, small_cache, tmp_path):
    copy = _copy(small_cache, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    shard = _first_shard(manifest)
    arrays = load_file(str(copy / shard["file"]))
    key = next(k for k, a in arrays.items() if np.issubdtype(a.dtype, np.floating))
    arrays[key] = arrays[key].copy()
    arrays[key].reshape(-1)[0] = bad
    save_file(arrays, str(copy / shard["file"]))
    shard.update(bytes=(copy / shard["file"]).stat().st_size, sha256=sha256_file(copy / shard["file"]))
    (copy / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_cache(copy)
    assert len(problems) == 1 and f"{key} holds NaN or inf values" in problems[0]
