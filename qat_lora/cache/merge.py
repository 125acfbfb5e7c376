"""A cache built by several ranks, made one: each rank's partial manifest (`manifest-rRRR.json`) read and checked,
the ranks other hosts built gathered into one folder (`qat-lora cache merge DEST --from A [B ...]`), and the single
`manifest.json` the reader needs written once every rank is done (builder.py writes the ranks' shards).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from qat_lora.data import text as data

from qat_lora.cache.reader import MANIFEST, shard_build
from qat_lora.runtime.files import (SAFETENSORS_TEMP, FolderLock, apply_umask, atomic_write_json, owner_stamp,
                                    read_record, sha256_file)


# Every name a build writes in its folder (shards, progress, partial and merged manifests, their temp files, the
# temp file safetensors itself saves through, and each rank's lock file: folder.rank_lock).
LOCK_FILE = "build-r{rank:03d}.lock"
BUILD_FILE = re.compile(r"((train|heldout)-r\d{3}-\d{5}\.safetensors|progress-r\d{3}\.json|manifest(-r\d{3})?\.json)"
                        r"(\.tmp)?|build-r\d{3}\.lock|" + SAFETENSORS_TEMP.pattern)


def unfinished_ranks(out: Path) -> list[int]:
    """Ranks of the build in `out` without a partial manifest yet (all of them when none exists)."""
    partials = [_read_partial(p) for p in sorted(out.glob("manifest-r*.json"))]
    if not partials:
        return [0]
    return sorted(set(range(partials[0]["world_size"])) - {p["rank"] for p in partials})


_PARTIAL_KEYS = {"rank": int, "world_size": int, "shards": dict, "sequences": dict, "tokens": dict, "header": dict,
                 "seconds": (int, float)}


def _read_partial(path: Path) -> dict:
    """One rank's partial manifest, its fields checked (a damaged one is named, not a KeyError)."""
    partial = read_record(path)
    bad = [k for k, kind in _PARTIAL_KEYS.items() if not isinstance((partial or {}).get(k), kind)]
    if partial is None or bad:
        what = "not a JSON object" if partial is None else f"no valid `{bad[0]}`"
        raise ValueError(f"{path}: not a rank's partial manifest ({what}); rerun build-cache --resume for that rank")
    return partial


def _same_build(a: dict, b: dict) -> bool:
    """Whether two ranks' partial manifests come from one build (teacher, tokenizer, encoding, corpus, world)."""
    def key(p: dict) -> str:
        return json.dumps([p["world_size"], {k: v for k, v in p["header"].items() if k != "builder"}], sort_keys=True)
    return key(a) == key(b)


def gather_ranks(dest: str | Path, sources: list[str], log: Callable[[str], None] = print) -> Path:
    """`qat-lora cache merge DEST --from A [B ...]`: bring the ranks other hosts built into their own folders
    (`build-cache --rank R --world-size W`, same arguments) into DEST, each shard copied under a temporary name,
    checked against its rank's sha256 and renamed, the rank's partial manifest last; then merge. A manifest never
    reaches outside its folder, so the shards must live beside it.

    Raises:
        ValueError: a source that is not a rank's build folder, ranks of another build, or a rank DEST already has
            from another build; a shard missing or changed.
    """
    dest = Path(dest)
    if not dest.is_dir() or not [p for p in dest.iterdir() if re.fullmatch(r"(progress|manifest)-r\d{3}\.json", p.name)]:
        raise ValueError(f"cache merge {dest}: no build there; pass the folder one host's build-cache wrote")
    with FolderLock(dest, "cache merge"):
        mine = [_read_partial(p) for p in sorted(dest.glob("manifest-r*.json"))]
        for source in map(Path, sources):
            found = sorted(source.glob("manifest-r*.json")) if source.resolve() != dest.resolve() else []
            if not found:
                raise ValueError(f"--from {source}: no manifest-r*.json of another folder; pass a folder that "
                                 "build-cache --rank R wrote")
            for path in found:
                mine.append(_gather_rank(dest, source, path, mine))
        log(f"{dest}: ranks {sorted(p['rank'] for p in mine)} of {mine[0]['world_size']} present")
        return merge_manifests(dest, log)


