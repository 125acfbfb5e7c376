"""Starting the ranks of a run: one process, N local processes, torch_xla replicas or one SPMD process.

`run(cfg)` is what `qat-lora train` calls; `build_cache_on_chips(cfg)` what `qat-lora build-cache` calls.
`--num-chips 0` (the default) means every TPU chip of the host, one device elsewhere; on a TPU host with more
chips than asked for, the PJRT visibility variables limit the run to the first N (`tpu_visibility_env`).
With one chip (or inside a rank a launcher already started: WORLD_SIZE is set) it trains in this process;
otherwise (DESIGN §6):
- CUDA / CPU: `launch_local` starts N processes with torchrun's environment (NCCL / gloo) and waits for them;
  a rank that fails stops the others.
- TPU: `torch_xla.launch` replicas (xm.reduce_gradients + a plain optimizer.step), or one SPMD process over
  the chips with `--parallel spmd` (the batch sharded) or `--parallel fsdp` (the frozen parameters too:
  sharding.py; also on XLA:CPU).
- XLA on a CPU host: one SPMD process over CPU_NUM_DEVICES devices (its spawned replicas cannot run
  collectives: pytorch/xla #5005, #9089).

    qat-lora train --num-chips 2 --device cpu --model M --cache caches/kd --out runs/x
    qat-lora train --num-chips 4 --device tpu --model M --cache caches/kd --out runs/x
    torchrun --nproc-per-node 8 -m qat_lora train --device cuda --model M --cache caches/kd --out runs/x
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from qat_lora.runtime import device as dev
from qat_lora.train.config import TrainConfig, to_argv
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.runtime.files import FolderLock


def run(cfg: TrainConfig, log: Callable[[str], None] = print) -> int:
    """Train `cfg` on `cfg.num_chips` devices; returns the exit code (0, or the first failing rank's).

    Raises:
        ValueError: SPMD without XLA, or XLA replicas on a host without a TPU.
    """
    from qat_lora.train.trainer import train

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        train(cfg, log)
        return 0
    cfg = replace(cfg, num_chips=chips_to_use(cfg.num_chips, cfg.device))
    xla = dev.wants_xla(cfg.device)
    parallel = cfg.parallel
    if xla and dev.tpu_present():  # before any runtime starts: the chips this run may see
        select_tpu_chips(cfg.num_chips, per_process=cfg.num_chips > 1 and parallel in ("auto", "processes"), log=log)
    if cfg.num_chips == 1 and parallel != "fsdp":
        train(cfg, log)
        return 0
    one_process = ("spmd", "fsdp")
    if parallel in one_process and not xla:
        raise ValueError(f"--parallel {parallel} with --device {cfg.device}: SPMD needs --device xla or tpu; use "
                         "--parallel processes")
    if xla and not dev.tpu_present() and parallel not in one_process:
        if parallel == "processes":
            raise ValueError(f"--device {cfg.device} --num-chips {cfg.num_chips} --parallel processes: XLA:CPU "
                             "replicas cannot run collectives (DESIGN §6); use --parallel spmd, a TPU, or --device cpu")
        log(f"XLA on a CPU host: its replicas cannot run collectives (DESIGN §6); training one SPMD process "
            f"over {cfg.num_chips} devices instead")
        parallel = "spmd"
    if parallel in one_process:
        return _train_spmd(cfg, fsdp=parallel == "fsdp")
    if xla:
        import torch_xla

        log(f"starting torch_xla replicas for {cfg.num_chips} chips")
        torch_xla.launch(_xla_rank, args=(cfg,))
        return 0
    check_local_devices(cfg)
    log(f"starting {cfg.num_chips} local ranks ({'NCCL' if cfg.device == 'cuda' else 'gloo'})")
    cmd = [sys.executable, "-m", "qat_lora", "train", *to_argv(cfg)]
    return launch_local(cmd, cfg.num_chips, log=log).exit_code()


def check_local_devices(cfg: TrainConfig) -> None:
    """Refuse more local ranks than this host has GPUs (CUDA) or cores (CPU), before any rank starts: more
    would share a GPU or a core each, and run out of memory or many times slower instead of failing."""
    if cfg.device == "cuda" or (cfg.device == "auto" and dev.resolve_device("auto").type == "cuda"):
        import torch

        have, what = torch.cuda.device_count(), "GPUs"
    else:
        have, what = os.cpu_count() or 1, "CPU cores"
    if cfg.num_chips > have:
        raise ValueError(f"--num-chips {cfg.num_chips}: this host has {have} {what}; pass --num-chips {have} or "
                         "fewer")


def _xla_rank(index: int, cfg: TrainConfig) -> None:
    """One torch_xla replica: train with the XLA backend."""
    from qat_lora.runtime.distributed import XlaBackend
    from qat_lora.train.trainer import train

    backend = XlaBackend()
    if backend.world_size != cfg.num_chips:  # torch_xla.launch starts one replica per visible chip
        raise ValueError(f"--num-chips {cfg.num_chips}: torch_xla started {backend.world_size} replicas (one per "
                         f"visible chip); pass --num-chips {backend.world_size}, or limit the chips with "
                         "TPU_VISIBLE_CHIPS / TPU_PROCESS_BOUNDS")
    train(cfg, backend=backend)


def spmd_backend(num_chips: int, fsdp: bool):
    """The one SPMD process over `num_chips` XLA devices (on the host CPU: CPU_NUM_DEVICES of them) that
    `--parallel spmd` trains and builds caches with; with `fsdp` the frozen parameters are sharded over them
    too (sharding.FsdpBackend). Call before any XLA work."""
    from qat_lora.runtime.distributed import SpmdBackend
    from qat_lora.runtime.sharding import FsdpBackend

    os.environ.setdefault("PJRT_DEVICE", "TPU" if dev.tpu_present() else "CPU")
    if os.environ["PJRT_DEVICE"].upper() == "CPU":
        os.environ["CPU_NUM_DEVICES"] = str(num_chips)
    backend = FsdpBackend() if fsdp else SpmdBackend()
    if backend.data_parallel != num_chips:
        raise ValueError(f"--num-chips {num_chips}: this host has {backend.data_parallel} XLA devices")
    return backend


def _train_spmd(cfg: TrainConfig, fsdp: bool = False) -> int:
    from qat_lora.train.trainer import train

    train(cfg, backend=spmd_backend(cfg.num_chips, fsdp))
    return 0


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

    Raises:
        ValueError: a builder failed (its own error was printed above), a bad --num-chips, or another command
            writing --out.
        SystemExit: 128 + the signal after SIGTERM / SIGINT (--resume continues the build).
    """
    from qat_lora.cache.builder import build_cache, check_out_path

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return build_cache(replace(cfg, num_chips=1), log)
    check_out_path(cfg)  # before the lock, which would create the folder inside an input
    if cfg.world_size > 1:  # hosts of one build may share the folder (each writes only its own ranks' files)
        return _build_locked(cfg, log)
    with FolderLock(cfg.out, "--out"):
        return _build_locked(cfg, log)


def _build_locked(cfg: CacheBuildConfig, log: Callable[[str], None]) -> Path:
    from qat_lora.cache.builder import build_cache, clear_debris, prepare_out

    chips = chips_to_use(cfg.num_chips, cfg.device)
    if cfg.parallel in ("spmd", "fsdp"):
        if not dev.wants_xla(cfg.device):
            raise ValueError(f"--parallel {cfg.parallel} with --device {cfg.device}: SPMD needs --device xla or tpu; "
                             "use --parallel processes")
        if dev.tpu_present():
            select_tpu_chips(chips, per_process=False, log=log)
        backend = spmd_backend(chips, fsdp=cfg.parallel == "fsdp")
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
    # folder: there each builder clears only its own rank's debris.
    if cfg.overwrite:
        prepare_out(cfg)
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
    from qat_lora.cache.builder import merge_manifests, unfinished_ranks

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


# The chip mesh of a TPU host slice of N chips (x, y, z): what libtpu's *_BOUNDS variables describe.
_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
_TPU_VISIBILITY_KEYS = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS")


def tpu_visibility_env(num_chips: int, host_chips: int, per_process: bool) -> dict[str, str]:
    """The PJRT/libtpu variables that make a run use the first `num_chips` of a host's `host_chips` chips.

    Args:
        per_process: one process per chip (torch_xla.launch replicas: each replica then picks its own chip
            through torch_xla's topology set-up); else one process over all `num_chips` (SPMD, or one chip).
    Returns:
        {} when the run uses every chip (the runtime's own topology), else the variables to set.
    Raises:
        ValueError: more chips than the host has, or a count no TPU host slice has.
    """
    if num_chips > host_chips:
        raise ValueError(f"--num-chips {num_chips}: this host has {host_chips} TPU chip(s); pass --num-chips "
                         f"{host_chips} or fewer")
    if num_chips == host_chips:
        return {}
    if num_chips not in _CHIP_BOUNDS:
        raise ValueError(f"--num-chips {num_chips}: a TPU host runs on 1, 2, 4 or 8 of its chips; pass one of those")
    if per_process:  # N processes of one chip each: torch_xla.launch starts min(chips, N) replicas
        return {"TPU_PROCESS_BOUNDS": _CHIP_BOUNDS[num_chips], "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1"}
    return {"TPU_VISIBLE_CHIPS": ",".join(map(str, range(num_chips))),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": _CHIP_BOUNDS[num_chips], "TPU_PROCESS_BOUNDS": "1,1,1"}


def tpu_chip_count() -> int:
    """TPU chips attached to this host (a PCI scan: no runtime starts, no chip is claimed)."""
    from torch_xla._internal import tpu

    return tpu.num_available_chips()


def chips_to_use(requested: int, device: str) -> int:
    """--num-chips as a count: 0 means every TPU chip of this host, and one device anywhere else."""
    if requested:
        return requested
    return max(1, tpu_chip_count()) if dev.wants_xla(device) and dev.tpu_present() else 1


def select_tpu_chips(num_chips: int, per_process: bool, log: Callable[[str], None] = print) -> None:
    """Limit this process (and the replicas it starts) to `num_chips` TPU chips; a user's own
    TPU_VISIBLE_CHIPS / *_BOUNDS settings win."""
    host_chips = tpu_chip_count()
    if host_chips == 0:  # no PCI view of the chips (some containers): leave the runtime's own topology
        log("TPU chips: this host's chips cannot be counted; using the runtime's own topology")
        return
    env = tpu_visibility_env(num_chips, host_chips, per_process)
    if env and any(k in os.environ for k in _TPU_VISIBILITY_KEYS):
        log(f"TPU chips: keeping this environment's {', '.join(k for k in _TPU_VISIBILITY_KEYS if k in os.environ)}")
        return
    if env:
        log("TPU chips: " + " ".join(f"{k}={v}" for k, v in env.items()))
        os.environ.update(env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STATUS_ENV = "QAT_LORA_RANK_STATUS"  # a folder where a rank that lost its peers says so (launch_local sets it)
STOP_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT)  # a rank stopped cleanly


@dataclass
class RankExits:
    """How a group of local ranks ended: every rank's exit code, and the ranks to blame for a failure."""

    codes: list[int]  # in rank order; negative: killed by that signal
    failed: list[int] = field(default_factory=list)  # the ranks that failed first (not those stopped after them)
    stopped_by: int | None = None  # a stop signal the launcher itself received and forwarded

    def exit_code(self) -> int:
        """The launcher's exit code: 128 + n only for a stop signal, the failed rank's 1 or 2, else 1."""
        if self.failed:
            code = self.codes[self.failed[0]]
            return code if code in (1, 2) else 1  # a hung or killed rank is an environment failure, never 143
        if self.stopped_by is not None:
            return 128 + self.stopped_by
        return exit_code(self.codes)


def report_lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective that lost its peers (a timeout, a closed connection): not this rank's
    fault. Under launch_local it also leaves a marker, so the launcher blames the rank that hung or died."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False  # one process has no peers: a "timed out" there is something else (a bug to show in full)
    names = {c.__name__ for c in type(error).__mro__}
    text = str(error)
    lost = bool(names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}) or any(
        sign in text for sign in ("Timed out", "timed out", "Connection reset by peer", "Connection closed by peer"))
    if lost and os.environ.get(STATUS_ENV) and "RANK" in os.environ:
        Path(os.environ[STATUS_ENV], f"rank-{os.environ['RANK']}.lost").touch()
    return lost


def _failed_ranks(procs: list[subprocess.Popen], status: Path) -> list[int]:
    """The ranks to blame once some rank ended badly: those that failed on their own; when every failed rank
    only lost its peers (a collective timed out), the ranks still running: they hung."""
    bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0, *STOP_CODES)]
    own = [r for r in bad if not (status / f"rank-{r}.lost").exists()]
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    return own or hung or bad


