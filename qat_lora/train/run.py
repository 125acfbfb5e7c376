"""A training run's set-up and its state: every input checked before the run folder is touched (the cache for
these flags, --out and a run already there, the inputs of a checkpoint to resume), the student and an
--online-teacher loaded, what the preset trains, the optimizer and schedule, and a checkpoint restored; `Run`
carries it all through the loop (trainer.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from qat_lora.train import checkpoint as ckpt

from qat_lora.runtime import device as dev
from qat_lora.runtime import precision

from qat_lora.data import identities, models

from qat_lora.runtime import runs
from qat_lora.cache.reader import KDCache, batches_per_epoch
from qat_lora.train.config import TrainConfig
from qat_lora.runtime.options import field_defaults
from qat_lora.runtime.distributed import Backend
from qat_lora.runtime.files import (atomic_write_json, check_out_apart_from_inputs, owner_stamp, read_record,
                                    require_folder)
from qat_lora.train.lora import lora_start_
from qat_lora.train.optim import build_optimizer, lr_factor
from qat_lora.quant.blocks import layer_progress
from qat_lora.quant.fake_quant import get_preset, quant_config_dict, trained_quantised_layers
from qat_lora.quant.state import has_codes, has_norms
from qat_lora.train.student import (build_student, compile_decoder_layers_, enable_activation_checkpointing_,
                                    make_trainable_, resolve_attn, resolve_storage_dtype, set_storage_dtype_,
                                    trainable_parameters)


@dataclass
class Run:
    """What the loop carries from step to step: the set-up's objects, the step and the run's clocks and records."""

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
    moved: bool = False  # the student's weights started off the base model's (a --quantizer with codes)
    norms: bool = False  # its norms train or started trained (a --quantizer with norms): saved with the quantiser
    constrained: list = dataclasses.field(default_factory=list)  # trained quantised layers, constrained each step
    inputs: dict = dataclasses.field(default_factory=dict)  # run_inputs(cfg): recorded, compared on resume
    finite: torch.Tensor | None = None  # device bool: every loss and gradient norm so far was finite
    finite_read_at: int = -1  # the step whose finite flag the host read last (an agreement's read)
    stats: torch.Tensor | None = None  # device vector of the last step: STAT_KEYS, then the finite flag
    metrics: runs.MetricsLog | None = None  # the master's metrics log
    compiled_by_step_2: int = 0  # XLA graphs compiled by this process's second step
    teacher: torch.nn.Module | None = None  # --online-teacher, frozen on the device


def rows_per_micro_step(cfg: TrainConfig, backend: Backend) -> int:
    """Sequences one process reads per micro-step: --batch-size per device it drives."""
    return cfg.batch_size * backend.data_parallel


def _load_models(cfg: TrainConfig, device: torch.device, backend: Backend,
                 cache: KDCache) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The student and the --online-teacher (None without one). Rank 0 loads (and converts or downloads) the
    models first; the others wait, then read their files."""
    if not backend.is_master:
        backend.rendezvous("master-loaded")
    tokenizer = models.load_tokenizer(cfg.model)
    attn = resolve_attn(cfg.attn_implementation, device)
    student = build_student(cfg.student_spec(), attn)
    teacher = models.load_causal_lm(cfg.online_teacher, dtype=torch.bfloat16 if cfg.online_teacher_dtype == "bf16"
                                    else torch.float32, attn_implementation=attn) if cfg.online_teacher else None
    if backend.is_master:
        backend.rendezvous("master-loaded")
    cache.check_compatible(tokenizer, models.vocab_size(student), models.max_positions(student))
    if teacher is not None:
        if models.vocab_size(teacher) != models.vocab_size(student):
            raise ValueError(f"--online-teacher {cfg.online_teacher}: {models.vocab_size(teacher)} logits, the student "
                             f"has {models.vocab_size(student)}; pass a teacher with the student's vocabulary")
        shape = lambda m: (m.config.get_text_config().num_hidden_layers, m.config.get_text_config().hidden_size)  # noqa: E731
        if cfg.hidden_weight > 0 and shape(teacher) != shape(student):
            raise ValueError(f"--hidden-weight {cfg.hidden_weight}: --online-teacher {cfg.online_teacher} has "
                             f"(layers, width) {shape(teacher)}, the student {shape(student)}; feature distillation "
                             "needs the student's own shape (its full-precision model): drop --hidden-weight")
        teacher = dev.move_model_(teacher.requires_grad_(False).eval(), device)
    return student, teacher


