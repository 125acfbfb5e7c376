"""Small file helpers shared by every command that writes: atomic writes with the user's file modes, checksums,
the ownership record that proves a folder is the toolkit's, the lock that keeps two commands out of one folder,
and the check that an output never contains or equals an input."""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from qat_lora.runtime.writes import remove_written, writing

# safetensors >= 0.8 saves through a temporary `.tmpXXXXXX` beside the target (the Rust tempfile crate's name)
# and renames it; a process killed mid-save leaves that file behind, so folders our writers own treat it as their
# own debris.
SAFETENSORS_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def save_debris(folder: Path, ours: Collection[str] | None = None) -> list[Path]:
    """What saves killed mid-write left in `folder`: safetensors' own temp files and our `name.tmp` files (only
    for names in `ours` when given; a folder whose every entry was vetted as a build's passes None)."""
    return [p for p in folder.iterdir() if SAFETENSORS_TEMP.fullmatch(p.name) or
            (p.name.endswith(".tmp") and (ours is None or p.name[:-len(".tmp")] in ours))]


def umask() -> int:
    """This process's umask. Linux reports it in /proc (a read); elsewhere it is set and restored at once, which
    for that instant would give files another thread creates the default mode, so /proc comes first (the cache
    writer saves shards from a thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | Path) -> None:
    """Give `path` (a file, or every file and folder below a folder) the modes a plain `open()` would: some
    writers (safetensors >= 0.8, through a Rust tempfile) create 0600 files whatever the umask, which another user
    of a shared model or cache folder then cannot read."""
    path = Path(path)
    mask = umask()
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def save_safetensors(tensors: Mapping, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """`safetensors` save of torch tensors or numpy arrays under a temporary name, then renamed, with the umask's
    file mode: a killed save never leaves a half file under the real name, a full disk no file at all.

    Raises:
        OSError: the disk's error (safetensors raises its own SafetensorError), naming `path`.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    first = next(iter(tensors.values()), None)
    if first is not None and type(first).__module__ == "numpy":
        from safetensors.numpy import save_file
    else:
        from safetensors.torch import save_file
    with writing(path, tmp):
        save_file(dict(tensors), str(tmp), metadata=metadata)
        apply_umask(tmp)
        os.replace(tmp, path)


STAGING_DIR = ".saving.tmp"  # where save_pretrained writes before its files move up into the folder


def save_pretrained(obj, folder: str | Path, **kwargs) -> None:
    """`obj.save_pretrained(folder, **kwargs)` (a transformers or PEFT model, a tokenizer, a generation config)
    whose files are written in `folder/.saving.tmp/` and moved into `folder` once all are written, with the
    umask's modes: a full disk or a kill mid-save leaves no half-written file under a real name (transformers and
    tokenizers write in place).

    Raises:
        OSError: the disk's error (tokenizers raise a bare Exception, safetensors a SafetensorError), naming
            `folder`.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / STAGING_DIR
    remove_written(staging)
    with writing(folder, staging):
        obj.save_pretrained(str(staging), **kwargs)
        apply_umask(staging)
        for item in sorted(staging.iterdir()):
            target = folder / item.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(item, target)
        staging.rmdir()


def _finite_or_null(obj):
    """`obj` with every NaN / inf float replaced by None: JSON has no such numbers, and Python's own `NaN` /
    `Infinity` tokens make the file unreadable to every other JSON parser (jq, JavaScript, a dashboard)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_null(v) for v in obj]
    return obj


def atomic_write_json(path: str | Path, obj: dict) -> None:
    """Write JSON under a temporary name, then rename: readers never see a half-written file. A non-finite float
    (a diverged metric, `--max-grad-norm inf`) is written as null, so the file stays valid JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(_finite_or_null(obj), indent=2, allow_nan=False) + "\n")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write UTF-8 text under a temporary name, then rename: readers never see a half-written file, a full disk
    leaves no `.tmp` behind and its error names `path` (a write's own OSError names no file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        tmp.write_text(text, encoding="utf-8")
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


# The ownership record: the JSON file each command writes first in its folder carries this key, so that a later
# --overwrite removes only what the toolkit itself wrote (a model's config.json or a user's export.json is not ours).
OWNER_KEY = "written_by"


def owner_stamp(kind: str) -> dict:
    """The `written_by` entry of a record file: {"tool": "qat-lora", "kind": kind, "version": ...}."""
    from qat_lora import __version__

    return {OWNER_KEY: {"tool": "qat-lora", "kind": kind, "version": __version__}}


def read_record(path: str | Path) -> dict | None:
    """A JSON record file as a dict, or None when it is missing, not JSON or not an object."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def owned_by(record_path: str | Path, kind: str, legacy_keys: Collection[str] = ()) -> bool:
    """Whether `record_path` is the record of a `kind` folder the toolkit wrote: stamped `written_by` that kind,
    or (records written before the stamp existed) holding every one of `legacy_keys` and no `model_type` (so a
    transformers config.json never passes)."""
    record = read_record(record_path)
    if record is None:
        return False
    stamp = record.get(OWNER_KEY)
    if isinstance(stamp, dict):
        return stamp.get("tool") == "qat-lora" and stamp.get("kind") == kind
    return bool(legacy_keys) and "model_type" not in record and all(k in record for k in legacy_keys)


