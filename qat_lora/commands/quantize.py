"""`qat-lora quantize`: the initialisation stage, post-training quantisation with a data-aware init.

    qat-lora quantize --model M --quant w3g64 --init gptq --cache caches/kd --out runs/w3g64-init
    qat-lora train --model M --quant w3g64 --quantizer runs/w3g64-init/quantizer.safetensors ...

The preset's own init (round-to-nearest, MSE clipping or k-means) first; then, calibrated on the cache's
training split (never the evaluation text): `act` re-fits each group's clipping with the error weighted by
the mean squared activation of its input columns (AWQ-style), `gptq` rounds the weights column by column,
pushing each rounding error onto the columns not yet quantised (Frantar et al., 2022; DESIGN §8). With
`--blockwise-steps N`, each decoder block's weights and scales are then trained for N steps to reproduce the
teacher's block outputs (quant/blockwise.py; resumable from out/blocks/). The result
is a quantiser state (and, for gptq, the moved weights as integer codes) in `quantizer.safetensors`, which
train, eval and export load with `--quantizer`.
"""
from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch

from qat_lora.data import identities, models
from qat_lora.runtime import device as dev
from qat_lora.cache.reader import KDCache
from qat_lora.quant.blocks import layer_progress
from qat_lora.quant.blockwise import reconstruct_blocks_
from qat_lora.quant.calibration import activation_importance, calibration_batches
from qat_lora.commands.config import QuantizeConfig
from qat_lora.runtime.files import (FolderLock, atomic_write_json, check_out_apart_from_inputs, owned_by, owner_stamp, read_record,
                    require_folder)
from qat_lora.quant.gptq import gptq_
from qat_lora.quant.fake_quant import get_preset, quant_config_dict, quantize_
from qat_lora.quant.quantizer import quantizer_for
from qat_lora.runtime.runs import INIT_REPORT_FILE, QUANTIZER_FILE, RunDiverged
from qat_lora.quant.state import quantizer_state_dict, save_quantizer_state

REPORT_FILE = INIT_REPORT_FILE
BLOCKS_DIR = "blocks"  # block-wise reconstruction's per-block states and progress.json


INIT_KIND, INIT_LEGACY_KEYS = "init", ("config", "quant_config")  # quantize.json, the ownership record


def init_is_current(cfg: QuantizeConfig) -> bool:
    """Whether cfg.out already holds an init made with exactly these settings from the same model weights and
    cache (state and report written)."""
    report = read_record(Path(cfg.out) / REPORT_FILE) or {}
    inputs = report.get("inputs")
    return (Path(cfg.out) / QUANTIZER_FILE).exists() and _settings(report.get("config")) == _settings(asdict(cfg)) and \
        report.get("complete", True) and (inputs is None or inputs == identities.input_identities(cfg.model, cfg.cache))


# Where an init ran is not what it is: a rerun on another device reuses it (records from before --device lack it).
PLACEMENT_FIELDS = ("device",)


def _settings(config: dict | None) -> dict | None:
    """A recorded init config without its placement fields."""
    return None if config is None else {k: v for k, v in config.items() if k not in PLACEMENT_FIELDS}


def _check_out(cfg: QuantizeConfig) -> Path:
    """--out apart from the inputs; an init there is replaced only with --overwrite and only when its
    quantize.json proves it one (a user's quantizer.safetensors is never overwritten)."""
    out = require_folder(cfg.out, "the init")
    check_out_apart_from_inputs(out, {"--model": cfg.model, "--cache": cfg.cache})
    if (out / QUANTIZER_FILE).exists() or (out / REPORT_FILE).exists():
        if not owned_by(out / REPORT_FILE, INIT_KIND, INIT_LEGACY_KEYS):
            raise ValueError(f"--out {out}: holds a {QUANTIZER_FILE} or {REPORT_FILE} that `qat-lora quantize` did "
                             "not write; choose another folder")
        if not cfg.overwrite:
            raise ValueError(f"--out {out}: holds an init already; pass --overwrite or choose another folder")
    return out


