"""`qat-lora demo`: the whole chain on SmolLM2-135M-Instruct with a budget that fits a laptop CPU.

fetch assets -> teacher cache on offline prose (sampled draws per position) -> w3g64 student with a GPTQ init
calibrated on the cache (`--init`) -> recovery LoRA over it from the calibrated start -> held-out perplexity on
Wikipedia leads for the teacher, the round-to-nearest student, the initialised student and the recovered one ->
the table with each row's bits per weight, demo.png (the table and the loss curve), and the commands that chat
with, evaluate and export the recovered student. GPTQ + LoRA is the best chain that fits this budget
(docs/RESULTS.md); the longer chains (block-wise, weight-qat) are `qat-lora recover`. `--budget quick` runs the
same chain on fewer tokens, sequences and steps (docs/BENCHMARKS.md, the demo).
"""
from __future__ import annotations

import hashlib
import json
import shlex
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

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
from qat_lora.export.gguf.writer import BLOCK_BITS, requantised_type
from qat_lora.quant.fake_quant import get_preset, quantised_layers
from qat_lora.quant.state import FULL_PRECISION_BITS, bits_per_weight
from qat_lora.runtime.runs import QUANTIZER_FILE
from qat_lora.train.student import adapter_bits_per_weight, load_student
from qat_lora.train.trainer import train

DEMO_KIND, RESULT_FILE, PLOT_FILE = "demo", "demo.json", "demo.png"
STAGES = 5


def _stage(index: int, text: str) -> None:
    """One line per stage: what runs and why (its progress bar, if it has one, follows on stderr)."""
    print(f"[{index}/{STAGES}] {text}", flush=True)


def _bits(model: torch.nn.Module, adapter: str) -> dict:
    """A row's bits per weight as it ships: the teacher's in bf16 (FULL_PRECISION_BITS; it runs in fp32 here); a
    student's per quantised weight (codes and fp16 quantiser tensors), plus its unmerged adapter's."""
    if not quantised_layers(model):
        return {"bits_per_weight": FULL_PRECISION_BITS}
    extra = adapter_bits_per_weight(model) if adapter else 0.0
    return {"bits_per_weight": bits_per_weight(model) + extra, "adapter_bits_per_weight": extra}


def _ppl_row(name: str, model_path: str, quant: str, quantizer: str, adapter: str, tokenizer, cfg: DemoConfig,
             eval_text: str, cache: KDCache, device) -> dict:
    started = time.perf_counter()
    model = dev.move_model_(load_student(StudentSpec(model_path, quant, quantizer), adapter), device)
    row = {"model": name, **_bits(model, adapter),
           **perplexity(model, tokenizer, [eval_text], cfg.seq_len, cfg.eval_tokens, cfg.batch_size, device,
                        progress=True)}
    row.update(kd_metrics(model, cache, cfg.batch_size, device, progress=True))
    row["eval_s"] = round(time.perf_counter() - started, 1)
    return row


def _init(cfg: DemoConfig, teacher: str, cache_dir: Path, work: Path) -> str:
    """The data-aware init's quantiser state (computed once per settings; "" for --init none)."""
    if cfg.init == "none":
        return ""
    init = QuantizeConfig(model=teacher, quant=cfg.quant, init=cfg.init, cache=str(cache_dir),
                          calib_sequences=cfg.calib_sequences, batch_size=cfg.batch_size,
                          out=str(work / f"init-{cfg.quant}-{cfg.init}"), overwrite=True, device=cfg.device)
    if not init_is_current(init):
        quantize(init, log=lambda line: None, progress=True)  # the bar replaces the per-layer lines
    return str(Path(init.out) / QUANTIZER_FILE)