# Names that stand for folders on disk: data/models.py registers the fetch-assets teachers (--model smollm2-135m is
# a folder of the shared asset cache, which a later fetch-assets replaces). This stage imports nothing above it,
# so the lookup is handed to it.
_NAMED_FOLDERS: list[Callable[[str], Path | None]] = []


def register_named_folder(lookup: Callable[[str], Path | None]) -> None:
    """Add `lookup`: an input's name (not a path on disk) -> the folder it stands for, or None."""
    if lookup not in _NAMED_FOLDERS:
        _NAMED_FOLDERS.append(lookup)


def _on_disk(value: str | Path) -> tuple[Path, str] | None:
    """(where an input lies, how to say so) for a path on disk or a registered name; None for anything else."""
    path = Path(value).expanduser()
    if path.exists():
        return path.resolve(), ""
    found = next((folder for lookup in _NAMED_FOLDERS if (folder := lookup(str(value))) is not None), None)
    return (Path(found).resolve(), f" ({found})") if found is not None else None


def check_out_apart_from_inputs(out: str | Path, inputs: Mapping[str, str | Path | Collection[str]],
                                flag: str = "--out") -> None:
    """Refuse an --out that equals, contains or lies inside an input (`{"--model": path, ...}`; a name such as a
    fetched teacher's stands for its folder, register_named_folder): writing or clearing it would change or delete
    that input. Inputs that are not on disk (hub names, "") pass.

    Raises:
        ValueError: naming --out, the input flag and the fix.
    """
    out_path = Path(out).expanduser().resolve()
    for name, values in inputs.items():
        for value in ([values] if isinstance(values, (str, Path)) else values):
            where = _on_disk(value) if value else None
            if where is None:
                continue
            src, named = where
            if out_path == src:
                relation = "is"
            elif out_path in src.parents:
                relation = "contains"
            elif src.is_dir() and src in out_path.parents:
                relation = "lies inside"
            else:
                continue
            raise ValueError(f"{flag} {out}: {relation} {name} {value}{named}; writing there would change the input, "
                             f"so choose a {flag} outside it")


_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)


def _flock(fd: int, busy: str) -> bool:
    """An exclusive flock on `fd`, without waiting. Returns False where the file system has no flock (some network
    mounts: the command then runs unlocked).

    Raises:
        ValueError: `busy`, when another process (or another open of the same file) holds the lock.
    """
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ValueError(busy) from None
        if e.errno not in _NO_FLOCK:
            raise
        return False
    return True


class FolderLock:
    """An exclusive lock on an output folder for as long as a command writes it: a second command writing the
    same folder fails at once instead of mixing its files with the first's. It is an flock on the folder
    itself (no lock file to leave behind), released when the process ends, however it ends; file systems without
    flock (some network mounts) run unlocked.

        with FolderLock(out, "--out"):
            ...write...

    Creating the folder is part of taking the lock; if the command then fails before writing anything, the
    empty folder it created is removed again.
    """

    def __init__(self, folder: str | Path, flag: str = "--out") -> None:
        self.folder, self.flag = Path(folder), flag
        self._fd: int | None = None
        self._created = False

    def acquire(self) -> "FolderLock":
        self._created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.folder, os.O_RDONLY)
        try:
            _flock(self._fd, f"{self.flag} {self.folder}: another qat-lora command is writing there now; wait for "
                             "it to end or choose another folder")
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise
        return self

    def release(self, failed: bool = False) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if failed and self._created:
            try:
                self.folder.rmdir()  # only while still empty: nothing written is ever removed here
            except OSError:
                pass

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, exc_type, *_exc) -> None:
        self.release(failed=exc_type is not None)


class LockFile(FolderLock):
    """An exclusive lock on one part of a folder that several processes write, held on a lock file in it (a
    cache's `build-r000.lock`: one builder per rank, while the ranks of one build share the folder). The file is
    removed on release; a process killed while holding it leaves it behind, unlocked (the kernel drops an flock
    with its process), and the next taker reuses it.

    Raises (acquire):
        ValueError: `busy`, when another process holds the lock.
    """

    def __init__(self, path: str | Path, busy: str) -> None:
        super().__init__(Path(path).parent)
        self.path, self.busy = Path(path), busy
        self._locked = False

    def acquire(self) -> "LockFile":
        self._created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o666)  # the umask's mode: others may lock it too
            try:
                self._locked = _flock(fd, self.busy)
            except BaseException:
                os.close(fd)
                self.release(failed=True)
                raise
            try:  # the holder before us may have removed the file between our open and our lock: lock the one named
                current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current or not self._locked:
                self._fd = fd
                return self
            os.close(fd)

    def release(self, failed: bool = False) -> None:
        if self._fd is not None and self._locked:
            self.path.unlink(missing_ok=True)  # still held: whoever opened it meanwhile sees it gone and retries
        super().release(failed)
