"""The trainer: replay the KD cache into a fake-quantised student's LoRA adapters and/or quantiser parameters.

The loop reads top to bottom: build the student, make the preset's parameters trainable, resume if asked,
then for each optimizer step run `accumulation_steps` micro-steps (forward, KD loss, backward), average
gradients over ranks, clip, step, and cut the XLA graph once per micro-step. Metrics are read through step
closures every `log_steps`, never inside the hot loop. Only the master evaluates, logs and writes.

    qat-lora train --model M --cache caches/kd --quant w3g64 --out runs/w3g64 --max-steps 200
    qat-lora train --preset qat+lora ... --save-steps 50 --resume auto     # preemptible: rerun the same line
    python scripts/train_recovery_lora_multi.py --num-chips 2 --device cpu ...   # gloo ranks (torchrun works too)

SIGTERM/SIGINT: the current step finishes, a checkpoint is written, and the process exits with 128 + the
signal number (143, 130): the run is unfinished, and the same command with `--resume auto` continues it.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from . import checkpoint as ckpt, device as dev, models
from .cache import KDCache
from .distributed import Backend, init_backend
from .files import atomic_write_json
from .lora import add_recovery_lora_
from .loss import KDLossConfig, kd_loss, kd_loss_chunked
from .quant import (FakeQuantLinear, get_preset, quant_config_dict, quantize_, quantized_weights_once_per_step,
                    quantizer_parameters)

ADAPTER_DIR = "adapter"
QUANTIZER_FILE = "quantizer.safetensors"
BEST_DIR = "best"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
COMPILE_REPORT_FILE = "compile_report.json"
TENSORBOARD_DIR = "tensorboard"
# What each preset trains: LoRA adapters over the frozen quantised base, the quantiser's own parameters
# (scales, zeros, codebooks, low-rank scale factors; LSQ-style), or both.
TRAIN_PRESETS: dict[str, tuple[str, ...]] = {
    "recovery-lora": ("lora",),
    "qat": ("quantizer",),
    "qat+lora": ("lora", "quantizer"),
}


@dataclass
class TrainConfig:
    model: str = field(default="", metadata={"help": "full-precision model to quantise (folder, .gguf or hub name)"})
    cache: str = field(default="caches/kd", metadata={"help": "KD cache folder from build-cache"})
    quant: str = field(default="w3g64", metadata={"help": "quantisation preset (see `qat-lora presets`)"})
    preset: str = field(default="recovery-lora", metadata={"help": "what trains: recovery-lora, qat (quantiser "
                                                                    "scales/zeros) or qat+lora"})
    out: str = field(default="runs/recovery", metadata={"help": "run folder (adapters, metrics, config)"})
    max_steps: int = field(default=200, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=4, metadata={"help": "sequences per micro-step (per rank)"})
    accumulation_steps: int = field(default=1, metadata={"help": "micro-steps per optimizer step"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (AdamW)"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warm-up steps"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine floor as a fraction of --lr"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (scale = alpha / r)"})
    quantizer: str = field(default="", metadata={"help": "start from a qat run's quantizer.safetensors (QAT, "
                                                          "then recovery LoRA); built with the same --quant"})
    temperature: float = field(default=1.0, metadata={"help": "KD temperature"})
    alpha: float = field(default=1.0, metadata={"help": "weight of the KD term; 1 - alpha on hard-label CE"})
    renormalize_topk: bool = field(default=False, metadata={"help": "baseline only: renormalise teacher and student "
                                                                     "over the K ids, dropping the tail (biased)"})
    save_steps: int = field(default=0, metadata={"help": "checkpoint every N steps (0 = only on SIGTERM/SIGINT)"})
    keep_checkpoints: int = field(default=3, metadata={"help": "keep the newest K checkpoints (0 = all)"})
    resume: str = field(default="", metadata={"help": "auto (newest checkpoint in --out, if any) or a "
                                                      "checkpoint-N folder"})
    eval_steps: int = field(default=0, metadata={"help": "held-out KD eval every N steps and at the end; keeps "
                                                         "best/ (0 = off)"})
    log_steps: int = field(default=10, metadata={"help": "read and write metrics every N steps"})
    tensorboard: bool = field(default=False, metadata={"help": "also write metrics as TensorBoard scalars to "
                                                               "OUT/tensorboard (pip install tensorboard)"})
    seed: int = field(default=0, metadata={"help": "seed for LoRA init and data order"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, xla or tpu"})
    precision: str = field(default="auto", metadata={"help": "auto, fp32 or bf16 (autocast)"})
    loss_chunk_size: int = field(default=128, metadata={"help": "positions per lm_head+loss chunk, each chunk's "
                                                                   "logits freed after its gradient (0 = full logits)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute each decoder layer in backward "
                                                                          "(torch_xla's checkpoint on XLA)"})
    attn_implementation: str = field(default="auto", metadata={"help": "auto (eager on XLA, sdpa elsewhere), eager, sdpa"})
    xla_cache_dir: str = field(default="", metadata={"help": "persistent XLA compile cache folder (XLA devices only)"})
    dist_timeout_s: float = field(default=600.0, metadata={"help": "torch.distributed collective timeout in seconds"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing run in --out"})

    def __post_init__(self) -> None:
        if self.loss_chunk_size < 0:
            raise ValueError(f"--loss-chunk-size {self.loss_chunk_size}: must be >= 0 (0 = full logits)")
        for name in ("max_steps", "batch_size", "accumulation_steps", "log_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be positive")
        for name in ("save_steps", "keep_checkpoints", "eval_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 0 (0 = off)")
        if self.lr <= 0:
            raise ValueError(f"--lr {self.lr}: must be positive")
        if not 0.0 < self.min_lr_ratio <= 1.0:
            # A floor of exactly 0 would also make the last step's lr a special XLA scalar (a recompile).
            raise ValueError(f"--min-lr-ratio {self.min_lr_ratio}: must be in (0, 1]")
        if self.preset not in TRAIN_PRESETS:
            raise ValueError(f"--preset {self.preset!r}: choose one of {', '.join(TRAIN_PRESETS)}")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite exclude each other")
        get_preset(self.quant)
        KDLossConfig(self.temperature, self.alpha, self.renormalize_topk)
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--tensorboard: the tensorboard package is not installed; pip install tensorboard "
                             "(or 'qat-lora[tensorboard]')")
        if self.quantizer and not Path(self.quantizer).is_file():
            raise ValueError(f"--quantizer {self.quantizer}: no such file; pass a qat run's quantizer.safetensors")


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to `min_ratio` at `max_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def resolve_attn(attn_implementation: str, device: torch.device) -> str:
    # sdpa calls .item() and recompiles on XLA (DESIGN §6); eager is the safe choice there.
    if attn_implementation == "auto":
        return "eager" if dev.is_xla(device) else "sdpa"
    return attn_implementation


def build_student(model: str, quant: str, attn_implementation: str = "sdpa", quantizer: str = "") -> torch.nn.Module:
    """Load the full-precision model and fake-quantise it with a preset (initialised as the preset says), then
    optionally load a qat run's `quantizer.safetensors` (its trained scales, zeros, codebooks)."""
    config = get_preset(quant)
    if quantizer:  # every quantiser tensor is overwritten: skip the preset's (possibly slow) init search
        config = replace(config, init="rtn")
    student = quantize_(models.load_causal_lm(model, attn_implementation=attn_implementation), config)
    if quantizer:
        load_quantizer_state_(student, quantizer)
    return student


