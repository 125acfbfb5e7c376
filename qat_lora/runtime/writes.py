"""How a write fails: the disk's errors, whichever library raised them, as one OSError naming the path, and
nothing half-written left behind (`writing`). Used by the atomic writers in files.py and by every save that
goes through a library (safetensors, transformers, PEFT, tokenizers, gguf)."""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

# Rust's io::Error as safetensors (SafetensorError) and tokenizers (a bare Exception) word it: "... (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
# numpy's tofile (the GGUF writer's tensors) on a short write: an OSError with no errno.
_SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")


def disk_error(error: BaseException, path: str | Path) -> OSError | None:
    """The OSError that `error`, raised while writing `path`, stands for, naming `path` when it names no file
    (a write's ENOSPC names none); None for an error that is not the disk's. Libraries report the disk in their
    own types: safetensors' SafetensorError and tokenizers' Exception carry Rust's "(os error N)", numpy's short
    write (a full disk, when the free space is below what it asked for) no errno at all."""
    if not isinstance(error, Exception):
        return None  # Ctrl-C, exit: never rewritten
    code = error.errno if isinstance(error, OSError) else None
    text = str(error)
    if code is None and (found := _RUST_OS_ERROR.search(text)):
        code = int(found.group(1))
    elif code is None and "No space left on device" in text:
        code = errno.ENOSPC
    elif code is None and isinstance(error, OSError) and (found := _SHORT_WRITE.search(text)):
        full = shutil.disk_usage(Path(path).parent).free < int(found.group(1))  # less left than it asked to write
        code = errno.ENOSPC if full else errno.EIO
    if code is None:
        return None
    if isinstance(error, OSError) and error.errno == code and error.filename:
        return error
    return OSError(code, os.strerror(code), str(path))


def remove_written(path: Path) -> None:
    """Remove a file or folder a failed write left (gone already: nothing to do)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def writing(path: str | Path, *temporaries: str | Path):
    """The block that writes `path` (through `temporaries`: files or folders under temporary names, renamed into
    place at its end). If it fails, the temporaries are removed, so a full disk leaves neither a half-written file
    under a real name nor debris, and a disk error, whichever library raised it, becomes an OSError naming `path`
    (disk_error): one line on the command line, not a traceback.

        with writing(path, tmp):
            write(tmp)
            os.replace(tmp, path)
    """
    try:
        yield
    except BaseException as e:
        error = disk_error(e, path)  # before the removal: a short write is judged by the free space it left
        for tmp in temporaries:
            remove_written(Path(tmp))
        if error is None or error is e:
            raise
        raise error from None