def _train_config(cfg: DemoConfig, teacher: str, cache_dir: Path, quantizer: str, work: Path) -> TrainConfig:
    """The demo's LoRA run, resumable: its folder is named by its settings, so a rerun after a stop continues
    it (a finished one is reused) and a rerun with other flags starts its own."""
    run = TrainConfig(model=teacher, cache=str(cache_dir), quant=cfg.quant, quantizer=quantizer, out="",
                      max_steps=cfg.max_steps, batch_size=cfg.batch_size, lr=cfg.lr, lora_r=cfg.lora_r,
                      lora_alpha=2.0 * cfg.lora_r, warmup_steps=max(1, cfg.max_steps // 20), device=cfg.device,
                      lora_init=cfg.lora_init, lora_init_sequences=cfg.calib_sequences, resume="auto",
                      log_steps=1)  # every step in metrics.jsonl: demo.png's loss curve
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


def student_record(cfg: DemoConfig, teacher: str, quantizer: str, adapter: str, cache: str, eval_text: str) -> dict:
    """Every path the recovered student is loaded from (its base: --model, the preset and the init's quantiser,
    which the train summary leaves out as the run did not train it; its adapter) and the exact commands that
    chat with it, evaluate it as the table did and export it for llama.cpp and for transformers."""
    quant, work = cfg.quant, Path(cfg.work_dir)
    flags = ["--model", teacher, "--quant", quant, *(["--quantizer", quantizer] if quantizer else []),
             "--adapter", adapter]
    lossy = requantised_type(get_preset(quant))  # llama.cpp has no type for this grid: re-quantised, or refused
    gguf = ["--format", "gguf", *(["--gguf-requantize"] if lossy else []), "--out", str(work / "export-gguf")]
    return {"model": teacher, "quant": quant, "quantizer": quantizer or None,
            "base": f"{quant} over {teacher}, " + (f"quantiser {quantizer}" if quantizer else
                                                   "the preset's own init (no quantiser file)"),
            "adapter": adapter, "cache": cache, "eval_text": eval_text,
            "gguf_requantized_to": lossy,
            "commands": {
                "chat": shlex.join(["qat-lora", "chat", *flags]),
                "generate": shlex.join(["qat-lora", "generate", *flags, "--prompt", "Tell me about the Moon."]),
                "eval": shlex.join(["qat-lora", "eval", *flags, "--text", eval_text, "--seq-len", str(cfg.seq_len),
                                    "--max-tokens", str(cfg.eval_tokens), "--cache", cache]),
                "export_gguf": shlex.join(["qat-lora", "export", *flags, *gguf]),
                "export_dense": shlex.join(["qat-lora", "export", *flags, "--format", "dense", "--out",
                                            str(work / "export-dense")])}}


def _table(rows: list[dict], cfg: DemoConfig) -> list[list[str]]:
    """The results table: a header, then per row its model, bits per weight, perplexity, KD KL and top-1."""
    names = {"teacher": f"teacher ({cfg.teacher})", "ptq": f"{cfg.quant} round-to-nearest",
             cfg.init: f"{cfg.quant} {cfg.init} init", "recovered": f"+ LoRA r{cfg.lora_r}, {cfg.max_steps} steps"}
    cells = [["model", "bits/weight", "Wikipedia ppl", "KD KL", "top-1"]]
    for row in rows:
        bits = f"{row['bits_per_weight']:.2f}".rstrip("0").rstrip(".")
        if row.get("adapter_bits_per_weight"):
            bits += f" (adapter {row['adapter_bits_per_weight']:.2f})"
        cells.append([names[row["model"]], bits, f"{row['ppl']:.2f}", f"{row['kd_kl']:.4f}", f"{row['kd_top1']:.3f}"])
    return cells


def _report(result: dict, table: list[list[str]], cfg: DemoConfig, work: Path) -> None:
    """The demo's last lines: the table, the figure, where the student is and the commands that use it."""
    print("\n" + "\n".join("| " + " | ".join(line) + " |" for line in [table[0], ["---"] * len(table[0]), *table[1:]]))
    train_s = result["train"]["wall_s"]
    print(f"gap recovered: {100 * result['gap_recovered']:.1f} % of the perplexity gap between round-to-nearest and "
          f"the teacher; {result['wall_s'] / 60:.1f} min in all ({result['train']['tokens']:,} training tokens in "
          f"{train_s:.0f} s); results: {work / RESULT_FILE}")
    student, commands = result["student"], result["student"]["commands"]
    print(f"figure (the table and the loss curve): {result['figure']}" if result["figure"] else
          f"no {PLOT_FILE}: matplotlib is missing (pip install matplotlib, then rerun this command: it reuses the "
          "cache, init and run and only evaluates again)")
    print(f"\nthe recovered student: {student['base']}, + the LoRA adapter {student['adapter']}")
    print(f"  chat:         {commands['chat']}")
    print(f"  evaluate:     {commands['eval']}")
    if student["gguf_requantized_to"]:
        qtype = student["gguf_requantized_to"]
        print(f"  llama.cpp:    {commands['export_gguf']}\n                (llama.cpp has no type for {cfg.quant}: "
              f"the file is re-quantised to {qtype}, {BLOCK_BITS[qtype]} bits per weight, and lossy; the trained "
              "grid is kept by --format packed for qat-lora, or dense for transformers, each with its adapter)")
    else:
        print(f"  llama.cpp:    {commands['export_gguf']}  (gguf/model.gguf + gguf/adapter.gguf for --lora)")
    print(f"  transformers: {commands['export_dense']}  (dense/ + adapter/: PeftModel.from_pretrained)")


def _figure(table: list[list[str]], run_dir: str, work: Path) -> str | None:
    """demo.png's path, or None when matplotlib is missing (the demo's results stand without it)."""
    from qat_lora.commands.plot import plot_demo

    try:
        return str(plot_demo(table, run_dir, work / PLOT_FILE))
    except ValueError:
        return None


def run_demo(cfg: DemoConfig) -> dict:
    """Run the demo end to end; prints the table and the student's commands and writes `work_dir/demo.json`."""
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
    kept = f"{cfg.num_samples} draws" if cfg.encoding == "sampled" else f"top-{cfg.top_k} log-probs"
    _stage(1, f"teacher cache: {cfg.teacher} reads {cfg.cache_tokens:,} tokens of offline prose once; its {kept} "
              f"per position are the student's targets ({cache_dir})")
    if not (cache_dir / "manifest.json").exists():
        build_cache(CacheBuildConfig(teacher=teacher, data=[str(assets.train_text_dir)], out=str(cache_dir),
                                     seq_len=cfg.seq_len, encoding=cfg.encoding, num_samples=cfg.num_samples,
                                     top_k=cfg.top_k, max_tokens=cfg.cache_tokens,
                                     holdout_fraction=0.05, batch_size=cfg.batch_size, device=cfg.device,
                                     resume=True))  # a build the last demo left unfinished continues
    cache = KDCache(cache_dir)
    tokenizer = load_tokenizer(teacher)
    _stage(2, f"{cfg.init} init of the {cfg.quant} student on {cfg.calib_sequences} cached sequences: the rounding "
              "that best keeps each layer's outputs, a better start than round-to-nearest"
           if cfg.init != "none" else f"{cfg.quant} student: the preset's own init (--init none)")
    quantizer = _init(cfg, teacher, cache_dir, work)
    _stage(3, f"recovery LoRA (rank {cfg.lora_r}, {cfg.max_steps} steps at lr {cfg.lr:g}): the adapters learn the "
              "teacher's cached distributions over the frozen low-bit base")
    run = _train_config(cfg, teacher, cache_dir, quantizer, work)
    summary = train(run, rerun="rerun the same qat-lora demo command to continue (the cache, init and checkpoints "
                               "are kept)")
    _stage(4, f"held-out evaluation of each model: perplexity on {cfg.eval_tokens:,} Wikipedia tokens at context "
              f"{cfg.seq_len}, KD KL and top-1 on the cache's held-out split")
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
    _stage(5, "report: the table, the figure and the commands that use the recovered student")
    table = _table(rows, cfg)
    result = {**owner_stamp(DEMO_KIND), "config": cfg.__dict__, "rows": rows, "gap_recovered": gap, "train": summary,
              "student": student_record(cfg, teacher, quantizer, summary["adapter"], str(cache_dir),
                                        str(assets.eval_text)),
              "figure": _figure(table, run.out, work),
              "wall_s": round(time.perf_counter() - started, 1)}
    atomic_write_json(work / RESULT_FILE, result)
    _report(result, table, cfg, work)
    return result