def make_trainable_(student: torch.nn.Module, preset: str, lora_r: int = 16, lora_alpha: float = 32.0):
    """Freeze everything but what `preset` trains; returns the model to train (a PeftModel with LoRA).

    Raises:
        ValueError: an unknown preset.
    """
    if preset not in TRAIN_PRESETS:
        raise ValueError(f"--preset {preset!r}: choose one of {', '.join(TRAIN_PRESETS)}")
    parts = TRAIN_PRESETS[preset]
    if "lora" in parts:
        model = add_recovery_lora_(student, r=lora_r, alpha=lora_alpha)  # PEFT freezes the base
    else:
        model = student.requires_grad_(False)
    if "quantizer" in parts:
        for p in quantizer_parameters(model):
            p.requires_grad_(True)
    return model


def enable_activation_checkpointing_(model: torch.nn.Module, device: torch.device) -> None:
    """Recompute each decoder layer in backward with the checkpoint that really recomputes on `device`
    (XLA would merge a plain recomputation with the forward; DESIGN §6)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=dev.checkpoint_fn(device))
    base.enable_input_require_grads()  # a reentrant checkpoint passes gradients only to inputs that need them


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Trainable parameters by name, in module order (the optimizer's and the checkpoint's order)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def quantizer_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Quantiser parameters named as in the plain quantised student (`model.layers.0.mlp.up_proj.scale`),
    whether or not `model` is wrapped by PEFT."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, FakeQuantLinear):
            base = name.removeprefix("base_model.model.").replace(".base_layer", "")
            out.update({f"{base}.{key}": p for key, p in module.quant_parameters().items()})
    return out


@torch.no_grad()
def load_quantizer_state_(model: torch.nn.Module, path: str | Path) -> None:
    """Copy a run's `quantizer.safetensors` into a quantised student built with the same --quant."""
    saved, params = load_file(str(path)), quantizer_state_dict(model)
    missing = sorted(set(params) - set(saved))
    if missing:
        raise ValueError(f"{path}: no value for {missing[0]} ({len(missing)} missing); build the student with the "
                         "run's --quant")
    for name, p in params.items():
        p.copy_(saved[name].to(p.device, p.dtype))