def run_inputs(cfg: TrainConfig) -> dict[str, str | None]:
    """The run's inputs as identities.input_identities sees them; a resume on changed ones is refused."""
    inputs = identities.input_identities(cfg.model, cfg.cache, cfg.quantizer)
    if cfg.online_teacher:  # the targets come from its weights: another teacher is another training
        inputs["teacher"] = identities.weights_signature(cfg.online_teacher)
    return inputs


def check_out(cfg: TrainConfig) -> None:
    """--out must be a folder apart from every input: checked before the run's lock creates it."""
    require_folder(cfg.out, "the run")
    check_out_apart_from_inputs(cfg.out, {"--model": cfg.model, "--cache": cfg.cache, "--quantizer": cfg.quantizer,
                                          "--online-teacher": cfg.online_teacher})


def _as_trained(config: dict, device: torch.device) -> dict:
    """A run's config with --storage-dtype as it resolves on `device` (auto: bf16 or fp32): a run written with
    fp32 (the default before auto) and one asking auto that resolves to fp32 train the same values."""
    amp = precision.autocast_dtype(device, config["precision"])
    return {**config, "storage_dtype": resolve_storage_dtype(config["storage_dtype"], config["preset"], amp)}


def _check_run_dir(cfg: TrainConfig, inputs: dict, device: torch.device, log: Callable[[str], None]) -> Path | None:
    """The checkpoint to resume from, after refusing an --out whose run this one must not replace: run files
    that no run wrote, a run without --overwrite, (--resume auto) a run made with other settings, which would
    be wiped, or a checkpoint trained on other inputs.

    Raises:
        ValueError: one line naming --out, the first differing flag or input and the fix.
    """
    out = Path(cfg.out)
    runs.check_run_folder(out)
    resume_from = ckpt.find_resume_point(out, cfg.resume, log)
    saved = runs.read_config(out)
    if resume_from is not None:
        state = read_record(resume_from / ckpt.STATE_FILE) or {}  # an unreadable one: load_checkpoint says so
        ckpt.check_same_inputs(state.get("inputs"), inputs, resume_from, state.get("config") or asdict(cfg))
    elif saved is not None and not cfg.overwrite:
        if cfg.resume != "auto":
            raise ValueError(f"--out {out}: a run already exists there; pass --overwrite, --resume auto, or choose "
                             "another folder")
        saved = {**field_defaults(TrainConfig), **saved}
        ckpt.check_resumable(_as_trained({k: saved[k] for k in asdict(cfg)}, device), _as_trained(asdict(cfg), device),
                             out / runs.CONFIG_FILE)
    return resume_from


def _check_cache(cfg: TrainConfig, cache: KDCache, backend: Backend) -> None:
    """What the cache (and an --online-teacher's tokenizer) must hold for these flags, before any model loads:
    every rank checks, so all fail together."""
    if cfg.online_teacher and identities.tokenizer_hash(models.load_tokenizer(cfg.online_teacher)) != \
            cache.manifest["tokenizer_sha256"]:  # the student's is compared with the cache's once it loads
        raise ValueError(f"--online-teacher {cfg.online_teacher}: its tokenizer differs from --model's (and the "
                         "cache's), so its logits index another vocabulary; pass a teacher with the same tokenizer")
    if batches_per_epoch(cache, rows_per_micro_step(cfg, backend), backend.world_size - 1, backend.world_size) == 0:
        raise ValueError(f"--cache {cfg.cache}: {cache.num_sequences('train')} training sequences, fewer than "
                         f"--batch-size {cfg.batch_size} per device; build a larger cache or lower the batch size")
    if cfg.eval_steps and cache.num_sequences("heldout") == 0:
        raise ValueError(f"--eval-steps {cfg.eval_steps}: the cache's held-out split is empty; rebuild it with "
                         "--holdout-fraction > 0 or pass --eval-steps 0")


