"""Small file helpers shared by the cache, the trainer and eval: atomic writes and checksums."""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Collection
from pathlib import Path

# safetensors >= 0.8 saves through a temporary `.tmpXXXXXX` beside the target (the Rust tempfile crate's name)
# and renames it; a process killed mid-save leaves that file behind, so folders our writers own treat it as their
# own debris.
SAFETENSORS_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def save_debris(folder: Path, ours: Collection[str] | None = None) -> list[Path]:
    """What saves killed mid-write left in `folder`: safetensors' own temp files and our `name.tmp` files (only
    for names in `ours` when given; a folder whose every entry was vetted as a build's passes None)."""
    return [p for p in folder.iterdir() if SAFETENSORS_TEMP.fullmatch(p.name) or
            (p.name.endswith(".tmp") and (ours is None or p.name[:-len(".tmp")] in ours))]


def atomic_write_json(path: str | Path, obj: dict) -> None:
    """Write JSON under a temporary name, then rename: readers never see a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type when it has none): what a one-line CLI error shows."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def require_folder(out: str | Path, what: str) -> Path:
    """`out` as a Path, refusing an existing file (before anything loads): --out must name a folder."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; pass a folder for {what}")
    return out