def _describe(rank: int, procs: list[subprocess.Popen]) -> str:
    code = procs[rank].poll()
    if code is None:
        return f"rank {rank} stopped responding (the others gave up waiting for it after --dist-timeout-s)"
    if code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} failed with exit code {code}"


def launch_local(cmd: list[str], num_procs: int, grace_s: float = 10.0,
                 log: Callable[[str], None] = print) -> RankExits:
    """Run `cmd` as `num_procs` local ranks (torchrun's environment) and wait for all of them.

    When a rank fails, the launcher names it (a rank that hung, not the healthy one whose collective timed out
    waiting for it), sends the others SIGTERM, then SIGKILL after `grace_s`: every rank ends within
    --dist-timeout-s + `grace_s`. SIGTERM/SIGINT sent to the launcher are forwarded (every rank checkpoints).
    """
    status = Path(tempfile.mkdtemp(prefix="qat-lora-ranks-"))
    env = {**os.environ, "WORLD_SIZE": str(num_procs), "LOCAL_WORLD_SIZE": str(num_procs),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), STATUS_ENV: str(status)}
    # As torchrun: split the cores between ranks; N ranks each spinning on every core run many times slower.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_procs)))
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(num_procs)]
    result = RankExits([])

    def signal_all(signum: int) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    def forward(signum, _frame):
        result.stopped_by = signum
        signal_all(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed_at = None
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.poll() not in (None, 0, *STOP_CODES) for p in procs):
                failed_at = time.monotonic()
                result.failed = _failed_ranks(procs, status)
                log("; ".join(_describe(r, procs) for r in result.failed) + "; stopping every rank")
                for r in result.failed:  # a hung rank cannot checkpoint (its collectives have no peers): end it now
                    if procs[r].poll() is None:
                        procs[r].kill()
                signal_all(signal.SIGTERM)
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                signal_all(signal.SIGKILL)
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if not result.failed and any(p.returncode not in (0, *STOP_CODES) for p in procs):
        result.failed = _failed_ranks(procs, status)  # every rank ended at once
    shutil.rmtree(status, ignore_errors=True)
    result.codes = [p.returncode for p in procs]
    return result


def exit_code(codes: list[int]) -> int:
    """One exit code for a group of ranks: 0 when all succeeded, else the first failure (signals as 128+n)."""
    for code in codes:
        if code:
            return code if code > 0 else 128 - code
    return 0
