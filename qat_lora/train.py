"""The trainer: replay the KD cache into recovery LoRA adapters over a fake-quantised student.

The loop reads top to bottom: build the student, wrap it with LoRA, then for each optimizer step run
`accumulation_steps` micro-steps (forward, KD loss, backward), clip, step, and cut the XLA graph once per
micro-step. Metrics are read through step closures every `log_steps`, never inside the hot loop.

    qat-lora train --model M --cache caches/kd --quant w3g64 --out runs/w3g64 --max-steps 200
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from . import device as dev, models
from .files import atomic_write_json
from .cache import KDCache
from .lora import add_recovery_lora_
from .loss import KDLossConfig, kd_loss, kd_loss_chunked
from .quant import get_preset, quant_config_dict, quantize_

ADAPTER_DIR = "adapter"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"


@dataclass
class TrainConfig:
    model: str = field(default="", metadata={"help": "full-precision model to quantise (folder, .gguf or hub name)"})
    cache: str = field(default="caches/kd", metadata={"help": "KD cache folder from build-cache"})
    quant: str = field(default="w3g64", metadata={"help": "quantisation preset (see `qat-lora presets`)"})
    out: str = field(default="runs/recovery", metadata={"help": "run folder (adapters, metrics, config)"})
    max_steps: int = field(default=200, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=4, metadata={"help": "sequences per micro-step"})
    accumulation_steps: int = field(default=1, metadata={"help": "micro-steps per optimizer step"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (AdamW)"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warm-up steps"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine floor as a fraction of --lr"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (scale = alpha / r)"})
    temperature: float = field(default=1.0, metadata={"help": "KD temperature"})
    alpha: float = field(default=1.0, metadata={"help": "weight of the KD term; 1 - alpha on hard-label CE"})
    save_steps: int = field(default=0, metadata={"help": "checkpoint every N steps (0 = only at the end)"})
    log_steps: int = field(default=10, metadata={"help": "read and write metrics every N steps"})
    seed: int = field(default=0, metadata={"help": "seed for LoRA init and data order"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, xla or tpu"})
    precision: str = field(default="auto", metadata={"help": "auto, fp32 or bf16 (autocast)"})
    loss_chunk_size: int = field(default=128, metadata={"help": "positions per lm_head+loss chunk, recomputed in backward (0 = full logits)"})
    attn_implementation: str = field(default="auto", metadata={"help": "auto (eager on XLA, sdpa elsewhere), eager, sdpa"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing run in --out"})

    def __post_init__(self) -> None:
        if self.loss_chunk_size < 0:
            raise ValueError(f"--loss-chunk-size {self.loss_chunk_size}: must be >= 0 (0 = full logits)")
        for name in ("max_steps", "batch_size", "accumulation_steps", "log_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be positive")
        if self.lr <= 0:
            raise ValueError(f"--lr {self.lr}: must be positive")
        if not 0.0 < self.min_lr_ratio <= 1.0:
            # A floor of exactly 0 would also make the last step's lr a special XLA scalar (a recompile).
            raise ValueError(f"--min-lr-ratio {self.min_lr_ratio}: must be in (0, 1]")
        get_preset(self.quant)
        KDLossConfig(self.temperature, self.alpha)


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


def build_student(model: str, quant: str, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """Load the full-precision model and fake-quantise it with a preset (round-to-nearest init)."""
    student = models.load_causal_lm(model, attn_implementation=attn_implementation)
    return quantize_(student, get_preset(quant))


def forward_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], cfg: KDLossConfig, chunk_size: int,
                 checkpoint: Callable | None = None) -> dict[str, torch.Tensor]:
    """Student forward + KD loss. With chunk_size > 0 the decoder runs alone and lm_head + loss run in
    chunks of positions (recomputed in backward when `checkpoint` is given), never holding B x L x V logits."""
    if chunk_size <= 0:
        return kd_loss(model(input_ids=batch["input_ids"]).logits, batch, cfg)
    decoder, head = models.decoder_and_head(model)
    hidden = decoder(input_ids=batch["input_ids"]).last_hidden_state
    weight, bias = models.head_weight_and_bias(head)
    return kd_loss_chunked(hidden, weight, batch, cfg, chunk_size, bias, checkpoint)


def endless_batches(cache: KDCache, batch_size: int, seed: int, rank: int = 0,
                    world_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """Epoch after epoch of shuffled fixed-shape training batches (each epoch's last partial batch dropped)."""
    epoch = 0
    while True:
        yield from cache.batches("train", batch_size, seed=seed, epoch=epoch, rank=rank, world_size=world_size)
        epoch += 1


def _prepare_out(cfg: TrainConfig) -> Path:
    """Create the run folder; with --overwrite remove only what a previous run wrote there."""
    out = Path(cfg.out)
    if (out / CONFIG_FILE).exists():
        if not cfg.overwrite:
            raise ValueError(f"--out {out}: a run already exists there; pass --overwrite or choose another folder")
        for path in [out / name for name in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, ADAPTER_DIR)] + \
                list(out.glob("checkpoint-*")):
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


@dataclass
class _Run:
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: Iterator[dict[str, torch.Tensor]]
    tokens_per_step: int
    out: Path


