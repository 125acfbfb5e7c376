"""`qat-lora recover`: the recovery recipe, stage by stage, each resumable, each stage's artefacts kept.

    qat-lora recover --model M --quant w2g64 --cache caches/kd --out runs/w2g64
        runs/w2g64/init/   quantizer.safetensors + quantize.json   stage 1: preset init + GPTQ (qat-lora quantize),
                           blocks/                                 then block-wise reconstruction (--blockwise-steps)
        runs/w2g64/qat/    a train run (--qat weight-qat|qat)      stage 2 (off by default): end-to-end KD of weights +
                                                                   scales/zeros
        runs/w2g64/lora-init/ adapters (--lora-init calibrated)     stage 3 start: each adapter the best rank-r
                                                                   correction of its layer's quantisation error
        runs/w2g64/probe/  lr-<rate>/ train runs, probe.json       stage 3a (several --lr): each rate trains
                                                                   --lr-probe-steps from the same student; the lowest
                                                                   held-out KD loss of the cache chooses stage 3's
        runs/w2g64/lora/   a train run (recovery-lora)             stage 3: LoRA over the stage-2 student
        runs/w2g64/recover.json                                    what to load: --quantizer and --adapter
                                                                   (and, with --budget-bits, what the budget chose)

Stage 2, when asked for, leaves every weight on its grid (codes in quantizer.safetensors), so the low-bit export keeps the
recovery; stage 3 adds adapters that a runtime applies next to the quantised base (or `--lora-steps 0`).
Rerun the same command after a stop: finished stages are skipped, an interrupted one resumes.
"""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from qat_lora.commands.budget import BUDGET_RANKS, choose_budget
from qat_lora.commands.config import QuantizeConfig, RecoverConfig
from qat_lora.train.config import StudentSpec, TrainConfig
from qat_lora.data import identities, models
from qat_lora.cache.reader import KDCache
from qat_lora.runtime.files import (FolderLock, atomic_write_json, check_out_apart_from_inputs, owned_by, owner_stamp, read_record,
                    require_folder)
from qat_lora.train.lora import lora_start_
from qat_lora.commands.quantize import PLACEMENT_FIELDS, REPORT_FILE, quantize
from qat_lora.runtime import device as dev, precision
from qat_lora.runtime.options import field_defaults
from qat_lora.runtime.runs import (ADAPTER_DIR, BEST_DIR, CONFIG_FILE, QUANTIZER_FILE, RUN_KIND, RUN_LEGACY_KEYS,
                                   RunDiverged, check_run_folder, read_config, read_summary)
from qat_lora.train.checkpoint import RESUME_FREE_FIELDS
from qat_lora.train.run import run_inputs
from qat_lora.train.student import build_student, make_trainable_, save_adapter, student_base
from qat_lora.train.trainer import train

SUMMARY_FILE = "recover.json"
PROBE_FILE = "probe.json"
LORA_START_DIR, LORA_START_RECORD, LORA_START_KIND = "lora-init", "lora_init.json", "recover-lora-init"


