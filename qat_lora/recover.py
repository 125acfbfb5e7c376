"""`qat-lora recover`: the recovery recipe, stage by stage, each resumable, each stage's artefacts kept.

    qat-lora recover --model M --quant w2g64 --cache caches/kd --out runs/w2g64
        runs/w2g64/init/   quantizer.safetensors + quantize.json   stage 1: preset init + GPTQ (qat-lora quantize),
                           blocks/                                 then block-wise reconstruction (--blockwise-steps)
        runs/w2g64/qat/    a train run (--qat weight-qat|qat)      stage 2 (off by default): end-to-end KD of weights +
                                                                   scales/zeros
        runs/w2g64/lora/   a train run (recovery-lora)             stage 3: LoRA over the stage-2 student
        runs/w2g64/recover.json                                    what to load: --quantizer and --adapter

Stage 2, when asked for, leaves every weight on its grid (codes in quantizer.safetensors), so the low-bit export keeps the
recovery; stage 3 adds adapters that a runtime applies next to the quantised base (or `--lora-steps 0`).
Rerun the same command after a stop: finished stages are skipped, an interrupted one resumes.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Callable

from .config import QuantizeConfig, RecoverConfig, TrainConfig
from . import models
from .files import FolderLock, atomic_write_json, check_out_apart_from_inputs, owner_stamp, read_record, require_folder
from .ptq import REPORT_FILE, init_is_current, quantize
from .runs import QUANTIZER_FILE, check_run_folder
from .train import train

SUMMARY_FILE = "recover.json"


def _init_stage(cfg: RecoverConfig, log: Callable[[str], None]) -> str:
    """Stage 1 (and block-wise); skipped when its folder holds an init made with the same settings, resumed per
    block when the block-wise part was interrupted."""
    init = QuantizeConfig(model=cfg.model, quant=cfg.quant, init=cfg.init, cache=cfg.cache,
                          calib_sequences=cfg.calib_sequences, blockwise_steps=cfg.blockwise_steps,
                          blockwise_lr=cfg.blockwise_lr, blockwise_quant_lr=cfg.blockwise_quant_lr,
                          batch_size=min(QuantizeConfig.batch_size, cfg.calib_sequences),
                          out=str(Path(cfg.out) / "init"), overwrite=True)
    if init_is_current(init):
        log(f"stage 1 (init): done already, {Path(init.out) / QUANTIZER_FILE}")
        return str(Path(init.out) / QUANTIZER_FILE)
    report = read_record(Path(init.out) / REPORT_FILE)  # an interrupted init of these settings runs again
    if report is not None and (report.get("config") != asdict(init) or report.get("inputs") not in (
            None, models.input_identities(init.model, init.cache))):
        raise ValueError(f"--out {cfg.out}: its init/ was made with other settings or from another --model or "
                         "--cache (their contents changed); use another --out")
    quantize(init, log)
    return str(Path(init.out) / QUANTIZER_FILE)


def _train_stage(cfg: RecoverConfig, name: str, quantizer: str, log: Callable[[str], None], **fields) -> dict:
    """One training stage in `out/name`, resumed if it was interrupted (a finished one returns its summary)."""
    common = dict(model=cfg.model, quant=cfg.quant, quantizer=quantizer, cache=cfg.cache, out=str(Path(cfg.out) / name),
                  batch_size=cfg.batch_size, accumulation_steps=cfg.accumulation_steps, save_steps=cfg.save_steps,
                  seed=cfg.seed, device=cfg.device, resume="auto")
    train_cfg = TrainConfig(**{**common, **fields})
    log(f"stage {name}: {train_cfg.preset}, {train_cfg.max_steps} steps")
    return train(train_cfg, log, rerun="rerun the same qat-lora recover command to continue")


def recover(cfg: RecoverConfig, log: Callable[[str], None] = print) -> dict:
    """Run the stages cfg asks for; returns (and writes to out/recover.json) what to load afterwards. Each stage
    refuses a sub-folder it did not write; the whole --out is held against a second recover meanwhile."""
    require_folder(cfg.out, "the recovery run")
    check_out_apart_from_inputs(cfg.out, {"--model": cfg.model, "--cache": cfg.cache})
    with FolderLock(cfg.out):
        return _recover(cfg, log)


def _recover(cfg: RecoverConfig, log: Callable[[str], None]) -> dict:
    for stage in ("qat", "lora"):  # before stage 1's minutes of work: a stage folder no run wrote is refused
        check_run_folder(Path(cfg.out) / stage)
    quantizer = _init_stage(cfg, log)
    stages = {"init": quantizer}
    if cfg.qat != "none":
        qat = _train_stage(cfg, "qat", quantizer, log, preset=cfg.qat, max_steps=cfg.qat_steps, lr=cfg.qat_lr,
                           weight_lr_ratio=cfg.weight_lr / cfg.qat_lr, warmup_steps=max(1, cfg.qat_steps // 20))
        quantizer = stages["qat"] = qat["quantizer"]
    adapter = ""
    if cfg.lora_steps:
        lora = _train_stage(cfg, "lora", quantizer, log, preset="recovery-lora", max_steps=cfg.lora_steps, lr=cfg.lr,
                            lora_r=cfg.lora_r, lora_alpha=2.0 * cfg.lora_r, warmup_steps=max(1, cfg.lora_steps // 20))
        adapter = stages["lora"] = lora["adapter"]
    summary = {**owner_stamp("recover"), "quantizer": quantizer, "adapter": adapter or None, "stages": stages, "config": asdict(cfg),
               "eval": f"qat-lora eval --model {cfg.model} --quant {cfg.quant} --quantizer {quantizer}"
                       + (f" --adapter {adapter}" if adapter else "") + " --text <held-out text>"}
    atomic_write_json(Path(cfg.out) / SUMMARY_FILE, summary)
    log(f"recovered student: --quantizer {quantizer}" + (f" --adapter {adapter}" if adapter else ""))
    return summary