def _gather_rank(dest: Path, source: Path, path: Path, present: list[dict]) -> dict:
    partial = _read_partial(path)
    if present and not _same_build(partial, present[0]):
        raise ValueError(f"--from {path}: another build than {dest}'s (teacher, tokenizer, encoding, corpus or world "
                         "size differ); build every rank with the same arguments")
    target = dest / path.name
    if target.exists():
        if target.read_bytes() == path.read_bytes():
            return partial  # gathered before (a rerun of the same merge)
        raise ValueError(f"--from {path}: {dest} already holds a rank {partial['rank']} of its own; each rank of a "
                         "build is built once")
    rank_tag = f"-r{partial['rank']:03d}-"
    for split in data.SPLITS:
        for shard in partial["shards"].get(split, []):
            name = shard.get("file") if isinstance(shard, dict) else None
            if not (isinstance(name, str) and BUILD_FILE.fullmatch(name) and rank_tag in name):
                raise ValueError(f"--from {path}: shard name {name!r} is not one of rank {partial['rank']}'s; refusing it")
            tmp = dest / (name + ".tmp")
            try:
                shutil.copyfile(source / name, tmp)
            except FileNotFoundError:
                raise ValueError(f"--from {source}: shard {name} is missing; rebuild that rank with --resume") from None
            if sha256_file(tmp) != shard.get("sha256"):
                tmp.unlink()
                raise ValueError(f"--from {source}: shard {name} differs from its manifest (sha256); rebuild that rank")
            apply_umask(tmp)
            os.replace(tmp, dest / name)
    atomic_write_json(target, partial)
    return partial


def merge_manifests(path: str | Path, log: Callable[[str], None] = print) -> Path:
    """Unite the ranks' partial manifests into `manifest.json`; every rank of the build must be done."""
    out = Path(path)
    partials = [_read_partial(p) for p in sorted(out.glob("manifest-r*.json"))]
    if not partials:
        raise ValueError(f"{out}: no manifest-r*.json; run build-cache first")
    world = partials[0]["world_size"]
    ranks = sorted(p["rank"] for p in partials)
    if ranks != list(range(world)):
        raise ValueError(f"{out}: ranks {ranks} finished, the build has {world}; finish the missing ranks first")
    headers = [json.dumps({k: v for k, v in p["header"].items() if k != "builder"}, sort_keys=True) for p in partials]
    if len(set(headers)) != 1:
        raise ValueError(f"{out}: the ranks' manifests disagree (teacher, tokenizer, encoding or corpus)")
    builds = {p.get("build_id") for p in partials}  # None: a rank built before build ids were recorded
    if len(builds - {None}) > 1:
        raise ValueError(f"{out}: the ranks come from different builds (other --seed, --shard-sequences or token "
                         "budget); rebuild them with the same arguments")
    for partial in partials:
        _check_rank_shards(out, partial)
    splits = {}
    for split in data.SPLITS:
        shards = [dict(sh, rank=p["rank"]) for p in partials for sh in p["shards"][split]]
        splits[split] = {"sequences": partials[0]["sequences"][split], "tokens": partials[0]["tokens"][split],
                         "shards": shards}
        if sum(len(range(*sh["rows"])) for sh in shards) != splits[split]["sequences"]:
            raise ValueError(f"{out}: the {split} shards do not cover its {splits[split]['sequences']} sequences")
    manifest = {**owner_stamp("cache"), **partials[0]["header"], "world_size": world, "splits": splits,
                "build_seconds": max(p["seconds"] for p in partials)}
    if len(builds) == 1 and None not in builds:
        manifest["build_id"] = builds.pop()
    atomic_write_json(out / MANIFEST, manifest)
    log(f"wrote {out / MANIFEST}")
    return out / MANIFEST


def _check_rank_shards(out: Path, partial: dict) -> None:
    """Every shard a rank's partial manifest lists is there, of its recorded size and written by that rank's build
    (the shard's own record of its build: builder.build_id), so no merged manifest ever unites two builds' shards.
    Cheap: sizes and headers, not checksums (`qat-lora cache verify` reads every byte).

    Raises:
        ValueError: one line naming the shard and the rank to rebuild.
    """
    rank = partial["rank"]
    for split in data.SPLITS:
        for shard in partial["shards"].get(split, []):
            name = shard.get("file") if isinstance(shard, dict) else None
            if not (isinstance(name, str) and BUILD_FILE.fullmatch(name) and f"-r{rank:03d}-" in name):
                raise ValueError(f"{out}: shard name {name!r} in manifest-r{rank:03d}.json is not one of rank "
                                 f"{rank}'s; rebuild rank {rank} with --overwrite")
            file = out / name
            if not file.is_file():
                raise ValueError(f"{file}: missing; rebuild rank {rank} with --resume")
            if partial.get("build_id") and shard_build(file) not in (None, partial["build_id"]):
                raise ValueError(f"{file}: written by another build than rank {rank}'s manifest-r{rank:03d}.json (two "
                                 f"builders wrote this folder); rebuild rank {rank} with --overwrite")
            if file.stat().st_size != shard.get("bytes"):
                raise ValueError(f"{file}: {file.stat().st_size} bytes, rank {rank}'s manifest says "
                                 f"{shard.get('bytes')}; rebuild rank {rank} with --overwrite")