def forward_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], cfg: KDLossConfig,
                 chunk_size: int) -> dict[str, torch.Tensor]:
    """Student forward + KD loss. With chunk_size > 0 the decoder runs alone and lm_head + loss run in
    chunks of positions (`kd_loss_chunked`), never holding B x L x V logits."""
    if chunk_size <= 0:
        return kd_loss(model(input_ids=batch["input_ids"]).logits, batch, cfg)
    decoder, head = models.decoder_and_head(model)
    hidden = decoder(input_ids=batch["input_ids"]).last_hidden_state
    weight, bias = models.head_weight_and_bias(head)
    return kd_loss_chunked(hidden, weight, batch, cfg, chunk_size, bias)


def batches_per_epoch(cache: KDCache, batch_size: int, rank: int = 0, world_size: int = 1) -> int:
    """Full batches one rank reads per epoch (its rows are `order[rank::world_size]`)."""
    return len(range(rank, cache.num_sequences("train"), world_size)) // batch_size


def endless_batches(cache: KDCache, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                    start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Epoch after epoch of shuffled fixed-shape training batches (each epoch's last partial batch dropped).

    `start` batches are skipped (resume): the order is a pure function of (seed, epoch, rank, world_size), so
    whole epochs are skipped without reading them, and only the batches before `start` in its epoch are read.
    """
    epoch, skip = divmod(start, batches_per_epoch(cache, batch_size, rank, world_size))
    while True:
        yield from itertools.islice(cache.batches("train", batch_size, seed=seed, epoch=epoch, rank=rank,
                                                  world_size=world_size), skip, None)
        epoch, skip = epoch + 1, 0


def _prepare_out(cfg: TrainConfig, resuming: bool) -> Path:
    """Create the run folder; with --overwrite (or --resume auto and nothing to resume) remove only what a
    previous run wrote there. A resumed run keeps everything."""
    out = Path(cfg.out)
    if (out / CONFIG_FILE).exists() and not resuming:
        if not (cfg.overwrite or cfg.resume == "auto"):
            raise ValueError(f"--out {out}: a run already exists there; pass --overwrite, --resume auto, or choose "
                             "another folder")
        names = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, COMPILE_REPORT_FILE, ADAPTER_DIR, QUANTIZER_FILE, BEST_DIR,
                 TENSORBOARD_DIR)
        for path in [out / name for name in names] + list(out.glob(ckpt.PREFIX + "*")) + \
                list(out.glob(f".{ckpt.PREFIX}*")):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


def save_adapter(model, path: Path) -> None:
    """Write the LoRA adapters as standard PEFT files, atomically (temp folder, then rename)."""
    from peft import get_peft_model_state_dict

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    state = dev.state_dict_to_cpu(get_peft_model_state_dict(model))
    model.save_pretrained(str(tmp), state_dict=state)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def save_artifacts(model, preset: str, folder: Path) -> dict[str, str | None]:
    """What the preset trained, in standard files: `adapter/` (PEFT) and/or `quantizer.safetensors`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str | None] = {"adapter": None, "quantizer": None}
    if "lora" in TRAIN_PRESETS[preset]:
        save_adapter(model, folder / ADAPTER_DIR)
        paths["adapter"] = str(folder / ADAPTER_DIR)
    if "quantizer" in TRAIN_PRESETS[preset]:
        tmp = folder / (QUANTIZER_FILE + ".tmp")
        save_file({k: v.detach().cpu().contiguous() for k, v in quantizer_state_dict(model).items()}, str(tmp))
        os.replace(tmp, folder / QUANTIZER_FILE)
        paths["quantizer"] = str(folder / QUANTIZER_FILE)
    return paths


@dataclass
class _Run:
    cfg: TrainConfig
    model: torch.nn.Module
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    cache: KDCache
    tokens_per_step: int
    out: Path
    backend: Backend
    device: torch.device
    step: int = 0  # optimizer steps done
    best_eval_loss: float | None = None
    wall_s_before: float = 0.0  # training time of the processes before a resume
    started: float = 0.0  # perf_counter when this process's loop began


def _batch(cfg: TrainConfig, backend: Backend) -> int:
    """Sequences one process reads per micro-step: --batch-size per device it drives."""
    return cfg.batch_size * backend.data_parallel


def _load_student(cfg: TrainConfig, device: torch.device, backend: Backend, cache: KDCache) -> torch.nn.Module:
    """Rank 0 loads (and converts or downloads) the model first; the others wait, then read its files."""
    if not backend.is_master:
        backend.rendezvous("master-loaded")
    tokenizer = models.load_tokenizer(cfg.model)
    student = build_student(cfg.model, cfg.quant, resolve_attn(cfg.attn_implementation, device), cfg.quantizer)
    if backend.is_master:
        backend.rendezvous("master-loaded")
    cache.check_compatible(tokenizer, models.vocab_size(student), models.max_positions(student))
    return student


def _set_up(cfg: TrainConfig, device: torch.device, backend: Backend, log: Callable[[str], None]) -> _Run:
    """Student, trainable parameters, data and optimizer; every input is checked before the run folder is touched."""
    cache = KDCache(cfg.cache)
    student = _load_student(cfg, device, backend, cache)
    per_epoch = batches_per_epoch(cache, _batch(cfg, backend), backend.world_size - 1, backend.world_size)
    if per_epoch == 0:
        raise ValueError(f"--cache {cfg.cache}: {cache.num_sequences('train')} training sequences, fewer than "
                         f"--batch-size {cfg.batch_size} per device; build a larger cache or lower the batch size")
    if cfg.eval_steps and cache.num_sequences("heldout") == 0:
        raise ValueError(f"--eval-steps {cfg.eval_steps}: the cache's held-out split is empty; rebuild it with "
                         "--holdout-fraction > 0 or pass --eval-steps 0")
    resume_from = ckpt.find_resume_point(Path(cfg.out), cfg.resume)
    if backend.is_master:
        _prepare_out(cfg, resuming=resume_from is not None)
    backend.rendezvous("out-ready")
    dev.seed_everything(cfg.seed)  # same seed on every rank: identical initial adapters everywhere
    model = make_trainable_(student, cfg.preset, cfg.lora_r, cfg.lora_alpha).to(device)
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing_(model, device)
    model.train()
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(list(params.values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio))
    tokens_per_step = _batch(cfg, backend) * cfg.accumulation_steps * cache.seq_len * backend.world_size
    run = _Run(cfg, model, params, optimizer, scheduler, cache, tokens_per_step, Path(cfg.out), backend, device)
    if resume_from is not None:
        _restore(run, resume_from)
        log(f"resumed from {resume_from} at step {run.step}")
    else:
        if cfg.resume == "auto":
            log(f"--resume auto: no checkpoint in {cfg.out}; starting at step 0")
        if backend.is_master:
            atomic_write_json(run.out / CONFIG_FILE, {
                **asdict(cfg), "quant_config": quant_config_dict(get_preset(cfg.quant)),
                "trainable_parameters": sum(p.numel() for p in params.values()),
                "world_size": backend.world_size * backend.data_parallel})
    log(f"student {cfg.model} [{cfg.quant}, {cfg.preset}] on {device} ({backend.describe()}): "
        f"{sum(p.numel() for p in params.values()):,} trainable parameters, {cache.num_sequences('train')} "
        f"training sequences of {cache.seq_len}, {tokens_per_step:,} tokens per step")
    return run


def _save_checkpoint(run: _Run) -> Path | None:
    """Every rank contributes its RNG state; the master writes `checkpoint-{step}` (returns its path)."""
    cfg, backend = run.cfg, run.backend
    backend.rendezvous(f"save-{run.step}")
    rng = {f"rank{r}.{name}": state for name, local in ckpt.rng_state(run.device).items()
           for r, state in enumerate(backend.all_gather(local))}
    if not backend.is_master:
        return None
    opt_tensors, opt_meta = ckpt.optimizer_to_flat(run.optimizer)
    consumed = run.step * cfg.accumulation_steps
    epoch, batch = divmod(consumed, batches_per_epoch(run.cache, _batch(cfg, backend), 0, backend.world_size))
    state = {"step": run.step, "micro_batches": consumed, "epoch": epoch, "batch_in_epoch_rank0": batch,
             "world_size": backend.world_size * backend.data_parallel, "best_eval_loss": run.best_eval_loss,
             "wall_s": run.wall_s_before + time.perf_counter() - run.started,
             "scheduler": run.scheduler.state_dict(), "optimizer": opt_meta, "config": asdict(cfg)}
    tensors = {ckpt.TRAINABLE_FILE: dict(run.params), ckpt.OPTIMIZER_FILE: opt_tensors, ckpt.RNG_FILE: rng}
    return ckpt.save_checkpoint(run.out, run.step, tensors, state, lambda d: save_artifacts(run.model, cfg.preset, d),
                                keep=cfg.keep_checkpoints)


@torch.no_grad()
def _restore(run: _Run, path: Path) -> None:
    """Load parameters, optimizer, scheduler, this rank's RNG and the step from a checkpoint (DESIGN §6)."""
    tensors, state = ckpt.load_checkpoint(path)
    ckpt.check_resumable(state["config"], asdict(run.cfg), path)
    chips = run.backend.world_size * run.backend.data_parallel
    if state["world_size"] != chips:
        raise ValueError(f"--resume: {path.name} was written on {state['world_size']} chips, this run has {chips}; "
                         f"the data position depends on it: resume with --num-chips {state['world_size']}")
    saved = tensors[ckpt.TRAINABLE_FILE]
    for name, p in run.params.items():
        p.copy_(saved[name].to(p.device, p.dtype))
    run.optimizer.load_state_dict(ckpt.optimizer_from_flat(tensors[ckpt.OPTIMIZER_FILE], state["optimizer"]))
    run.scheduler.load_state_dict(state["scheduler"])
    prefix = f"rank{run.backend.rank}."
    ckpt.set_rng_state({k[len(prefix):]: v for k, v in tensors[ckpt.RNG_FILE].items() if k.startswith(prefix)},
                       run.device)
    run.step, run.best_eval_loss = state["step"], state["best_eval_loss"]
    run.wall_s_before = state.get("wall_s", 0.0)


def _evaluate(run: _Run, metrics: ckpt.MetricsLog) -> None:
    """Held-out KD loss and top-1 on the master; a new best is saved to `best/` (by eval loss, not train loss)."""
    from .evaluate import kd_metrics  # evaluate imports this module

    if run.backend.is_master:
        run.model.eval()
        result = kd_metrics(run.model, run.cache, run.cfg.batch_size, run.device)
        run.model.train()
        result["eval_loss"] = run.cfg.alpha * result["kd_soft_ce"] + (1.0 - run.cfg.alpha) * result["kd_ce"]
        metrics.write({"step": run.step, **result})
        if run.best_eval_loss is None or result["eval_loss"] < run.best_eval_loss:
            run.best_eval_loss = result["eval_loss"]
            tmp = run.out / (BEST_DIR + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            save_artifacts(run.model, run.cfg.preset, tmp)
            atomic_write_json(tmp / "eval.json", {"step": run.step, **result})
            shutil.rmtree(run.out / BEST_DIR, ignore_errors=True)
            os.replace(tmp, run.out / BEST_DIR)
    run.backend.rendezvous(f"eval-{run.step}")


def _optimizer_step(run: _Run, batches: Iterator, loss_cfg: KDLossConfig, amp_dtype) -> tuple[dict, torch.Tensor]:
    """One optimizer step: micro-steps (forward, loss, backward), gradient mean over ranks, clip, update.

    Returns device tensors (loss parts averaged over micro-steps, grad norm); nothing is read to the host.
    """
    cfg, totals = run.cfg, {}
    with quantized_weights_once_per_step(run.model, enabled=cfg.accumulation_steps > 1) as backward_quantizers:
        for micro in range(cfg.accumulation_steps):
            batch = run.backend.shard_batch({k: v.to(run.device) for k, v in next(batches).items()})
            with dev.autocast(run.device, amp_dtype):
                parts = forward_loss(run.model, batch, loss_cfg, cfg.loss_chunk_size)
            (parts["loss"] / cfg.accumulation_steps).backward()
            for key in ("loss", "soft_ce", "kl", "ce"):
                totals[key] = totals.get(key, 0.0) + parts[key].detach() / cfg.accumulation_steps
            if micro == cfg.accumulation_steps - 1:  # the update joins the last micro-step's graph
                backward_quantizers()
                run.backend.reduce_gradients(run.optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(list(run.params.values()), cfg.max_grad_norm)
                run.optimizer.step()
                run.scheduler.step()
                run.optimizer.zero_grad(set_to_none=False)
            dev.sync(run.device)
    return totals, grad_norm


def _finish(run: _Run, started: float, first_step: int, compiled_by_step_2: int, log: Callable[[str], None]) -> dict:
    """Final artefacts, summary and (on XLA) the compile report; master only."""
    paths = save_artifacts(run.model, run.cfg.preset, run.out)
    steps = run.step - first_step
    wall = time.perf_counter() - started
    summary = {"steps": run.step, "steps_this_process": steps, "tokens": run.step * run.tokens_per_step,
               "wall_s": round(run.wall_s_before + wall, 2), "wall_s_this_process": round(wall, 2),
               "tokens_per_s": round(steps * run.tokens_per_step / max(wall, 1e-9), 1),
               "device": str(run.device), "world_size": run.backend.world_size * run.backend.data_parallel,
               "preset": run.cfg.preset, **paths, "best_eval_loss": run.best_eval_loss,
               "best": str(run.out / BEST_DIR) if run.best_eval_loss is not None else None}
    if dev.is_xla(run.device):
        report = dev.compile_metrics()
        report["graphs_compiled_after_step_2"] = report["graphs_compiled"] - compiled_by_step_2
        summary["compile"] = report
        atomic_write_json(run.out / COMPILE_REPORT_FILE, report)
        log(f"compile report ({run.out / COMPILE_REPORT_FILE}): {json.dumps(report)}")
    atomic_write_json(run.out / SUMMARY_FILE, summary)
    log(f"saved {paths['adapter'] or paths['quantizer']} ({summary['tokens_per_s']:,.0f} tok/s)")
    return summary


def _log_step(run: _Run, totals: dict, grad_norm: torch.Tensor, metrics: ckpt.MetricsLog, progress,
              clock: dict) -> None:
    """Queue this step's metrics record; its tensors are read in a step closure (after the graph ran on XLA)."""
    now = time.perf_counter()
    tokens = (run.step - clock["last_step"]) * run.tokens_per_step
    record = {"step": run.step, "lr": run.scheduler.get_last_lr()[0],
              "tokens_per_s": tokens / max(now - clock["last_time"], 1e-9),
              "elapsed_s": now - clock["started"], **dev.memory_stats(run.device)}
    clock.update(last_time=now, last_step=run.step)

    def write_metrics():
        record.update({k: float(v) for k, v in totals.items()}, grad_norm=float(grad_norm))
        metrics.write(record)
        progress.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")

    dev.add_step_closure(run.device, write_metrics)


def train(cfg: TrainConfig, log: Callable[[str], None] = print, backend: Backend | None = None) -> dict:
    """Train what `cfg.preset` names; returns the run summary (also written to `out/summary.json`).

    Raises:
        SystemExit: 128 + signal number after SIGTERM/SIGINT, once a checkpoint is saved.
    """
    finished = Path(cfg.out) / SUMMARY_FILE
    if cfg.resume == "auto" and finished.exists() and json.loads(finished.read_text())["steps"] >= cfg.max_steps:
        saved = json.loads((Path(cfg.out) / CONFIG_FILE).read_text())
        ckpt.check_resumable({k: saved.get(k) for k in asdict(cfg)}, asdict(cfg), Path(cfg.out))
        log(f"{cfg.out} already holds a finished run of {cfg.max_steps} steps; nothing to resume")
        return json.loads(finished.read_text())  # a preemption loop may rerun the command once more
    device = dev.resolve_device(cfg.device)
    if device.type == "cpu":
        dev.tune_host_allocator()
    backend = backend or init_backend(device, cfg.dist_timeout_s)
    if device.type == "cuda" and backend.world_size > 1:
        device = torch.device("cuda", backend.local_rank)
        torch.cuda.set_device(device)
    if cfg.xla_cache_dir and dev.is_xla(device):
        dev.init_xla_cache(cfg.xla_cache_dir, backend.rank)
    master = backend.is_master
    run = _set_up(cfg, device, backend, log if master else (lambda _: None))
    loss_cfg = KDLossConfig(cfg.temperature, cfg.alpha, cfg.renormalize_topk)
    amp_dtype = dev.autocast_dtype(device, cfg.precision)
    first_step = run.step
    batches = endless_batches(run.cache, _batch(cfg, backend), cfg.seed, backend.rank, backend.world_size,
                              start=first_step * cfg.accumulation_steps)
    metrics = ckpt.MetricsLog(run.out / METRICS_FILE, run.step,
                              run.out / TENSORBOARD_DIR if cfg.tensorboard else None) if master else None
    progress = tqdm(total=cfg.max_steps, initial=first_step, desc="train", unit="step", disable=not master)
    started, compiled_by_step_2 = time.perf_counter(), 0
    run.started = started
    clock = {"started": started, "last_time": started, "last_step": first_step}
    backend.rendezvous("start")
    with ckpt.StopSignal() as stop:
        while run.step < cfg.max_steps:
            totals, grad_norm = _optimizer_step(run, batches, loss_cfg, amp_dtype)
            run.step += 1
            if master and (run.step % cfg.log_steps == 0 or run.step == cfg.max_steps):
                _log_step(run, totals, grad_norm, metrics, progress, clock)
            progress.update(1)
            if run.step == first_step + 2:
                compiled_by_step_2 = dev.compile_metrics().get("graphs_compiled", 0)
            if cfg.eval_steps and (run.step % cfg.eval_steps == 0 or run.step == cfg.max_steps):
                _evaluate(run, metrics)
            stopping = backend.any(stop.signum is not None)
            if stopping or (cfg.save_steps and run.step % cfg.save_steps == 0 and run.step < cfg.max_steps):
                saved = _save_checkpoint(run)
            if stopping:
                signum = stop.signum or signal.SIGTERM
                if master:
                    log(f"stopped by {signal.Signals(signum).name} after step {run.step}; checkpoint {saved}; "
                        "rerun with --resume auto to continue")
                raise SystemExit(128 + signum)
    dev.sync(device)
    progress.close()
    backend.rendezvous("end")
    summary = {}
    if master:
        metrics.close()
        summary = _finish(run, started, first_step, compiled_by_step_2, log)
    backend.shutdown()
    return summary
