"""The trainer, as a recipe: replay the KD cache into a fake-quantised student's LoRA adapters and/or
quantiser parameters.

Set-up (student, trainable parameters, data, optimizer, resume: run.py), then the loop: for each optimizer step,
`accumulation_steps` micro-steps (forward, KD loss, backward), gradients averaged over ranks, clip, update,
one XLA graph cut per micro-step; then the final artefacts. Metrics are read through step closures every
`log_steps`, never inside the hot loop. Only the master evaluates, logs and writes. Everything it uses is a
component: config.TrainConfig, student (build, trainable sets, artefacts), loss.forward_loss, cache (reader),
checkpoint, runs (folder layout, metrics log, stop signal), distributed (collectives), device.

    qat-lora train --model M --cache caches/kd --quant w3g64 --out runs/w3g64 --max-steps 200
    qat-lora train --preset qat+lora ... --save-steps 50 --resume auto     # preemptible: rerun the same line
    qat-lora train --num-chips 2 --device cpu ...                           # gloo ranks (see train/launch.py)
    qat-lora train --online-teacher T --cache caches/kd ...                 # targets computed in the step

`--online-teacher T`: a teacher that fits beside the student runs in every micro-step (frozen, no gradient, same
device); its whole distribution is the target (the K = V loss, no cache bytes). The cache still gives the tokens,
their order and the held-out split, so a cached run of the same flags sees the same tokens (only the targets
differ) and resume, sharding and the XLA batch path stay one path; --eval-steps scores the cache's stored targets.

SIGTERM/SIGINT: the current step finishes, a checkpoint is written, and the process exits with 128 + the
signal number (143, 130): the run is unfinished, and the same command with `--resume auto` continues it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from qat_lora.train import checkpoint as ckpt

from qat_lora.runtime import device as dev
from qat_lora.runtime import precision, xla

from qat_lora.runtime import runs
from qat_lora.cache.reader import BASE_KEYS, KDCache, batches_per_epoch, endless_batches
from qat_lora.train.config import TrainConfig
from qat_lora.runtime.distributed import Backend, init_backend
from qat_lora.runtime.files import FolderLock, atomic_write_json
from qat_lora.train.loss import KDLossConfig, forward_loss
from qat_lora.train.metrics import kd_metrics
from qat_lora.train.reporting import open_reporters
from qat_lora.quant.fake_quant import constrain_quantizers_, quantized_weights_once_per_step, quantizer_parameters
from qat_lora.train.run import Run, check_out, finished_run, rows_per_micro_step, set_up
from qat_lora.train.student import begin_step, check_compile, save_artifacts


RERUN = "rerun the same command with --resume auto to continue"
# What each step leaves in `run.stats` (then its finite flag) and each --log-steps record holds.
STAT_KEYS = ("loss", "soft_ce", "kl", "ce", "grad_norm")


def train(cfg: TrainConfig, log: Callable[[str], None] = print, backend: Backend | None = None,
          rerun: str = RERUN) -> dict:
    """Train what `cfg.preset` names; returns the run summary (also written to `out/summary.json`).
    `rerun` is what a stop signal's message tells the user to do (a recipe calling train names its own command).

    Raises:
        SystemExit: 128 + signal number after SIGTERM/SIGINT, once a checkpoint is saved.
    """
    device = dev.resolve_device(cfg.device)
    check_compile(cfg.compile, device)
    if cfg.loss_chunk_size < 0:  # auto: config.json and checkpoints record the size that ran, resumes compare it
        cfg = dataclasses.replace(cfg, loss_chunk_size=precision.default_loss_chunk_size(device))
    cache = KDCache(cfg.cache)  # the inputs first: a missing cache is the error to report, not where --out is
    if cache.encoding.name == "sampled" and not cfg.online_teacher and cfg.temperature != 1.0:
        raise ValueError(f"--temperature {cfg.temperature}: --cache {cfg.cache} holds sampled targets, drawn at T = 1; "
                         "train at --temperature 1, or rebuild the cache with --encoding topk")
    check_out(cfg)
    finished = finished_run(cfg, device, log)
    if finished is not None:
        return finished
    # Set-up: device and collectives, then every input checked before the run folder is touched.
    backend = backend or init_backend(device, cfg.dist_timeout_s)
    device = dev.prepare_process(device, backend.local_rank, backend.world_size)
    master = backend.is_master
    if dev.is_xla(device):
        xla_cache = xla.init_xla_cache(cfg.xla_cache_dir, backend.local_rank)
        if master:
            log(f"persistent XLA compile cache: {xla_cache or 'off'}")
    # The master holds --out for the whole run: a second command writing there fails at once.
    with FolderLock(cfg.out) if master else contextlib.nullcontext():
        run = set_up(cfg, cache, device, backend, log if master else (lambda _: None))
        with precision.matmul_precision(device, cfg.matmul_precision):
            first_step = run.step
            data = endless_batches(run.cache, rows_per_micro_step(cfg, backend), cfg.seed, backend.rank,
                                   backend.world_size, start=first_step * cfg.accumulation_steps)
            dims = _batch_dims(run.cache)
            if run.teacher is not None:  # the cache's targets stay on the host: the teacher makes its own
                data = ({k: batch[k] for k in BASE_KEYS} for batch in data)
                dims = {k: dims[k] for k in BASE_KEYS}
            with dev.device_batches(data, device, backend.input_sharding(dims)) as batches:
                _loop(run, batches, log, rerun)
        # Save: the final artefacts, summary and compile report (master only).
        dev.sync(device)
        backend.rendezvous("end")
        summary = {}
        if master:
            run.metrics.close()
            summary = _finish(run, run.started, first_step, run.compiled_by_step_2, log)
    backend.shutdown()
    return summary


def _batch_dims(cache: KDCache) -> dict[str, int]:
    """{name: dims} of a batch of `cache`'s sequences (one more than a sequence's): what input_sharding lays out."""
    return {k: v.dim() + 1 for k, v in cache.sequence(0).items()}


def _loop(run: Run, batches: Iterator, log: Callable[[str], None], rerun: str = RERUN) -> None:
    """Optimizer steps until --max-steps; metrics, evaluation and checkpoints at their intervals; a stop signal
    ends the process after a checkpoint (SystemExit 128 + signal)."""
    cfg, backend, master = run.cfg, run.backend, run.backend.is_master
    loss_cfg, amp_dtype = cfg.loss_config(), precision.autocast_dtype(run.device, cfg.precision)
    first_step = run.step
    run.metrics = metrics = runs.MetricsLog(run.out / runs.METRICS_FILE, run.step, open_reporters(
        cfg.report_to, run.out, run.step, asdict(cfg))) if master else None
    progress = tqdm(total=cfg.max_steps, initial=first_step, desc="train", unit="step", disable=not master)
    run.started = started = time.perf_counter()
    clock = {"started": started, "last_time": started, "last_step": first_step}
    backend.rendezvous("start")
    # The loop: one optimizer step per iteration; metrics, evaluation and checkpoints at their intervals.
    with runs.StopSignal() as stop, progress:  # the bar is closed before any error line is printed
        while run.step < cfg.max_steps:
            _optimizer_step(run, batches, loss_cfg, amp_dtype)
            run.step += 1
            stopping, stats = _stop_agreed(run, stop, first_step)
            if master and (run.step % cfg.log_steps == 0 or run.step == cfg.max_steps):
                _log_step(run, stats, metrics, progress, clock)
            progress.update(1)
            if run.step == first_step + 2:
                run.compiled_by_step_2 = xla.compile_metrics().get("graphs_compiled", 0)
            if cfg.eval_steps and (run.step % cfg.eval_steps == 0 or run.step == cfg.max_steps):
                _evaluate(run, metrics, amp_dtype)
            if stopping or (cfg.save_steps and run.step % cfg.save_steps == 0 and run.step < cfg.max_steps):
                saved = _save_checkpoint(run)
            if stopping:
                _stop(run, stop.signum, saved, log, rerun)


def _optimizer_step(run: Run, batches: Iterator, loss_cfg: KDLossConfig, amp_dtype) -> None:
    """One optimizer step: micro-steps (forward, loss, backward), gradient mean over ranks, clip, update.

    Leaves `run.stats`, a device vector: the loss parts averaged over micro-steps, the grad norm and the finite
    flag (STAT_KEYS + 1), computed in the step's own graph; nothing is read to the host.
    """
    cfg, totals = run.cfg, {}
    begin_step(cfg.compile)
    with quantized_weights_once_per_step(run.model, enabled=cfg.accumulation_steps > 1) as backward_quantizers:
        for micro in range(cfg.accumulation_steps):
            batch = next(batches)  # already on the device (dev.device_batches)
            with precision.autocast(run.device, amp_dtype):
                parts = forward_loss(run.model, batch, loss_cfg, cfg.loss_chunk_size, teacher=run.teacher)
            (parts["loss"] / cfg.accumulation_steps).backward()
            for key in ("loss", "soft_ce", "kl", "ce"):
                totals[key] = totals.get(key, 0.0) + parts[key].detach() / cfg.accumulation_steps
            if micro == cfg.accumulation_steps - 1:  # the update joins the last micro-step's graph
                backward_quantizers()
                run.backend.reduce_gradients(run.optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(list(run.params.values()), cfg.max_grad_norm)
                run.optimizer.step()
                constrain_quantizers_(run.constrained)  # a scale driven through 0 would be a NaN by the forward's fp16
                run.scheduler.step()
                run.optimizer.zero_grad(set_to_none=False)
                # Part of the step's graph (no extra graph, no host read): read only by _check_finite.
                run.finite = torch.isfinite(totals["loss"]) & torch.isfinite(grad_norm) & run.finite
                # One vector for the one host read of an agreement step (the log reads nothing of its own).
                run.stats = torch.stack([*(totals[k].float() for k in STAT_KEYS[:-1]), grad_norm.float(),
                                         run.finite.float()])
            dev.sync(run.device)


def _stop_agreed(run: Run, stop: runs.StopSignal, first_step: int) -> tuple[bool, torch.Tensor | None]:
    """Whether every rank stops after this step (DESIGN §6). Ranks agree at fixed steps only (every --log-steps,
    every --save-steps, the last, and this process's first, so that the agreement's small XLA graph compiles
    with the first step's, not later), where the host reads the finite flag anyway: one collective and one read
    there, none in the steps between, and a rank that alone got SIGTERM is joined by the others at the same
    step, before any save collective. A single process stops at once at no cost. Returns (stop now, the step's
    statistics on the host, or None between agreement steps).

    Raises:
        RunDiverged: some rank's loss or gradient norm is not finite.
    """
    cfg, alone = run.cfg, run.backend.world_size == 1
    if not (run.step % cfg.log_steps == 0 or run.step in (cfg.max_steps, first_step + 1)
            or (cfg.save_steps and run.step % cfg.save_steps == 0)):
        return alone and stop.signum is not None, None
    stopping, finite, stats = run.backend.agree(stop.signum is not None, run.stats)
    _check_finite(run, finite)
    run.finite_read_at = run.step
    return stopping, stats


def _check_finite(run: Run, finite: bool | None = None) -> None:
    """Stop before anything broken is saved: one host read of the step's finite flag (every rank reads it, so
    all stop together; on XLA the value exists already after the step's graph ran). `finite`: already read.

    Raises:
        RunDiverged: naming the step and the last checkpoint saved before it.
    """
    if finite is None and run.finite_read_at == run.step:
        return  # this step's agreement read it already
    if finite is None:
        finite = bool(dev.to_host([run.finite])[0])  # a transfer of a computed value, not an op
    if not finite:
        found = ckpt.list_checkpoints(run.out)
        last = f"the last good checkpoint is {found[-1]}" if found else "no checkpoint was saved before it"
        raise runs.RunDiverged(f"training diverged: a loss or gradient norm is not finite at or before step "
                               f"{run.step}; {last}; lower --lr or --max-grad-norm, or check the cache with "
                               "`qat-lora cache verify`")


def _log_step(run: Run, stats: torch.Tensor, metrics: runs.MetricsLog, progress, clock: dict) -> None:
    """Write this step's metrics record from `stats`, the host copy the step's agreement read (no read here)."""
    now = time.perf_counter()
    tokens = (run.step - clock["last_step"]) * run.tokens_per_step
    record = {"step": run.step, "lr": run.scheduler.get_last_lr()[0],
              "tokens_per_s": tokens / max(now - clock["last_time"], 1e-9),
              "elapsed_s": now - clock["started"], **dev.memory_stats(run.device)}
    clock.update(last_time=now, last_step=run.step)
    record.update({k: float(v) for k, v in zip(STAT_KEYS, stats.tolist())})
    metrics.write(record)
    progress.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")


def _evaluate(run: Run, metrics: runs.MetricsLog, amp_dtype) -> None:
    """Held-out KD loss and top-1 on the master; a new best is saved to `best/` (by eval loss, not train loss)."""
    _check_finite(run)
    if run.backend.is_master:
        run.model.eval()
        # Training's autocast (the loss it reports is training's) and, in one SPMD process, training's layout:
        # each device evaluates its own --batch-size rows instead of every device the whole batch.
        one_process = run.backend.world_size == 1
        rows = rows_per_micro_step(run.cfg, run.backend) if one_process else run.cfg.batch_size
        sharding = run.backend.input_sharding(_batch_dims(run.cache)) if one_process else None
        result = kd_metrics(run.model, run.cache, rows, run.device, amp_dtype=amp_dtype,
                            chunk_size=run.cfg.loss_chunk_size, sharding=sharding)
        run.model.train()
        result["eval_loss"] = run.cfg.alpha * result["kd_soft_ce"] + (1.0 - run.cfg.alpha) * result["kd_ce"]
        metrics.write({"step": run.step, **result})
        if run.best_eval_loss is None or result["eval_loss"] < run.best_eval_loss:
            run.best_eval_loss = result["eval_loss"]
            tmp = run.out / (runs.BEST_DIR + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            _save_artifacts(run, tmp)
            atomic_write_json(tmp / "eval.json", {"step": run.step, **result})
            shutil.rmtree(run.out / runs.BEST_DIR, ignore_errors=True)
            os.replace(tmp, run.out / runs.BEST_DIR)
    run.backend.rendezvous(f"eval-{run.step}")


def _save_checkpoint(run: Run) -> Path | None:
    """Every rank contributes its RNG state; the master writes `checkpoint-{step}` (returns its path)."""
    _check_finite(run)
    cfg, backend = run.cfg, run.backend
    backend.rendezvous(f"save-{run.step}")
    rng = {f"rank{r}.{name}": state for name, local in ckpt.rng_state(run.device).items()
           for r, state in enumerate(backend.all_gather(local))}
    if not backend.is_master:
        return None
    opt_tensors, opt_meta = ckpt.optimizer_to_flat(run.optimizer)
    consumed = run.step * cfg.accumulation_steps
    per_epoch = batches_per_epoch(run.cache, rows_per_micro_step(cfg, backend), 0, backend.world_size)
    epoch, batch = divmod(consumed, per_epoch)
    state = {"step": run.step, "micro_batches": consumed, "epoch": epoch, "batch_in_epoch_rank0": batch,
             "world_size": backend.world_size * backend.data_parallel, "best_eval_loss": run.best_eval_loss,
             "wall_s": run.wall_s_before + time.perf_counter() - run.started,
             "scheduler": run.scheduler.state_dict(), "optimizer": opt_meta, "config": asdict(cfg),
             "inputs": run.inputs}
    tensors = {ckpt.TRAINABLE_FILE: dict(run.params), ckpt.OPTIMIZER_FILE: opt_tensors, ckpt.RNG_FILE: rng}
    return ckpt.save_checkpoint(run.out, run.step, tensors, state,
                                lambda d: _save_artifacts(run, d), keep=cfg.keep_checkpoints)


def _save_artifacts(run: Run, folder: Path) -> dict[str, str | None]:
    return save_artifacts(run.model, run.cfg.preset, folder, run.moved, run.inputs.get("model"), run.norms)


def _stop(run: Run, signum: int | None, saved: Path | None, log: Callable[[str], None], rerun: str) -> None:
    """End the process after a stop signal, once its checkpoint is saved: exit code 128 + signal number.
    Every rank waits for the master's save, then releases its process group: a rank that exited with gloo's
    threads still running could abort in C++ at interpreter exit (SIGABRT, not 143)."""
    signum = signum or signal.SIGTERM  # another rank received it
    run.backend.rendezvous(f"stopped-{run.step}")
    if run.backend.is_master:
        log(f"stopped by {signal.Signals(signum).name} after step {run.step}; checkpoint {saved}; {rerun}")
    run.backend.shutdown()
    raise SystemExit(128 + signum)


def _model_parameters(model: torch.nn.Module) -> int:
    """The base model's parameter count (no adapter, no quantiser tensors): what MFU's 4N / 6N FLOPs per token
    count (scripts/tpu_check.sh)."""
    extra = {id(p) for p in quantizer_parameters(model)}
    return sum(p.numel() for name, p in model.named_parameters() if "lora_" not in name and id(p) not in extra)


def _finish(run: Run, started: float, first_step: int, compiled_by_step_2: int, log: Callable[[str], None]) -> dict:
    """Final artefacts, summary and (on XLA) the compile report; master only."""
    paths = _save_artifacts(run, run.out)
    steps = run.step - first_step
    wall = time.perf_counter() - started
    summary = {"steps": run.step, "steps_this_process": steps, "tokens": run.step * run.tokens_per_step,
               "wall_s": round(run.wall_s_before + wall, 2), "wall_s_this_process": round(wall, 2),
               "tokens_per_s": round(steps * run.tokens_per_step / max(wall, 1e-9), 1),
               "device": str(run.device), "world_size": run.backend.world_size * run.backend.data_parallel,
               "preset": run.cfg.preset, "model_parameters": _model_parameters(run.model), **paths,
               "best_eval_loss": run.best_eval_loss,
               "best": str(run.out / runs.BEST_DIR) if run.best_eval_loss is not None else None}
    if dev.is_xla(run.device):
        report = xla.compile_metrics()
        report["graphs_compiled_after_step_2"] = report["graphs_compiled"] - compiled_by_step_2
        summary["compile"] = report
        atomic_write_json(run.out / runs.COMPILE_REPORT_FILE, report)
        log(f"compile report ({run.out / runs.COMPILE_REPORT_FILE}): {json.dumps(report)}")
    atomic_write_json(run.out / runs.SUMMARY_FILE, summary)
    log(f"saved {paths['adapter'] or paths['quantizer']} ({summary['tokens_per_s']:,.0f} tok/s)")
    return summary