def quantize(cfg: QuantizeConfig, log: Callable[[str], None] = print, progress: bool = False) -> dict:
    """Build the initialised student and write its state; returns the report (also `out/quantize.json`).
    `progress`: a bar over GPTQ's decoder layers on stderr (for a recipe that silences the per-layer lines).

    Raises:
        ValueError: an existing init in --out without --overwrite, a cache from another tokenizer, too few
            calibration sequences.
    """
    out = _check_out(cfg)
    with FolderLock(out):
        return _quantize(cfg, out, log, progress)


def _quantize(cfg: QuantizeConfig, out: Path, log: Callable[[str], None], progress: bool) -> dict:
    calibrated = cfg.init != "none" or cfg.blockwise_steps > 0
    batches = calibration_batches(cfg.cache, cfg.calib_sequences, cfg.batch_size) if calibrated else []
    model = models.load_causal_lm(cfg.model)
    if cfg.cache:
        KDCache(cfg.cache).check_compatible(models.load_tokenizer(cfg.model), models.vocab_size(model),
                                            models.max_positions(model))
    started = time.perf_counter()
    preset = get_preset(cfg.quant)
    inputs = identities.input_identities(cfg.model, cfg.cache)
    report: dict = {**owner_stamp(INIT_KIND), "config": asdict(cfg), "inputs": inputs, "complete": False}
    atomic_write_json(out / REPORT_FILE, report)  # the record first: an interrupted init stays provably ours
    report = {**report, "complete": True, "quant_config": quant_config_dict(preset)}
    if cfg.init != "none" and quantizer_for(preset).clip_search:
        # Both data-aware inits fit group scales by the (weighted) clipping search, which is how the activation
        # weights act; under GPTQ min/max scales measured far worse (a probe on SmolLM2 w3g64, 32 calibration
        # sequences: 52.5 ppl vs 29.0; docs/RESULTS.md), as the error feedback widens each group's range.
        # K-quants and llama.cpp's own init (q4_1's ggml min/max) keep theirs (Quantizer.clip_search).
        preset = replace(preset, init="mse")
    device = dev.resolve_device(cfg.device)  # where each decoder layer runs in turn; the model stays on the host
    if cfg.init == "act":
        quantize_(model, preset, importance=activation_importance(model, batches, preset, device=device))
    else:
        quantize_(model, preset)
    if cfg.init == "gptq":
        with layer_progress(model, "gptq init", disable=not progress) as above:
            report["gptq"] = gptq_(model, batches, damp=cfg.damp, act_order=cfg.act_order, device=device,
                                   log=above(log))
    if cfg.blockwise_steps:
        # Every init above is deterministic, so a rerun after a stop rebuilds the same start and the blocks
        # saved under blocks/ load instead of training again (their progress records that start's fingerprint).
        teacher = models.load_causal_lm(cfg.model)
        report["blockwise"] = reconstruct_blocks_(
            model, teacher, batches, steps=cfg.blockwise_steps, lr_weights=cfg.blockwise_lr,
            lr_quant=cfg.blockwise_quant_lr, batch_size=cfg.batch_size, state_dir=out / BLOCKS_DIR, device=device,
            log=log)
    report["seconds"] = round(time.perf_counter() - started, 2)
    broken = next((name for name, p in quantizer_state_dict(model).items() if not torch.isfinite(p).all()), None)
    if broken is not None:  # never save a student that evaluates to NaN
        raise RunDiverged(f"quantize: {broken} is not finite after the init; lower --blockwise-lr / "
                          "--blockwise-quant-lr or --blockwise-steps")
    save_quantizer_state(model, out / QUANTIZER_FILE, codes=cfg.init == "gptq" or cfg.blockwise_steps > 0,
                         model_signature=inputs["model"])
    atomic_write_json(out / REPORT_FILE, report)
    log(f"{cfg.quant} + {cfg.init} init in {report['seconds']:.0f} s: {out / QUANTIZER_FILE}")
    return report