def probe_steps(cfg: RecoverConfig) -> int:
    # A fifth of the stage, capped: 10 steps ranked Gemma 3's rates as 40-step runs did (docs/RESULTS.md).
    return cfg.lr_probe_steps or max(4, min(20, cfg.lora_steps // 5))


def _probe_folder(lr: float) -> str:
    return f"probe/lr-{lr:g}"


def _init_stage(cfg: RecoverConfig, log: Callable[[str], None]) -> str:
    """Stage 1 (and block-wise); skipped when its folder holds an init made with the same settings, resumed per
    block when the block-wise part was interrupted."""
    init = QuantizeConfig(model=cfg.model, quant=cfg.quant, init=cfg.init, cache=cfg.cache,
                          calib_sequences=cfg.calib_sequences, blockwise_steps=cfg.blockwise_steps,
                          blockwise_lr=cfg.blockwise_lr, blockwise_quant_lr=cfg.blockwise_quant_lr,
                          batch_size=min(QuantizeConfig.batch_size, cfg.calib_sequences),
                          out=str(Path(cfg.out) / "init"), overwrite=True, device=cfg.device)
    report = read_record(Path(init.out) / REPORT_FILE)
    same = _same_init(report, init)
    if same and report.get("complete", True) and (Path(init.out) / QUANTIZER_FILE).exists():
        log(f"stage 1 (init): done already, {Path(init.out) / QUANTIZER_FILE}")
        return str(Path(init.out) / QUANTIZER_FILE)
    if report is not None and not same:  # an interrupted init of these settings runs again
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
    done = _finished_stage(train_cfg)
    if done is not None:
        log(f"stage {name}: done already, {train_cfg.out}")
        return done
    log(f"stage {name}: {train_cfg.preset}, {train_cfg.max_steps} steps")
    return train(train_cfg, log, rerun="rerun the same qat-lora recover command to continue")


# Where a stage's settings name a file, recover compares what it holds (the recorded input identities) or, inside
# --out, where it lies there: never the spelling, so the same --out by another path, or a copy, is the same run.
_INPUT_PATHS = ("model", "cache")


def _same_inputs(config: dict, inputs, current: dict, identities: dict) -> bool:
    """--model and --cache of a recorded `config` against the current ones: by their contents where the record
    identified them (`inputs`), by their spelling where it could not (a hub name, a record older than inputs)."""
    for key in _INPUT_PATHS:
        known = inputs.get(key) if isinstance(inputs, dict) else None
        if (known != identities.get(key)) if known is not None else (config.get(key) != current.get(key)):
            return False
    return True


def _within(value, root: str) -> object:
    """A path inside `root` as its place there (init/quantizer.safetensors); any other value as it is."""
    if not isinstance(value, str) or not value:
        return value
    try:
        return Path(os.path.abspath(value)).relative_to(os.path.abspath(root)).as_posix()
    except ValueError:
        return value


def _same_init(report: dict | None, init: QuantizeConfig) -> bool:
    """Whether quantize.json `report` records an init of `init`'s settings from the same --model and --cache."""
    config = (report or {}).get("config")
    if not isinstance(config, dict):
        return False
    current, skip = asdict(init), ("out", *_INPUT_PATHS, *PLACEMENT_FIELDS)
    return {k: v for k, v in config.items() if k not in skip} == {k: v for k, v in current.items() if k not in skip} \
        and _same_inputs(config, report.get("inputs"), current, identities.input_identities(init.model, init.cache))


def _finished_stage(train_cfg: TrainConfig) -> dict | None:
    """The summary of a finished run in the stage's folder made with these settings from the same inputs, its
    artefacts named where the folder is now; None otherwise (train then resumes it, or explains what differs)."""
    out = Path(train_cfg.out)
    summary, saved = read_summary(out), read_config(out)
    if summary is None or saved is None or summary["steps"] < train_cfg.max_steps or \
            not owned_by(out / CONFIG_FILE, RUN_KIND, RUN_LEGACY_KEYS):
        return None
    inputs, identities, current = saved.get("inputs"), run_inputs(train_cfg), asdict(train_cfg)
    if current["loss_chunk_size"] < 0:  # auto: the run recorded the size that ran (trainer.train)
        current["loss_chunk_size"] = precision.default_loss_chunk_size(dev.resolve_device(train_cfg.device))
    if not isinstance(inputs, dict) or any(inputs.get(k) != v for k, v in identities.items() if k not in _INPUT_PATHS):
        return None  # the quantiser or the online teacher differ (or were never recorded)
    saved = {**field_defaults(TrainConfig), **saved}
    then, now = str(Path(str(saved.get("out"))).parent), str(out.parent)  # the recover folder, spelled then and now
    if not _same_inputs(saved, inputs, current, identities) or any(
            _within(saved.get(k), then) != _within(v, now) for k, v in current.items()
            if k not in RESUME_FREE_FIELDS and k not in _INPUT_PATHS):
        return None
    return {**summary, **{key: str(out / name) if summary.get(key) else None for key, name in (
        ("adapter", ADAPTER_DIR), ("quantizer", QUANTIZER_FILE), ("best", BEST_DIR))}}


def _lora_fields(cfg: RecoverConfig, lr: float, steps: int, start: str) -> dict:
    return dict(preset="recovery-lora", max_steps=steps, lr=lr, lora_r=cfg.lora_r, lora_alpha=2.0 * cfg.lora_r,
                warmup_steps=max(1, steps // 20), lora_init=start)


def _lora_start(cfg: RecoverConfig, quantizer: str, log: Callable[[str], None]) -> str:
    """The --lora-init every LoRA run gets: with calibrated, the adapters computed once into out/lora-init/ (on
    Gemma 3 270M that takes 2.5 min on 2 cores, as long as 13 training steps) and reused by the probes and the
    stage while the student, cache and settings they came from are the same."""
    if cfg.lora_init == "zero":
        return "zero"
    folder = Path(cfg.out) / LORA_START_DIR
    settings = {"inputs": identities.input_identities(cfg.model, cfg.cache, quantizer), "quant": cfg.quant,
                "lora_r": cfg.lora_r, "calib_sequences": cfg.calib_sequences, "batch_size": cfg.batch_size}
    record = read_record(folder / LORA_START_RECORD)
    if folder.exists() and not owned_by(folder / LORA_START_RECORD, LORA_START_KIND):
        raise ValueError(f"--out {cfg.out}: its {LORA_START_DIR}/ was not written by recover; use another --out")
    if record is not None and record.get("settings") == settings:
        log(f"stage 3 (LoRA start): calibrated already, {folder}")
        return str(folder)
    model = make_trainable_(build_student(StudentSpec(cfg.model, cfg.quant, quantizer)), "recovery-lora", cfg.lora_r,
                            2.0 * cfg.lora_r)
    lora_start_(model, "calibrated", cfg.model, cfg.cache, cfg.calib_sequences, cfg.batch_size, log,
                device=dev.resolve_device(cfg.device))
    staging = folder.with_name(folder.name + ".partial")  # written aside, then renamed: never half a start
    shutil.rmtree(staging, ignore_errors=True)
    save_adapter(model, staging, settings["inputs"]["model"], student_base(model, folder))  # the umask's modes
    atomic_write_json(staging / LORA_START_RECORD, {**owner_stamp(LORA_START_KIND), "settings": settings})
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return str(folder)


def _choose_lr(cfg: RecoverConfig, quantizer: str, start: str, log: Callable[[str], None]) -> tuple[float, dict]:
    """Stage 3a: the LoRA rate with the lowest held-out KD loss after a short run of each (its own schedule,
    evaluated once at its end). The right rate differs between models (SmolLM2's 2e-3 is too high for Gemma 3,
    where 5e-4 wins) and a too-high one shows within a few steps: on Gemma 3 a 10-step probe ranked
    5e-4 < 1e-3 < 2e-3 at w3g64 and w4g64, the order of the 40-step runs (where 5e-4 and 1e-3 tie at w3g64;
    docs/RESULTS.md). It is a guard against a rate wrong by 2x or more, not a fine search.

    Returns:
        (rate, {rate: held-out loss or inf where the run diverged}).
    """
    if len(cfg.lr) == 1:
        return cfg.lr[0], {}
    steps, scores = probe_steps(cfg), {}
    for lr in cfg.lr:
        try:
            summary = _train_stage(cfg, _probe_folder(lr), quantizer, log, eval_steps=steps, save_steps=0,
                                   **_lora_fields(cfg, lr, steps, start))
            loss = summary["best_eval_loss"]  # NaN would win min() when listed first: it ranks as a diverged rate
            scores[lr] = loss if loss is not None and math.isfinite(loss) else math.inf
        except RunDiverged:  # too high a rate: it loses, the others still run
            scores[lr] = math.inf
        log(f"stage 3a (lr probe): lr {lr:g}, held-out KD loss {scores[lr]:.4f} after {steps} steps")
    best = min(cfg.lr, key=lambda lr: scores[lr])
    if not math.isfinite(scores[best]):
        raise ValueError(f"--lr {' '.join(f'{x:g}' for x in cfg.lr)}: every rate diverged in the probe; "
                         "pass lower rates")
    atomic_write_json(Path(cfg.out) / "probe" / PROBE_FILE, {
        **owner_stamp("recover-probe"), "steps": steps, "chosen": best,
        "heldout_kd_loss": {f"{lr:g}": (scores[lr] if math.isfinite(scores[lr]) else None) for lr in cfg.lr}})
    log(f"stage 3a (lr probe): lr {best:g} chosen")
    return best, scores


def _resolve_budget(cfg: RecoverConfig, log: Callable[[str], None]) -> tuple[RecoverConfig, dict | None]:
    """--budget-bits: the config with the budget's choice (commands/budget.py) in --quant, --lora-r, --lora-steps
    and --qat, as if typed, and recover.json's record of the choice; cfg itself and None without a budget. Chosen
    on --model's shapes alone (no weight loads), the same on every rerun, so a rerun finds its finished stages."""
    if not cfg.budget_bits:
        return cfg, None
    ranks = BUDGET_RANKS if cfg.lora_steps else ()  # --lora-steps 0 asks for no adapter: the budget picks the base
    choice = choose_budget(cfg.budget_bits, models.linear_shapes(cfg.model), ranks=ranks)
    log(choice.describe())
    if choice.lora_r is None:  # no room for an adapter: train the grid's scales and zeros, unless --qat says otherwise
        return replace(cfg, budget_bits=0.0, quant=choice.preset, lora_steps=0,
                       qat="qat" if cfg.qat == "none" else cfg.qat), choice.record()
    # cfg.lr is empty unless typed: the rates are then the default probe at the chosen rank (RecoverConfig)
    return replace(cfg, budget_bits=0.0, quant=choice.preset, lora_r=choice.lora_r), choice.record()


def recover(cfg: RecoverConfig, log: Callable[[str], None] = print) -> dict:
    """Run the stages cfg asks for; returns (and writes to out/recover.json) what to load afterwards. Each stage
    refuses a sub-folder it did not write; the whole --out is held against a second recover meanwhile."""
    cfg, budget = _resolve_budget(cfg, log)  # before --out is touched: a budget too small is one line
    require_folder(cfg.out, "the recovery run")
    check_out_apart_from_inputs(cfg.out, {"--model": cfg.model, "--cache": cfg.cache})
    with FolderLock(cfg.out):
        return _recover(cfg, log, budget)


def _recover(cfg: RecoverConfig, log: Callable[[str], None], budget: dict | None = None) -> dict:
    probes = [_probe_folder(lr) for lr in cfg.lr] if cfg.lora_steps and len(cfg.lr) > 1 else []
    for stage in ("qat", "lora", *probes):  # before stage 1's minutes of work: a folder no run wrote is refused
        check_run_folder(Path(cfg.out) / stage)
    if probes and KDCache(cfg.cache).num_sequences("heldout") == 0:
        raise ValueError(f"--cache {cfg.cache}: no held-out split to choose --lr on; rebuild it with "
                         "--holdout-fraction > 0, or pass one --lr")
    quantizer = _init_stage(cfg, log)
    stages = {"init": quantizer}
    if cfg.qat != "none":
        qat = _train_stage(cfg, "qat", quantizer, log, preset=cfg.qat, max_steps=cfg.qat_steps, lr=cfg.qat_lr,
                           weight_lr_ratio=cfg.weight_lr / cfg.qat_lr, warmup_steps=max(1, cfg.qat_steps // 20))
        quantizer = stages["qat"] = qat["quantizer"]
    adapter = ""
    lr, probe = None, {}
    if cfg.lora_steps:
        start = _lora_start(cfg, quantizer, log)
        lr, probe = _choose_lr(cfg, quantizer, start, log)
        lora = _train_stage(cfg, "lora", quantizer, log, **_lora_fields(cfg, lr, cfg.lora_steps, start))
        adapter = stages["lora"] = lora["adapter"]
    summary = {**owner_stamp("recover"), "quantizer": quantizer, "adapter": adapter or None, "stages": stages,
               "lr": lr, "lr_probe": {f"{k:g}": (v if math.isfinite(v) else None) for k, v in probe.items()},
               "budget": budget, "config": asdict(cfg),
               "eval": f"qat-lora eval --model {cfg.model} --quant {cfg.quant} --quantizer {quantizer}"
                       + (f" --adapter {adapter}" if adapter else "") + " --text <held-out text>"}
    atomic_write_json(Path(cfg.out) / SUMMARY_FILE, summary)
    log(f"recovered student: --quantizer {quantizer}" + (f" --adapter {adapter}" if adapter else ""))
    return summary
