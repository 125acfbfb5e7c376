"""The cache folder and who may change it: --out kept apart from the inputs and free of a user's files, one builder
per rank (a lock file per rank, `build-rRRR.lock`: the hosts of one build may share the folder), and the removals
(--overwrite, a killed build's debris) that prove ownership rank by rank.

A whole build (--world-size 1: every rank runs from this command) owns the folder and clears what any build wrote
there. A share of a multi-rank build removes only its own ranks' files, and only those its own records list (the
rank's progress and partial manifest): never another rank's. The merged manifest such a rebuild makes stale goes
too (`qat-lora cache merge`, or the last rank to finish, writes it again from the ranks' partial manifests).
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from qat_lora.data import text as data

from qat_lora.cache.config import CacheBuildConfig
from qat_lora.cache.merge import BUILD_FILE, LOCK_FILE
from qat_lora.cache.reader import MANIFEST
from qat_lora.runtime.files import LockFile, check_out_apart_from_inputs, owned_by, read_record, save_debris

_RANK_IN_NAME = re.compile(r"-r(\d{3})[-.]")  # the rank a build file's name carries
_held: dict[tuple[str, int], LockFile] = {}  # (folder, rank) locks this process holds: taking one again is a no-op


@contextmanager
def rank_lock(out: str | Path, rank: int) -> Iterator[None]:
    """Hold rank `rank`'s lock in `out` (creating the folder): a second builder of that rank fails at once, builders
    of other ranks run on. Released however the process ends; reentrant within this process.

    Raises:
        ValueError: another process builds rank `rank` in `out` now.
    """
    out = Path(out)
    key = (str(out.resolve()), rank)
    if key in _held:
        yield
        return
    busy = f"--out {out}: another builder of rank {rank} is writing there now; wait for it to end or choose another " \
           "--out"
    lock = LockFile(out / LOCK_FILE.format(rank=rank), busy)
    _held[key] = lock.acquire()
    failed = True
    try:
        yield
        failed = False
    finally:
        del _held[key]
        lock.release(failed)


def check_out_path(cfg: CacheBuildConfig) -> Path:
    """--out as a folder apart from every input (the launcher checks it before taking the folder's lock)."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; pass a folder for the cache")
    check_out_apart_from_inputs(out, {"--teacher": cfg.teacher, "--data": cfg.data})
    return out


def check_out(cfg: CacheBuildConfig) -> Path:
    """Refuse an --out that cannot take this build, before any model loads. A folder holding anything a build
    did not write (a model, another project) is refused outright: nothing of the user's is ever deleted."""
    out = check_out_path(cfg)
    foreign = sorted(p.name for p in out.iterdir() if not BUILD_FILE.fullmatch(p.name)) if out.exists() else []
    if foreign:
        raise ValueError(f"--out {out}: holds files a cache build did not write ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}); pass an empty or new folder")
    mine = f"-r{cfg.rank:03d}-"
    if (out / MANIFEST).exists() and not cfg.overwrite:
        raise ValueError(f"--out {out}: a cache already exists there; pass --overwrite or choose another folder")
    if not cfg.resume and any(mine in p.name for p in out.glob("*.safetensors")) and not cfg.overwrite:
        whose = f" of rank {cfg.rank}" if cfg.world_size > 1 else ""
        raise ValueError(f"--out {out}: holds an unfinished build{whose}; pass --resume or --overwrite")
    return out


def finished(cfg: CacheBuildConfig) -> bool:
    """--resume on a cache whose build finished with these same arguments (its merged manifest exists): true for
    each rank of a multi-rank build too, so rerunning `build-cache --num-chips N --resume` is a no-op."""
    out = Path(cfg.out)
    if not (cfg.resume and (out / MANIFEST).exists()):  # merged: every rank finished
        return False
    return (read_record(out / f"progress-r{cfg.rank:03d}.json") or {}).get("fingerprint") == cfg.fingerprint()


def prepare_out(cfg: CacheBuildConfig, ranks: Collection[int] | None = None) -> Path:
    """Create or reuse the checked cache folder and clear what this build replaces, under the lock of every rank it
    clears: a whole build (--world-size 1) every build's debris and, with --overwrite, every file a build wrote; a
    share of a multi-rank build only its own `ranks` (default --rank), as their own records prove them.

    Raises:
        ValueError: the folder cannot take this build (`check_out`), another builder holds a rank to clear, or
            the merged manifest to remove lists ranks whose partial manifests are gone.
    """
    out = check_out(cfg)
    out.mkdir(parents=True, exist_ok=True)
    whole = cfg.world_size == 1
    mine = _ranks_in(out) | {cfg.rank} if whole else set([cfg.rank] if ranks is None else ranks)
    with ExitStack() as locks:
        for rank in sorted(mine):
            locks.enter_context(rank_lock(out, rank))
        _clear_debris(out, None if whole else mine)
        if cfg.overwrite and whole:
            for old in out.iterdir():
                if BUILD_FILE.fullmatch(old.name) and not old.name.endswith(".lock"):  # all match (checked above)
                    old.unlink()
        elif cfg.overwrite:
            _clear_merged(out, mine)
            for rank in sorted(mine):
                _clear_rank(out, rank)
    return out


def clear_debris(cfg: CacheBuildConfig, every_rank: bool) -> None:
    """Remove what saves killed mid-write left in --out: every rank's when no builder runs yet (`every_rank`), else
    only this rank's own, as another rank's temp file may be in flight right now."""
    _clear_debris(Path(cfg.out), None if every_rank else {cfg.rank})


def _clear_debris(out: Path, ranks: Collection[int] | None) -> None:
    """Half-written files (they never carry a real name) of `ranks` (None: of every rank, and safetensors' own
    temp files). Only names a build writes: a user's `notes.tmp` stays."""
    for stale in save_debris(out) if out.is_dir() else []:
        rank = _RANK_IN_NAME.search(stale.name)
        if BUILD_FILE.fullmatch(stale.name) and (ranks is None or (rank and int(rank[1]) in ranks)):
            stale.unlink()


def _ranks_in(out: Path) -> set[int]:
    return {int(m[1]) for p in out.iterdir() if BUILD_FILE.fullmatch(p.name) and (m := _RANK_IN_NAME.search(p.name))}


def _clear_rank(out: Path, rank: int) -> None:
    """Remove rank `rank`'s build as far as its own records prove it: the shards its progress record and partial
    manifest list under its own name, then those records. A file no record of the rank lists stays (the new build
    replaces one of the same name as it writes)."""
    tag = f"-r{rank:03d}-"
    for record in (out / f"progress-r{rank:03d}.json", out / f"manifest-r{rank:03d}.json"):
        entry = read_record(record)
        if entry is None or entry.get("rank") != rank or not owned_by(record, "cache", legacy_keys=("rank", "shards")):
            continue
        shards = entry.get("shards") if isinstance(entry.get("shards"), dict) else {}
        for split in data.SPLITS:
            for shard in shards.get(split) if isinstance(shards.get(split), list) else []:
                name = shard.get("file") if isinstance(shard, dict) else None
                if isinstance(name, str) and BUILD_FILE.fullmatch(name) and tag in name:
                    (out / name).unlink(missing_ok=True)
        record.unlink()


def _clear_merged(out: Path, ranks: Collection[int]) -> None:
    """Remove the merged manifest that rebuilding `ranks` makes stale (it would claim their old shards). The ranks'
    partial manifests write it again, so each other rank it lists must still have its own.

    Raises:
        ValueError: another rank of the merged manifest lacks its partial manifest (it could not be merged again).
    """
    manifest = read_record(out / MANIFEST)
    if manifest is None or not owned_by(out / MANIFEST, "cache", legacy_keys=("schema_version", "splits")):
        return
    world = manifest.get("world_size", 1)
    lost = [r for r in range(world if isinstance(world, int) else 1)
            if r not in ranks and not (out / f"manifest-r{r:03d}.json").is_file()]
    if lost:
        raise ValueError(f"--out {out}: its manifest.json lists rank {lost[0]}, whose manifest-r{lost[0]:03d}.json is "
                         "gone: rebuilding here would leave that rank unmergeable; build into another --out")
    (out / MANIFEST).unlink()