def _lora_start_(cfg: TrainConfig, model: torch.nn.Module, device: torch.device, backend: Backend,
                 log: Callable[[str], None]) -> None:
    """The adapters' start (--lora-init), the same on every rank: the calibrated start is computed once, on the
    master, one decoder layer at a time on the device (not on every rank's host), then every rank takes the
    master's A and B; a folder's adapters are read by each rank (a copy)."""
    calibrated = cfg.lora_init == "calibrated"
    if calibrated and backend.is_master:
        log(f"calibrated LoRA start: each adapter := the best rank-{cfg.lora_r} correction of its layer's "
            f"quantisation error on {cfg.lora_init_sequences} cached sequences, one decoder layer at a time")
    if backend.is_master or not calibrated:
        with layer_progress(model, "calibrated LoRA start", disable=not (calibrated and backend.is_master)) as above:
            lora_start_(model, cfg.lora_init, cfg.model, cfg.cache, cfg.lora_init_sequences, cfg.batch_size,
                        above(log) if backend.is_master else lambda _: None, device=device)
    if calibrated and backend.world_size > 1:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(backend.all_gather(p.detach())[0])  # rank 0's


def set_up(cfg: TrainConfig, cache: KDCache, device: torch.device, backend: Backend,
            log: Callable[[str], None]) -> Run:
    """Student, trainable parameters, data and optimizer; every input is checked before the run folder is touched."""
    _check_cache(cfg, cache, backend)
    inputs = run_inputs(cfg)
    resume_from = _check_run_dir(cfg, inputs, device, log)
    student, teacher = _load_models(cfg, device, backend, cache)
    if backend.is_master:
        runs.prepare_run_dir(cfg.out, overwrite=cfg.overwrite, resume_auto=cfg.resume == "auto",
                             resuming=resume_from is not None)
    backend.rendezvous("out-ready")
    dev.seed_everything(cfg.seed)  # same seed on every rank: identical initial adapters everywhere
    model = make_trainable_(student, cfg.preset, cfg.lora_r, cfg.lora_alpha, cfg.train_norms)
    if resume_from is None:  # a resumed run loads its adapters instead
        _lora_start_(cfg, model, device, backend, log)
    storage = resolve_storage_dtype(cfg.storage_dtype, cfg.preset, precision.autocast_dtype(device, cfg.precision))
    model = backend.shard_model_(set_storage_dtype_(model, storage), device)  # fsdp: split as it moves
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing_(model, device)
    compiled = compile_decoder_layers_(model, cfg.compile, device, storage, cfg.gradient_checkpointing)
    model.train()
    params = trainable_parameters(model)
    optimizer = build_optimizer(cfg, model, params)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio))
    tokens_per_step = rows_per_micro_step(cfg, backend) * cfg.accumulation_steps * cache.seq_len * backend.world_size
    run = Run(cfg, model, params, optimizer, scheduler, cache, tokens_per_step, Path(cfg.out), backend, device,
               moved=has_codes(cfg.quantizer), norms=cfg.train_norms or has_norms(cfg.quantizer),
               constrained=trained_quantised_layers(model),
               finite=torch.ones((), dtype=torch.bool, device=device), inputs=inputs,
               teacher=teacher)
    if resume_from is not None:
        _restore(run, resume_from)
        log(f"resumed from {resume_from} at step {run.step}")
    else:
        if cfg.resume == "auto":
            log(f"--resume auto: no checkpoint in {cfg.out}; starting at step 0")
        if backend.is_master:
            atomic_write_json(run.out / runs.CONFIG_FILE, {
                **owner_stamp(runs.RUN_KIND), **asdict(cfg), "inputs": inputs,
                "quant_config": quant_config_dict(get_preset(cfg.quant)),
                "trainable_parameters": sum(p.numel() for p in params.values()),
                "world_size": backend.world_size * backend.data_parallel})
    log(f"student {cfg.model} [{cfg.quant}, {cfg.preset}] on {device} ({backend.describe()}): "
        f"{sum(p.numel() for p in params.values()):,} trainable parameters, {cache.num_sequences('train')} "
        f"training sequences of {cache.seq_len}, {tokens_per_step:,} tokens per step; frozen weights in {storage}"
        + (f"; {compiled} decoder layers compiled" if compiled else "")
        + (f"; targets from --online-teacher {cfg.online_teacher}" if teacher is not None else ""))
    return run


