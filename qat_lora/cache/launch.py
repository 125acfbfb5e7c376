"""Building a cache on N chips (`qat-lora build-cache`): one builder per chip of this host, each writing its
rank's shards and partial manifest with no collective, then (once every rank is done) the merge.

On XLA (a TPU host, or XLA:CPU's devices) `--parallel auto` builds in one SPMD process over the chips, as
`--parallel spmd|fsdp` do: the host loads, fingerprints and tokenises once, and one process compiles the teacher
once per shape (the persistent compile cache keeps it for the next build). Elsewhere, and with `--parallel
processes`, one builder per chip: torch_xla.launch replicas on a TPU host, else local processes
(runtime/launch.py's launch_local, RANK / WORLD_SIZE only).
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

from qat_lora.cache.config import CacheBuildConfig
from qat_lora.runtime import device as dev
from qat_lora.runtime.files import FolderLock
from qat_lora.runtime.launch import chips_to_use, launch_local, select_tpu_chips, spmd_backend
from qat_lora.runtime.options import to_argv


def chip_rank(host_rank: int, host_world: int, index: int, chips: int) -> tuple[int, int]:
    """(rank, world size) of the builder on chip `index` of host `host_rank` of `host_world`, `chips` per host:
    the hosts split the sequences (--rank / --world-size) and each host's chips split its share."""
    return host_rank * chips + index, host_world * chips


def build_cache_on_chips(cfg: CacheBuildConfig, log: Callable[[str], None] = print) -> Path:
    """`qat-lora build-cache`: one builder per chip of this host, then (once every rank is done) the merge.

    The builders share nothing and run no collective (XLA:CPU replicas could not: DESIGN §6): each writes its
    rank's shards and partial manifest; this process merges them after all have ended. On a TPU host they are
    torch_xla.launch replicas (rank = global ordinal); elsewhere one process each (gloo-free: RANK/WORLD_SIZE
    only), which is also how XLA:CPU runs them. Returns the manifest (or, on one host of several, its folder).

    This process holds the lock on --out (files.FolderLock) for the whole build, merge included; a builder that
    a launcher started (WORLD_SIZE > 1: ours, whose lock it cannot take again, or torchrun's, whose hosts may
    share one folder) takes none, nor does one host's share of a --world-size > 1 build (the hosts may share it).
    Every builder holds its own rank's lock file (folder.rank_lock): a second builder of one rank fails at once.

    Raises:
        ValueError: a builder failed (its own error was printed above), a bad --num-chips, or another command
            writing --out (or building one of its ranks).
        SystemExit: 128 + the signal after SIGTERM / SIGINT (--resume continues the build).
    """
    from qat_lora.cache.builder import build_cache
    from qat_lora.cache.folder import check_out_path

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return build_cache(replace(cfg, num_chips=1), log)
    check_out_path(cfg)  # before the lock, which would create the folder inside an input
    if cfg.world_size > 1:  # hosts of one build may share the folder (each writes only its own ranks' files)
        return _build_locked(cfg, log)
    with FolderLock(cfg.out, "--out"):
        return _build_locked(cfg, log)


