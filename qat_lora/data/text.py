"""Text in, fixed-length token sequences out: documents, the held-out split by document hash, packing.

Formats: `.txt` (documents separated by one or more blank lines) and `.jsonl` (one document per line,
text in `text_field`). Folders are read recursively in sorted order. Files are interleaved by token count,
so a token budget draws about equally from every file rather than only from the first.
"""
from __future__ import annotations

import codecs
import hashlib
import heapq
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from qat_lora.runtime.files import owned_by, read_record, sha256_file

TEXT_SUFFIXES = (".txt", ".jsonl")
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Document:
    text: str
    source: str  # the file it came from; decides the separator when packing


@dataclass(frozen=True)
class TextDecoding:
    """How text files are decoded (--text-encoding, --text-errors): UTF-8 and strict unless the user says
    otherwise, so a Latin-1 file is named instead of silently turned into replacement characters."""

    encoding: str = "utf-8"
    errors: str = "strict"

    def __post_init__(self) -> None:
        try:
            codecs.lookup(self.encoding)
        except LookupError:
            raise ValueError(f"--text-encoding {self.encoding}: unknown encoding; e.g. utf-8, latin-1, cp1252") from None
        try:
            codecs.lookup_error(self.errors)
        except LookupError:
            raise ValueError(f"--text-errors {self.errors}: choose strict, replace or ignore") from None

    def lines(self, path: Path) -> Iterator[str]:
        """The lines of `path`; a byte that does not decode is one error naming the file and the fix."""
        try:
            with path.open(encoding=self.encoding, errors=self.errors) as f:
                yield from f
        except UnicodeError as e:
            what = f"byte 0x{e.object[e.start:e.start + 1].hex()}" if isinstance(e, UnicodeDecodeError) else "a byte"
            raise ValueError(f"{path}: not {self.encoding} text ({what} does not decode); pass --text-encoding "
                             "(e.g. latin-1) or --text-errors replace") from None


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `datasets.Dataset.save_to_disk`."""
    return path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists())


GENERATED_REPORT = "generate.json"  # `qat-lora generate-data`'s report: "complete": false until its last shard


def _unfinished_corpus(folder: Path) -> Path | None:
    """The report of a generate-data corpus in `folder` that is still being written (or was stopped), if any."""
    for report in sorted(folder.rglob(GENERATED_REPORT)):
        if owned_by(report, "generate-data", legacy_keys=("config", "complete")) and \
                read_record(report).get("complete") is False:
            return report
    return None


def list_text_files(paths: Sequence[str | Path], flag: str = "--data") -> list[Path]:
    """Expand files and folders into a sorted list of text files and saved datasets.

    Raises:
        ValueError: a path that does not exist, no .txt/.jsonl file at all, or a folder holding a generate-data
            corpus that is not finished (a cache of it would silently hold less text than its budget; its finished
            shards can still be named one by one).
    """
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if is_saved_dataset(path):
            files.append(path)
        elif path.is_dir():
            if (report := _unfinished_corpus(path)) is not None:
                raise ValueError(f"{flag} {raw}: {report} says generate-data has not finished this corpus; rerun "
                                 "the same generate-data command to complete it (finished shards are kept), or name "
                                 "the shard files themselves")
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{flag} {raw}: no such file or folder")
    if not files:
        raise ValueError(f"{flag} {' '.join(map(str, paths))}: no .txt or .jsonl files found")
    return files


def _record_text(record: dict, where: str, text_field: str, chat_template) -> str:
    """The text of one jsonl/dataset record: its `text_field`, or its `messages` rendered by the chat template."""
    try:
        if chat_template is not None:
            return chat_template(record["messages"], tokenize=False)
        text = record[text_field]
    except (KeyError, TypeError) as e:
        want = "a 'messages' list (--chat)" if chat_template is not None else f"a {text_field!r} string (set --text-field)"
        raise ValueError(f"{where}: expected a record with {want}: {e!r}") from None
    if not isinstance(text, str):
        raise ValueError(f"{where}: {text_field!r} is not a string; set --text-field")
    return text


def iter_documents(path: Path, text_field: str = "text", chat_template=None,
                   decoding: TextDecoding = TextDecoding()) -> Iterator[Document]:
    """Yield the non-empty documents of one file or saved dataset.

    Args:
        chat_template: `tokenizer.apply_chat_template` when records hold chat `messages`; None for plain text.
        decoding: how .txt / .jsonl bytes become text.
    """
    if is_saved_dataset(path):
        try:
            import datasets
        except ImportError:
            raise ValueError(f"--data {path}: a saved dataset needs `pip install datasets`") from None
        for i, record in enumerate(datasets.load_from_disk(str(path))):
            text = _record_text(record, f"{path}[{i}]", text_field, chat_template)
            if text.strip():
                yield Document(text.strip(), str(path))
        return
    if path.suffix == ".jsonl":
        for line_no, line in enumerate(decoding.lines(path), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e})") from None
            text = _record_text(record, f"{path}:{line_no}", text_field, chat_template)
            if text.strip():
                yield Document(text.strip(), str(path))
        return
    if chat_template is not None:
        raise ValueError(f"--chat: {path} is plain text; chat data comes as .jsonl records with 'messages'")
    block: list[str] = []
    for line in decoding.lines(path):
        if line.strip():
            block.append(line.rstrip("\n"))
        elif block:
            yield Document("\n".join(block), str(path))
            block = []
    if block:
        yield Document("\n".join(block), str(path))


def holdout_score(text: str) -> float:
    """A uniform number in [0, 1) fixed by the document's text: the same document always lands in the same split."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0**64