def _set_up(cfg: TrainConfig, device: torch.device, log: Callable[[str], None]) -> _Run:
    """Student, adapters, data and optimizer; every input is checked before the run folder is touched."""
    cache = KDCache(cfg.cache)
    dev.seed_everything(cfg.seed)
    tokenizer = models.load_tokenizer(cfg.model)
    student = build_student(cfg.model, cfg.quant, resolve_attn(cfg.attn_implementation, device))
    cache.check_compatible(tokenizer, models.vocab_size(student), models.max_positions(student))
    num_rows = cache.num_sequences("train")
    if num_rows < cfg.batch_size:
        raise ValueError(f"--cache {cfg.cache}: {num_rows} training sequences, fewer than --batch-size "
                         f"{cfg.batch_size}; build a larger cache or lower the batch size")
    out = _prepare_out(cfg)
    model = add_recovery_lora_(student, r=cfg.lora_r, alpha=cfg.lora_alpha).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio))
    atomic_write_json(out / CONFIG_FILE, {**asdict(cfg), "quant_config": quant_config_dict(get_preset(cfg.quant)),
                                          "trainable_parameters": sum(p.numel() for p in params)})
    tokens_per_step = cfg.batch_size * cfg.accumulation_steps * cache.seq_len
    log(f"student {cfg.model} [{cfg.quant}] on {device}: {sum(p.numel() for p in params):,} trainable parameters, "
        f"{num_rows} training sequences of {cache.seq_len}, {tokens_per_step:,} tokens per step")
    return _Run(model, params, optimizer, scheduler, endless_batches(cache, cfg.batch_size, cfg.seed),
                tokens_per_step, out)


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict:
    """Train recovery LoRA adapters; returns the run summary (also written to `out/summary.json`)."""
    device = dev.resolve_device(cfg.device)
    run = _set_up(cfg, device, log)
    loss_cfg = KDLossConfig(cfg.temperature, cfg.alpha)
    amp_dtype = dev.autocast_dtype(device, cfg.precision)
    checkpoint = dev.checkpoint_fn(device)

    metrics_file = (run.out / METRICS_FILE).open("w")
    progress = tqdm(total=cfg.max_steps, desc="train", unit="step")
    started = last_time = time.perf_counter()
    last_step = compiled_by_step_2 = 0
    for step in range(cfg.max_steps):
        totals = {}
        for micro in range(cfg.accumulation_steps):
            batch = {k: v.to(device) for k, v in next(run.batches).items()}
            with dev.autocast(device, amp_dtype):
                parts = forward_loss(run.model, batch, loss_cfg, cfg.loss_chunk_size, checkpoint)
            (parts["loss"] / cfg.accumulation_steps).backward()
            for key in ("loss", "soft_ce", "kl", "ce"):
                totals[key] = totals.get(key, 0.0) + parts[key].detach() / cfg.accumulation_steps
            if micro == cfg.accumulation_steps - 1:  # the update joins the last micro-step's graph
                grad_norm = torch.nn.utils.clip_grad_norm_(run.params, cfg.max_grad_norm)
                run.optimizer.step()
                run.scheduler.step()
                run.optimizer.zero_grad(set_to_none=False)
            dev.sync(device)

        if (step + 1) % cfg.log_steps == 0 or step + 1 == cfg.max_steps:
            now = time.perf_counter()
            record = {"step": step + 1, "lr": run.scheduler.get_last_lr()[0],
                      "tokens_per_s": (step + 1 - last_step) * run.tokens_per_step / max(now - last_time, 1e-9),
                      "elapsed_s": now - started}
            last_time, last_step = now, step + 1

            def write_metrics(record=record, totals=totals, grad_norm=grad_norm):
                record.update({k: float(v) for k, v in totals.items()}, grad_norm=float(grad_norm))
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                progress.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")

            dev.add_step_closure(device, write_metrics)
        progress.update(1)
        if step == 1:
            compiled_by_step_2 = dev.compile_metrics().get("graphs_compiled", 0)
        if cfg.save_steps and (step + 1) % cfg.save_steps == 0 and step + 1 < cfg.max_steps:
            save_adapter(run.model, run.out / f"checkpoint-{step + 1}")
    dev.sync(device)
    progress.close()
    metrics_file.close()
    save_adapter(run.model, run.out / ADAPTER_DIR)
    wall = time.perf_counter() - started
    summary = {"steps": cfg.max_steps, "tokens": cfg.max_steps * run.tokens_per_step, "wall_s": round(wall, 2),
               "tokens_per_s": round(cfg.max_steps * run.tokens_per_step / wall, 1), "device": str(device),
               "adapter": str(run.out / ADAPTER_DIR)}
    if dev.is_xla(device):
        report = dev.compile_metrics()
        report["graphs_compiled_after_step_2"] = report["graphs_compiled"] - compiled_by_step_2
        summary["compile"] = report
    atomic_write_json(run.out / SUMMARY_FILE, summary)
    log(f"saved adapters to {run.out / ADAPTER_DIR} ({summary['tokens_per_s']:,.0f} tok/s)")
    return summary