def _build_locked(cfg: CacheBuildConfig, log: Callable[[str], None]) -> Path:
    from qat_lora.cache.builder import build_cache
    from qat_lora.cache.folder import clear_debris, prepare_out

    chips = chips_to_use(cfg.num_chips, cfg.device)
    parallel = cfg.parallel
    if parallel == "auto" and chips > 1 and dev.wants_xla(cfg.device):
        log(f"--parallel auto: one SPMD process over {chips} XLA devices (each batch split over them)")
        parallel = "spmd"
    if parallel in ("spmd", "fsdp"):
        if not dev.wants_xla(cfg.device):
            raise ValueError(f"--parallel {parallel} with --device {cfg.device}: SPMD needs --device xla or tpu; "
                             "use --parallel processes")
        if dev.tpu_present():
            select_tpu_chips(chips, per_process=False, log=log)
        backend = spmd_backend(chips, fsdp=parallel == "fsdp")
        if backend.world_size > 1:  # the build places each batch as one host's whole: it cannot feed a pod's mesh
            raise ValueError(f"--parallel {cfg.parallel} on a {backend.world_size}-host slice: build with --parallel "
                             "processes on every host (each takes its share of the ranks), or on one host's chips")
        built = build_cache(cfg, log, backend=backend)
        return built if cfg.world_size == 1 else _merge_when_complete(cfg, log)
    if chips == 1:
        built = build_cache(replace(cfg, num_chips=1), log)
        if cfg.world_size == 1:
            return built
        return _merge_when_complete(cfg, log)  # one host's share of a --world-size build: the last one merges
    # Once, here, before any builder starts: a builder clearing the folder (--overwrite) or every rank's debris of
    # a killed build would delete the files of those started before it. Other hosts may be writing a shared
    # folder: there this host clears only its own ranks' files, and each builder only its own rank's debris.
    if cfg.overwrite:
        prepare_out(cfg, [chip_rank(cfg.rank, cfg.world_size, i, chips)[0] for i in range(chips)])
    elif cfg.world_size == 1:
        clear_debris(cfg, every_rank=True)
    one = replace(cfg, num_chips=1, overwrite=False)
    if dev.wants_xla(cfg.device) and dev.tpu_present():
        import torch_xla

        select_tpu_chips(chips, per_process=True, log=log)
        log(f"building on {chips} TPU chips (torch_xla replicas)")
        torch_xla.launch(_build_rank, args=(one, chips))
    else:
        _build_local(one, chips, log)
    return _merge_when_complete(cfg, log)


def _merge_when_complete(cfg: CacheBuildConfig, log: Callable[[str], None]) -> Path:
    """The merged manifest once every rank of the build is in --out; else its folder, saying what is missing."""
    from qat_lora.cache.merge import merge_manifests, unfinished_ranks

    missing = unfinished_ranks(Path(cfg.out))
    if missing:
        log(f"ranks {missing[0]}..{missing[-1]} of this build are not done (other hosts): once they are, run "
            f"`qat-lora cache merge {cfg.out}`")
        return Path(cfg.out)
    return merge_manifests(cfg.out, log)


def _build_local(cfg: CacheBuildConfig, chips: int, log: Callable[[str], None]) -> None:
    """`chips` builder processes (launch_local). A stop signal forwarded to them ends this process with 128 + the
    signal once they have stopped; a builder that failed or was killed from outside is a failure."""
    if dev.wants_xla(cfg.device):
        # XLA:CPU: torch_xla.launch would run the builders as threads of this process, which race on
        # transformers' lazy imports (measured: ImportError) and share one set of counters; processes do not.
        os.environ.update(PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"), CPU_NUM_DEVICES="1")
    log(f"building on {chips} local processes")
    exits = launch_local([sys.executable, "-m", "qat_lora", "build-cache", *to_argv(cfg)], chips, log=log)
    code = exits.exit_code()
    if exits.failed:
        raise ValueError(f"--num-chips {chips}: a builder exited with {code} (its error is above); rerun with "
                         "--resume to continue after the shards already written")
    if any(exits.codes):  # not failed: every builder that did not finish stopped cleanly (STOP_CODES)
        log(f"stopped by {signal.Signals(code - 128).name}; rerun the same command with --resume to continue after "
            "the shards already written")
        raise SystemExit(code)


def _build_rank(index: int, cfg: CacheBuildConfig, chips: int) -> None:
    """One torch_xla replica of a cache build: its rank's shards and partial manifest, no collective."""
    import torch_xla.runtime as xr

    from qat_lora.cache.builder import build_cache

    if xr.world_size() > chips:  # a multi-host slice: the runtime's ordinals already span the hosts
        rank, world = xr.global_ordinal(), xr.world_size()
    else:
        rank, world = chip_rank(cfg.rank, cfg.world_size, index, chips)
    build_cache(replace(cfg, rank=rank, world_size=world), log=print if rank == 0 else (lambda _: None))