@torch.no_grad()
def _restore(run: Run, path: Path) -> None:
    """Load parameters, optimizer, scheduler, this rank's RNG and the step from a checkpoint (DESIGN §6)."""
    tensors, state = ckpt.load_checkpoint(path, resume=True)
    ckpt.check_resumable(_as_trained({**field_defaults(TrainConfig), **state["config"]}, run.device),
                         _as_trained(asdict(run.cfg), run.device), path)
    chips = run.backend.world_size * run.backend.data_parallel
    if state["world_size"] != chips:
        raise ValueError(f"--resume: {path.name} was written on {state['world_size']} chips, this run has {chips}; "
                         f"the data position depends on it: resume with --num-chips {state['world_size']}")
    saved = tensors[ckpt.TRAINABLE_FILE]
    for name, p in run.params.items():
        p.copy_(saved[name].to(p.device, p.dtype))
    groups = len(state["optimizer"]["param_groups"])
    if groups != len(run.optimizer.param_groups):  # torch would say only "different number of parameter groups"
        raise ValueError(f"--resume: {path.name} holds {groups} optimizer group(s), this run has "
                         f"{len(run.optimizer.param_groups)} (a --preset {run.cfg.preset} run written before its "
                         "quantiser had its own learning rate); finish it with the qat-lora version that wrote it, "
                         "or pass --overwrite to start again")
    run.optimizer.load_state_dict(ckpt.optimizer_from_flat(tensors[ckpt.OPTIMIZER_FILE], state["optimizer"]))
    run.scheduler.load_state_dict(state["scheduler"])
    prefix = f"rank{run.backend.rank}."
    ckpt.set_rng_state({k[len(prefix):]: v for k, v in tensors[ckpt.RNG_FILE].items() if k.startswith(prefix)},
                       run.device)
    run.step, run.best_eval_loss = state["step"], state["best_eval_loss"]
    run.wall_s_before = state.get("wall_s", 0.0)


def finished_run(cfg: TrainConfig, device: torch.device, log: Callable[[str], None]) -> dict | None:
    """With --resume auto, the summary of a run in --out that already reached --max-steps with this config and
    these inputs (a preemption loop may rerun the command once more); None otherwise."""
    summary = runs.read_summary(cfg.out) if cfg.resume == "auto" else None
    if summary is None or summary["steps"] < cfg.max_steps:
        return None
    runs.check_run_folder(cfg.out)
    saved = runs.read_config(cfg.out) or {}
    ckpt.check_same_inputs(saved.get("inputs"), run_inputs(cfg), Path(cfg.out), saved)
    saved = {**field_defaults(TrainConfig), **saved}  # a field added since the run was saved: its default
    ckpt.check_resumable(_as_trained({k: saved.get(k) for k in asdict(cfg)}, device), _as_trained(asdict(cfg), device),
                         Path(cfg.out))
    log(f"{cfg.out} already holds a finished run of {cfg.max_steps} steps; nothing to resume")
    return summary