def corpus_fingerprint(files: Sequence[Path]) -> str:
    """sha256 over every input's name and content (a saved dataset: all its files)."""
    digest = hashlib.sha256()
    for path in files:
        parts = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        content = hashlib.sha256("".join(sha256_file(p) for p in parts).encode()).hexdigest()
        digest.update(f"{path.name}\0{content}\n".encode())
    return digest.hexdigest()


def _interleaved(streams: list[Iterator[tuple[Document, list[int]]]]) -> Iterator[tuple[Document, list[int]]]:
    # Always draw from the file that has contributed the fewest tokens so far (ties: file order).
    heap = [(0, i) for i in range(len(streams))]
    while heap:
        used, i = heapq.heappop(heap)
        item = next(streams[i], None)
        if item is not None:
            heapq.heappush(heap, (used + len(item[1]), i))
            yield item


def tokenized_documents(files: Sequence[Path], tokenizer, text_field: str = "text", chat: bool = False,
                        decoding: TextDecoding = TextDecoding()) -> Iterator[tuple[Document, list[int]]]:
    """(document, token ids without added special tokens), files interleaved by token count."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat: the teacher's tokenizer has no chat template")
    template = tokenizer.apply_chat_template if chat else None

    def stream(path: Path) -> Iterator[tuple[Document, list[int]]]:
        for doc in iter_documents(path, text_field, template, decoding):
            yield doc, tokenizer(doc.text, add_special_tokens=False)["input_ids"]

    return _interleaved([stream(p) for p in files])


def split_token_streams(docs: Iterable[tuple[Document, list[int]]], tokenizer, holdout_fraction: float,
                        max_tokens: int | None) -> dict[str, list[int]]:
    """Route each document to train or held-out by its hash and join each split into one token stream.

    Consecutive documents of the same file are joined by a blank line, documents of different files by
    the EOS token. Reading stops once each split holds its share of `max_tokens` (None = read everything).
    """
    if not 0.0 <= holdout_fraction < 1.0:
        raise ValueError(f"--holdout-fraction {holdout_fraction}: must be in [0, 1)")
    para_sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else para_sep
    budget = {"train": None, "heldout": None}
    if max_tokens is not None:
        budget = {"heldout": int(round(max_tokens * holdout_fraction))}
        budget["train"] = max_tokens - budget["heldout"]
    streams: dict[str, list[int]] = {s: [] for s in SPLITS}
    last_source: dict[str, str | None] = {s: None for s in SPLITS}
    for doc, ids in docs:
        split = "heldout" if holdout_score(doc.text) < holdout_fraction else "train"
        stream, limit = streams[split], budget[split]
        if limit is not None and len(stream) >= limit:
            if all(budget[s] is not None and len(streams[s]) >= budget[s] for s in SPLITS):
                break
            continue
        if stream:
            stream += para_sep if last_source[split] == doc.source else eos
        stream += ids
        last_source[split] = doc.source
    for split in SPLITS:
        if budget[split] is not None:
            del streams[split][budget[split]:]
    return streams


def pack(tokens: Sequence[int], seq_len: int, pad_id: int = 0,
         prefix: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Cut a token stream into [N, seq_len] rows; the last partial row is right-padded and masked.

    `prefix` (models.sequence_prefix: the BOS token of models that need one, as Gemma) opens every row, followed
    by the next seq_len - len(prefix) tokens of the stream.

    Returns:
        input_ids: [N, seq_len] int32; attention_mask: [N, seq_len] uint8 (1 = real token).
    """
    width = seq_len - len(prefix)
    if width <= 0:
        raise ValueError(f"--seq-len {seq_len}: must be longer than the {len(prefix)} token(s) opening each sequence")
    n = -(-len(tokens) // width)
    input_ids = np.full((n, seq_len), pad_id, dtype=np.int32)
    mask = np.zeros((n, seq_len), dtype=np.uint8)
    input_ids[:, :len(prefix)], mask[:, :len(prefix)] = np.asarray(prefix, dtype=np.int32), 1
    flat_ids, flat_mask = input_ids[:, len(prefix):].reshape(-1), mask[:, len(prefix):].reshape(-1)
    flat_ids[: len(tokens)] = np.asarray(tokens, dtype=np.int32)
    flat_mask[: len(tokens)] = 1
    input_ids[:, len(prefix):], mask[:, len(prefix):] = flat_ids.reshape(n, width), flat_mask.reshape(n, width)
    return input_ids, mask


def token_stream(files: Sequence[Path], tokenizer, max_tokens: int | None, text_field: str = "text",
                 decoding: TextDecoding = TextDecoding()) -> list[int]:
    """Every document of `files` joined into one token stream (no held-out split), cut at `max_tokens`."""
    docs = tokenized_documents(files, tokenizer, text_field, decoding=decoding)
    return split_token_streams(docs, tokenizer, 0.0, max_tokens)["train"]
