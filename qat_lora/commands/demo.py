"""`qat-lora demo`: the whole chain on SmolLM2-135M-Instruct with a budget that fits a laptop CPU.

fetch assets -> teacher top-K cache on offline prose -> w3g64 student with a GPTQ init calibrated on the cache
(`--init`) -> recovery LoRA over it -> held-out perplexity on Wikipedia leads for the teacher, the
round-to-nearest student, the initialised student and the recovered one. GPTQ + LoRA is the best chain that fits
this budget (docs/RESULTS.md); the longer chains (block-wise, weight-qat) are `qat-lora recover`.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

from qat_lora.runtime import device as dev
from qat_lora.cache.reader import KDCache
from qat_lora.cache.builder import build_cache
from qat_lora.commands.config import DemoConfig, QuantizeConfig
from qat_lora.train.config import StudentSpec, TrainConfig
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.runtime.files import atomic_write_json, owned_by, owner_stamp
from qat_lora.train.metrics import kd_metrics, perplexity
from qat_lora.data.models import load_tokenizer
from qat_lora.commands.quantize import init_is_current, quantize
from qat_lora.runtime.runs import QUANTIZER_FILE
from qat_lora.train.student import load_student
from qat_lora.train.trainer import train


def _ppl_row(name: str, model_path: str, quant: str, quantizer: str, adapter: str, tokenizer, cfg: DemoConfig,
             eval_text: str, cache: KDCache, device) -> dict:
    started = time.perf_counter()
    model = dev.move_model_(load_student(StudentSpec(model_path, quant, quantizer), adapter), device)
    row = {"model": name, **perplexity(model, tokenizer, [eval_text], cfg.seq_len, cfg.eval_tokens, cfg.batch_size,
                                       device)}
    row.update(kd_metrics(model, cache, cfg.batch_size, device))
    row["eval_s"] = round(time.perf_counter() - started, 1)
    print(f"  {name:10s} ppl {row['ppl']:8.3f}  KD KL {row['kd_kl']:.4f}  top-1 {row['kd_top1']:.3f}")
    return row


def _init(cfg: DemoConfig, teacher: str, cache_dir: Path, work: Path) -> str:
    """The data-aware init's quantiser state (computed once per settings; "" for --init none)."""
    if cfg.init == "none":
        return ""
    init = QuantizeConfig(model=teacher, quant=cfg.quant, init=cfg.init, cache=str(cache_dir),
                          calib_sequences=cfg.calib_sequences, batch_size=cfg.batch_size,
                          out=str(work / f"init-{cfg.quant}-{cfg.init}"), overwrite=True, device=cfg.device)
    if not init_is_current(init):
        print(f"{cfg.init} init of the {cfg.quant} student on {cfg.calib_sequences} cached sequences")
        quantize(init, log=lambda line: None)
    return str(Path(init.out) / QUANTIZER_FILE)


def _train_config(cfg: DemoConfig, teacher: str, cache_dir: Path, quantizer: str, work: Path) -> TrainConfig:
    """The demo's LoRA run, resumable: its folder is named by its settings, so a rerun after a stop continues
    it (a finished one is reused) and a rerun with other flags starts its own."""
    run = TrainConfig(model=teacher, cache=str(cache_dir), quant=cfg.quant, quantizer=quantizer, out="",
                      max_steps=cfg.max_steps, batch_size=cfg.batch_size, lr=cfg.lr, lora_r=cfg.lora_r,
                      lora_alpha=2.0 * cfg.lora_r, warmup_steps=max(1, cfg.max_steps // 20), device=cfg.device,
                      lora_init=cfg.lora_init, lora_init_sequences=cfg.calib_sequences, resume="auto")
    key = hashlib.sha256(json.dumps(asdict(run), sort_keys=True).encode()).hexdigest()[:8]
    return replace(run, out=str(work / f"run-{cfg.quant}-{cfg.init}-{key}"))


def _check_work_dir(work: Path) -> None:
    """The demo writes its own sub-folders (each refuses what its writer did not write) and demo.json: a model
    folder, or a demo.json that no demo wrote, is refused before anything downloads."""
    if work.exists() and not work.is_dir():
        raise ValueError(f"--work-dir {work}: is a file; pass a folder for the demo")
    if (work / "config.json").exists():
        raise ValueError(f"--work-dir {work}: holds a config.json (a model folder?); choose an empty or new folder")
    if (work / RESULT_FILE).exists() and not owned_by(work / RESULT_FILE, DEMO_KIND, ("rows", "gap_recovered")):
        raise ValueError(f"--work-dir {work}: holds a {RESULT_FILE} that no demo wrote; choose an empty or new folder")


DEMO_KIND, RESULT_FILE = "demo", "demo.json"


def _student_paths(teacher: str, quant: str, quantizer: str, adapter: str) -> dict:
    """Every path the recovered student is loaded from (the train summary names only what the run trained, not
    the init's quantiser under its adapter), and the command that talks to it."""
    flags = f"--model {teacher} --quant {quant}" + (f" --quantizer {quantizer}" if quantizer else "")
    return {"model": teacher, "quant": quant, "quantizer": quantizer or None, "adapter": adapter,
            "generate": f"qat-lora generate {flags} --adapter {adapter} --prompt <text>"}


def run_demo(cfg: DemoConfig) -> dict:
    """Run the demo end to end; prints the table and writes `work_dir/demo.json`."""
    from qat_lora.data.assets import fetch_assets

    started = time.perf_counter()
    work = Path(cfg.work_dir)
    _check_work_dir(work)
    assets = fetch_assets(Path(cfg.assets_dir) if cfg.assets_dir else None, teacher=cfg.teacher)
    teacher = str(assets.teacher_dir)
    device = dev.resolve_device(cfg.device)
    # The default teacher keeps the folder name earlier demos wrote (their caches are reused); another is named.
    named = "" if cfg.teacher == DemoConfig.teacher else f"{cfg.teacher}-"
    targets = f"n{cfg.num_samples}" if cfg.encoding == "sampled" else f"k{cfg.top_k}"
    cache_dir = work / f"cache-{named}L{cfg.seq_len}-{targets}-{cfg.cache_tokens}"
    if not (cache_dir / "manifest.json").exists():
        build_cache(CacheBuildConfig(teacher=teacher, data=[str(assets.train_text_dir)], out=str(cache_dir),
                                     seq_len=cfg.seq_len, encoding=cfg.encoding, num_samples=cfg.num_samples,
                                     top_k=cfg.top_k, max_tokens=cfg.cache_tokens,
                                     holdout_fraction=0.05, batch_size=cfg.batch_size, device=cfg.device,
                                     resume=True))  # a build the last demo left unfinished continues
    cache = KDCache(cache_dir)
    tokenizer = load_tokenizer(teacher)
    quantizer = _init(cfg, teacher, cache_dir, work)
    summary = train(_train_config(cfg, teacher, cache_dir, quantizer, work),
                    rerun="rerun the same qat-lora demo command to continue (the cache, init and checkpoints are kept)")
    print(f"held-out evaluation ({cfg.eval_tokens:,} Wikipedia tokens at context {cfg.seq_len}):")
    if cfg.encoding == "sampled":  # KL to N draws: the teacher's own is their noise floor, not 0
        print(f"  (KD KL and top-1 against the cache's {cfg.num_samples} teacher draws per held-out position: the "
              "teacher's own KL is the draws' noise floor, and a student's excess over it estimates its KL)")
    students = [("teacher", "", "", ""), ("ptq", cfg.quant, "", "")]
    if quantizer:
        students.append((cfg.init, cfg.quant, quantizer, ""))
    students.append(("recovered", cfg.quant, quantizer, summary["adapter"]))
    rows = [_ppl_row(name, teacher, quant, state, adapter, tokenizer, cfg, str(assets.eval_text), cache, device)
            for name, quant, state, adapter in students]
    teacher_ppl, ptq_ppl, rec_ppl = rows[0]["ppl"], rows[1]["ppl"], rows[-1]["ppl"]
    gap = (ptq_ppl - rec_ppl) / (ptq_ppl - teacher_ppl) if ptq_ppl != teacher_ppl else float("nan")
    result = {**owner_stamp(DEMO_KIND), "config": cfg.__dict__, "rows": rows, "gap_recovered": gap, "train": summary,
              "student": _student_paths(teacher, cfg.quant, quantizer, summary["adapter"]),
              "wall_s": round(time.perf_counter() - started, 1)}
    atomic_write_json(work / RESULT_FILE, result)
    init = f" {rows[2]['ppl']:.2f} |" if quantizer else " – |"
    print(f"\n| teacher ppl | PTQ ppl ({cfg.quant}) | {cfg.init} init ppl | recovered ppl | gap recovered | time |\n"
          f"|---|---|---|---|---|---|\n"
          f"| {teacher_ppl:.2f} | {ptq_ppl:.2f} |{init} {rec_ppl:.2f} | {100 * gap:.1f} % | "
          f"{result['wall_s'] / 60:.1f} min |")
    print(f"(training: {summary['tokens']:,} tokens in {summary['wall_s']:.0f} s; results in {work / 'demo.json'})")
    print(f"talk to the recovered student: {result['student']['generate']}")
    return result
