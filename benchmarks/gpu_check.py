"""The GPU check (issue 46 item 5): the whole recovery chain at Llama-3.2-1B's shape on one GPU, with baselines.

On a lent GPU machine (the `run` device tool runs a bash command in the repository root; torch, transformers,
peft, safetensors, tokenizers and numpy are there, no internet, no gguf package):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl   # gguf, carried as a wheel
    export PYTHONPATH=/tmp/site:$PWD; python3 -m pip install -q --no-deps --no-build-isolation -e .
    python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json --work /tmp/gcw --budget-s 510

with the tool's timeout_s=585 (docs/BENCHMARKS.md, "The GPU check"). Budget: a lent task has 15 minutes of device time, machine start included, so the
script stops starting stages after --budget-s (default 480 s) and writes the JSON after every stage: a command
killed at its limit still leaves the stages it finished in $OUT. On this 2-core CPU, the smoke run (< 2 minutes):

    .venv/bin/python benchmarks/gpu_check.py --shape tiny --device cpu --steps 3

Nothing is downloaded: the stage `setup` writes synthetic text (about 1.2 x --cache-tokens words), a byte-level BPE
tokenizer trained on it (8,000 ids; the model's 128,256 logits are wider, as a padded vocabulary), and random
weights at Llama-3.2-1B's exact config (1.24 B parameters, tied embeddings, bf16) as a transformers folder under
--work. Then every stage runs in its own process (clean peak memory: torch.cuda.max_memory_allocated there, and
the process's peak RSS), through the toolkit's own commands where one exists:
    forward   a bare bf16 forward, no grad, batch x seq-len (baseline; MFU at 2N FLOPs per token)
    peft      plain transformers + PEFT LoRA r16 on the same 7 linears, bf16 weights, AdamW (baseline; 4N)
    cache     qat-lora build-cache --cache-tokens, --dtype bf16 (its teacher loop's tokens/s; 2N)
    quantize  qat-lora quantize --quant w4g64 --init gptq --calib-sequences
    train     qat-lora train recovery-lora r16, --lora-init calibrated, --precision bf16, --steps of batch x seq-len,
              the defaults otherwise (on CUDA: bf16 storage, compiled decoder layers) (steady tokens/s: median of
              the logged records after the first; 4N: forward 2N + input gradients 2N)
    eval      qat-lora eval: KD metrics on the cache's held-out split, perplexity on held-out synthetic text
    export    qat-lora export --format gguf --gguf-requantize when `import gguf` works, else --format dense
    generate  qat-lora generate-data: --generate-tokens sampled in 128-token continuations of GENERATE_BATCH
              prompts at once (bf16, static KV cache; tokens/s after the first shard, which compiles the decode
              step, and overall_tokens_per_s; 2N)
    train_graphs, train_eager, train_fp32   variant_steps of train from the GPTQ start with --compile graphs
              (CUDA graphs: the step was bound by the host's launches), --compile off, and --compile off
              --storage-dtype fp32 (the step before issue 46): what each buys, measured beside the defaults
    profile   variant_steps of train (the defaults) under torch.profiler, PROFILE_STEPS steps recorded after the
              compile has settled: the top device kernels (WORK/logs/profile_table.txt; the host's ops by self
              CPU time in profile_table_cpu.txt) and the device's busy share of those steps' wall time
N counts every parameter once (the tied head included); attention's L^2 term is left out. A failed stage keeps
its exit code, error and log tail, later stages run where their inputs exist, and the script exits 1. The JSON:
card, versions, commit, date, sizes; per stage rc, wall_s, gpu_peak_mib, host_peak_rss_mib, tokens_per_s, mfu and
the stage's own report; `ratios` (train / peft, cache / forward, train / each variant, tokens/s); `chain_s`, the
wall time of cache + quantize + train + eval + export. Stage logs: WORK/logs/STAGE.log.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # random-weight models; Llama-3.2-1B's config.json, rope scaling included
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                                       "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True),
}
SIZES = {  # defaults of the size flags per shape
    "llama-3.2-1b": dict(steps=1000, variant_steps=40, generate_tokens=131_072, cache_tokens=1_000_000, calib_sequences=128, batch_size=8, seq_len=512,
                         tokenizer_vocab=8000, ppl_tokens=20_000, holdout_fraction=0.02),
    "tiny": dict(steps=20, variant_steps=3, generate_tokens=512, cache_tokens=8_192, calib_sequences=8, batch_size=4, seq_len=64, tokenizer_vocab=300,
                 ppl_tokens=2_000, holdout_fraction=0.1),  # ~50 documents: 2 % of them could be none
}
STAGES = ("setup", "forward", "peft", "cache", "quantize", "train", "eval", "export", "train_graphs", "profile",
          "generate", "train_eager", "train_fp32")
# Short runs of the train stage beside it, from the same GPTQ start with a zero adapter: what the defaults (bf16
# storage, compiled layers on CUDA) buy, one flag at a time.
TRAIN_VARIANTS = {"train_graphs": ["--compile", "graphs"], "train_eager": ["--compile", "off"],
                  "train_fp32": ["--storage-dtype", "fp32", "--compile", "off"]}
CHAIN = ("cache", "quantize", "train", "eval", "export")  # the user's recovery, end to end
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QUANT, LORA_R, BASELINE_STEPS = "w4g64", 16, 20
GENERATE_BATCH = {"llama-3.2-1b": 256, "tiny": 2}  # prompts per generate call (and per shard): decode is bound by
# reading the weights once per step, so tokens/s grow with the batch (64: ~15 k tokens/s on one H200)
CHILD_ENV = {"TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
NEEDS = {"forward": ["setup"], "peft": ["setup"], "cache": ["setup"], "quantize": ["cache"], "train": ["cache"],
         "train_eager": ["cache"], "train_fp32": ["cache"], "train_graphs": ["cache"], "generate": ["setup"],
         "eval": ["cache"], "export": ["setup"], "profile": ["cache"]}  # stages whose output a stage reads; the others it uses if present
MARKER = ".gpu_check"  # proves --work is this script's folder before a rerun replaces it


# ---- the child processes: one stage each ----

def _words(rng, count: int) -> list[str]:
    syllables = [c + v for c in "bdfghklmnprstvwz" for v in "aeiou"] + ["th", "st", "er", "an", "or", "en"]
    return sorted({"".join(rng.choice(syllables, size=int(rng.integers(1, 4)))) for _ in range(count)})


def _documents(rng, words: list[str], num_words: int, doc_words: int = 200) -> str:
    """English-shaped text: Zipf-distributed words, sentences of 12, documents of `doc_words` words."""
    import numpy as np

    drawn = np.asarray(words)[(rng.zipf(1.3, num_words) - 1) % len(words)]
    docs = []
    for start in range(0, num_words, doc_words):
        chunk = drawn[start:start + doc_words].tolist()
        docs.append(" ".join(" ".join(chunk[i:i + 12]).capitalize() + "." for i in range(0, len(chunk), 12)))
    return "\n\n".join(docs) + "\n"


def _make_assets(p: dict) -> dict:
    """Synthetic text, a BPE tokenizer trained on it and random weights at the shape, under p["work"]."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    work, rng = Path(p["work"]), np.random.default_rng(p["seed"])
    words = _words(rng, 6000)
    train, heldout = _documents(rng, words, int(p["cache_tokens"] * 1.2)), _documents(rng, words, p["ppl_tokens"])
    (work / "data" / "train").mkdir(parents=True)
    (work / "data" / "train" / "synthetic.txt").write_text(train)
    (work / "data" / "heldout.txt").write_text(heldout)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([train[:2_000_000]], trainers.BpeTrainer(
        vocab_size=p["tokenizer_vocab"], special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    text_tokens = sum(len(e.ids) for e in tok.encode_batch(train.split("\n\n")))
    eos = tokenizer.eos_token_id
    config = LlamaConfig(**SHAPES[p["shape"]], bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(p["seed"])
    with torch.device(p["device"]):  # random init on the GPU: seconds instead of a minute on the host
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    cuda = p["device"].startswith("cuda")
    return {"parameters": sum(t.numel() for t in model.parameters()), "tokenizer_vocab": len(tokenizer),
            "model_vocab": config.vocab_size, "train_text_tokens": text_tokens,
            "card": torch.cuda.get_device_name() if cuda else "cpu",
            "card_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None}


def _timed(step, p: dict) -> dict:
    """Two warm-up calls of `step`, then p["steps"] timed ones with one device sync at each end."""
    import torch

    sync = torch.cuda.synchronize if p["device"].startswith("cuda") else (lambda: None)
    for _ in range(2):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(p["steps"]):
        step()
    sync()
    step_s = (time.perf_counter() - start) / p["steps"]
    return {"step_s": round(step_s, 5), "steps_timed": p["steps"],
            "tokens_per_s": round(p["batch_size"] * p["seq_len"] / step_s, 1)}


def _baseline(p: dict) -> dict:
    """A bare bf16 forward (p["kind"] "forward") or a plain PEFT LoRA r16 training step ("peft") of the model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(p["model"], dtype=torch.bfloat16).to(p["device"])
    model.config.use_cache = False
    ids = torch.randint(0, p["tokenizer_vocab"], (p["batch_size"], p["seq_len"]), device=p["device"])
    if p["kind"] == "forward":
        model.eval()

        @torch.no_grad()
        def step():
            model(input_ids=ids)
    else:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS))
        model.train()
        optimizer = torch.optim.AdamW([t for t in model.parameters() if t.requires_grad], lr=1e-4)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return _timed(step, p)


PROFILE_WAIT, PROFILE_STEPS = 20, 5  # optimizer steps skipped (compile, warm-up), then recorded


def _profiled(argv: list[str], table_path: str) -> tuple[int, dict]:
    """Run a `qat-lora train` command line under torch.profiler, stepped by every optimizer step (a global
    post-step hook): PROFILE_STEPS steps after PROFILE_WAIT + 2. Returns its exit code and the kernel summary."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    from qat_lora.commands.cli import main

    marks: list[float] = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, schedule=schedule(wait=PROFILE_WAIT, warmup=2, active=PROFILE_STEPS))

    def step(*_):
        marks.append(time.perf_counter())
        prof.step()

    hook = register_optimizer_step_post_hook(step)
    try:
        with prof:
            code = main(argv)
    finally:
        hook.remove()
    first = PROFILE_WAIT + 2  # marks[i] is the end of optimizer step i + 1
    if len(marks) < first + PROFILE_STEPS:
        return code, {"error": f"only {len(marks)} optimizer steps; the profile needs {first + PROFILE_STEPS}"}
    averages = prof.key_averages()
    cuda = torch.cuda.is_available()
    key = "self_cpu_time_total" if not cuda else \
        "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    Path(table_path).write_text(averages.table(sort_by=key, row_limit=60, max_name_column_width=90))
    # The host's side (what launches the kernels, Python included under each op): by self CPU time.
    Path(table_path).with_name(Path(table_path).stem + "_cpu.txt").write_text(
        averages.table(sort_by="self_cpu_time_total", row_limit=80, max_name_column_width=90))
    # On a GPU only the kernels themselves (device events): an op's row repeats its kernels' time.
    from torch.autograd import DeviceType

    rows = sorted(((e.key, getattr(e, key), e.count) for e in averages if getattr(e, key) > 0 and
                   (not cuda or e.device_type == DeviceType.CUDA)), key=lambda t: -t[1])
    device_us = sum(t for _, t, _ in rows)
    wall_us = (marks[first + PROFILE_STEPS - 1] - marks[first - 1]) * 1e6
    return code, {"profiled_steps": PROFILE_STEPS, "step_ms": round(wall_us / PROFILE_STEPS / 1e3, 2),
                  "device_busy_ms_per_step": round(device_us / PROFILE_STEPS / 1e3, 2),
                  "device_busy_share": round(device_us / wall_us, 3),
                  "top": [{"name": n[:120], "ms_per_step": round(t / PROFILE_STEPS / 1e3, 3), "calls_per_step":
                           round(c / PROFILE_STEPS, 1), "share": round(t / device_us, 4)} for n, t, c in rows[:25]]}


def _child(record_path: str, argv: list[str]) -> int:
    """Run one stage (a qat-lora command line, or `setup` / `baseline` with JSON parameters) in this process and
    write its exit code, peak memory and result to `record_path`."""
    code, result = 1, {}
    try:
        if argv[0] in ("setup", "baseline"):
            result = (_make_assets if argv[0] == "setup" else _baseline)(json.loads(argv[1]))
            code = 0
        elif argv[0] == "profile":
            code, result = _profiled(argv[2:], argv[1])
        else:
            from qat_lora.commands.cli import main

            code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # the record still says how far it got; the parent reads the traceback from the log
        traceback.print_exc()
    import torch

    cuda = torch.cuda.is_initialized()  # this process's tensors only; the reserved figure is what nvidia-smi sees
    Path(record_path).write_text(json.dumps({
        "child_rc": code, "gpu_peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
        "gpu_reserved_peak_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1) if cuda else None,
        "host_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "result": result}))
    return code or 0


# ---- the parent: stage plan, records and report ----

def _scalars(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float, str, bool)) or v is None}


def _run_stage(name: str, argv: list[str], work: Path, timeout: float) -> dict:
    record_path, log = work / "stages" / f"{name}.json", work / "logs" / f"{name}.log"
    record_path.unlink(missing_ok=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        try:
            rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(record_path), "--",
                                 *argv], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout,
                                env={**os.environ, **CHILD_ENV}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    record = {"rc": rc, "wall_s": round(time.perf_counter() - start, 2), "argv": argv,
              **(json.loads(record_path.read_text()) if record_path.exists() else {})}
    if rc != 0:
        tail = [line for line in re.split(r"[\r\n]+", log.read_text(errors="replace")) if line.strip()][-25:]
        record["error"] = ("timed out: the time budget (--budget-s) ran out during this stage" if rc == 124
                           else tail[-1] if tail else f"exit code {rc}, no output")
        record["log_tail"] = tail
    return record


def _grep(log: Path, pattern: str) -> float | None:
    found = re.findall(pattern, log.read_text(errors="replace")) if log.exists() else []
    return float(found[-1]) if found else None


def _phases(log: Path, prefix: str) -> dict:
    """{phase: seconds} from the last line starting with `prefix` that lists them ("..., hessians 1.2 s, ...")."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if prefix in line] if log.exists() else []
    return {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", lines[-1])} if lines else {}


def _stage_results(name: str, record: dict, work: Path, ctx: dict) -> None:
    """Add the stage's own figures (its report files and log lines) to `record`; tokens/s and MFU where they apply."""
    log, res, flops = work / "logs" / f"{name}.log", record.setdefault("result", {}), None
    if name in ("forward", "peft"):
        flops = 2 if name == "forward" else 4
    elif name == "cache":
        from qat_lora.cache.reader import inspect_cache

        info = inspect_cache(work / "cache")
        tokens, loop_s = sum(v or 0 for v in info["tokens"].values()), _grep(log, r"shards written in ([\d.]+) s")
        res.update(tokens=tokens, tokens_by_split=info["tokens"], bytes_per_token=info["bytes_per_token"],
                   teacher_loop_s=loop_s, tokens_per_s=round(tokens / loop_s, 1) if loop_s else None)
        flops = 2
    elif name == "quantize":
        report = json.loads((work / "init" / "quantize.json").read_text())
        res.update(_scalars(report), gptq_phases={k: round(v, 2) for k, v in report.get("gptq", {}).get("phases", {}).items()})
    elif name == "train" or name in TRAIN_VARIANTS:
        from qat_lora.runtime.runs import read_metrics

        run = work / ("run" if name == "train" else name)
        summary = json.loads((run / "summary.json").read_text())
        records = read_metrics(run)[0]
        steady = [r["tokens_per_s"] for r in records[1:]] or [summary["tokens_per_s"]]  # the first warms up
        res.update(_scalars(summary), loop_tokens_per_s=summary["tokens_per_s"],
                   tokens_per_s=round(statistics.median(steady), 1),
                   calibrated_init_s=_grep(log, r"calibrated LoRA init: .*\((\d+) s"),
                   calibrated_init_phases=_phases(log, "calibrated LoRA init: "),
                   first_loss=records[0]["loss"] if records else None, last_loss=records[-1]["loss"] if records else None)
        flops = 4
    elif name == "generate":
        report = json.loads((work / "self" / "generate.json").read_text())
        res.update(_scalars(report), overall_tokens_per_s=round(report["generated_tokens"] / max(report["seconds"], 1e-9), 1),
                   tokens_per_s=report.get("tokens_per_s_after_first_shard"))
        flops = 2  # a decode step's forward (the prompt's prefill not counted)
    elif name == "eval":
        res.update(_scalars(json.loads((work / "eval.json").read_text())))
    elif name == "export":
        report = json.loads((work / "export" / "export.json").read_text())
        res.update(_scalars(report), format=ctx["export_format"],
                   bytes=sum(f.stat().st_size for f in (work / "export").rglob("*") if f.is_file()))
    tokens_per_s = res.get("tokens_per_s")
    if flops and tokens_per_s and ctx.get("parameters"):
        record["tokens_per_s"] = tokens_per_s
        record["mfu"] = float(f"{flops * ctx['parameters'] * tokens_per_s / (ctx['peak_tflops'] * 1e12):.3g}")


def _git_commit() -> str | None:
    """The commit, with `-dirty` when the tree holds uncommitted changes; None without git or .git."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _prepare_work(work: Path) -> None:
    """An empty --work; a rerun replaces only a folder this script made (its marker file proves it)."""
    if work.exists() and any(work.iterdir()):
        if not (work / MARKER).exists():
            raise SystemExit(f"gpu_check: --work {work} holds files this script did not write; pick another folder")
        shutil.rmtree(work)
    for sub in ("stages", "logs"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("benchmarks/gpu_check.py work folder; replaced by its next run\n")


def _command_lines(a, s: dict, work: Path, ctx: dict) -> dict:
    """Each stage's command line, built when the stage starts (later ones use what earlier ones left)."""
    model, cache, dev = str(work / "model"), str(work / "cache"), a.device
    shape = {"batch_size": s["batch_size"], "seq_len": s["seq_len"], "device": dev, "model": model,
             "tokenizer_vocab": ctx.get("tokenizer_vocab", 256), "steps": min(BASELINE_STEPS, s["steps"])}
    quantizer, adapter = work / "init" / "quantizer.safetensors", work / "run" / "adapter"
    student = ["--adapter", str(adapter)] if adapter.is_dir() else \
        ["--quant", QUANT] + (["--quantizer", str(quantizer)] if quantizer.exists() else [])
    export_format = ["--format", "gguf", "--gguf-requantize"] if ctx["export_format"] == "gguf" else \
        ["--format", ctx["export_format"]]
    return {
        "setup": lambda: ["setup", json.dumps({"work": str(work), "shape": a.shape, "device": dev, "seed": a.seed,
                                               **{k: s[k] for k in ("cache_tokens", "ppl_tokens", "tokenizer_vocab")}})],
        "forward": lambda: ["baseline", json.dumps({**shape, "kind": "forward"})],
        "peft": lambda: ["baseline", json.dumps({**shape, "kind": "peft"})],
        "cache": lambda: ["build-cache", "--teacher", model, "--data", str(work / "data" / "train"), "--out", cache,
                          "--seq-len", str(s["seq_len"]), "--max-tokens", str(s["cache_tokens"]),
                          "--batch-size", str(s["batch_size"]), "--holdout-fraction", str(s["holdout_fraction"]),
                          "--device", dev, "--dtype", "bf16"],
        "quantize": lambda: ["quantize", "--model", model, "--quant", QUANT, "--init", "gptq", "--cache", cache,
                             "--calib-sequences", str(s["calib_sequences"]), "--batch-size", str(s["batch_size"]),
                             "--out", str(work / "init"), "--device", dev],
        "train": lambda: ["train", "--model", model, "--quant", QUANT, "--cache", cache, "--out", str(work / "run"),
                          *(["--quantizer", str(quantizer)] if quantizer.exists() else []),
                          "--preset", "recovery-lora", "--lora-r", str(LORA_R), "--lora-init", "calibrated",
                          "--lora-init-sequences", str(s["calib_sequences"]), "--max-steps", str(s["steps"]),
                          "--batch-size", str(s["batch_size"]), "--precision", "bf16", "--device", dev,
                          "--log-steps", str(max(1, min(50, s["steps"] // 10))), *a.train_args.split()],
        **{name: (lambda name=name, flags=flags: [
            "train", "--model", model, "--quant", QUANT, "--cache", cache, "--out", str(work / name),
            *(["--quantizer", str(quantizer)] if quantizer.exists() else []), "--preset", "recovery-lora",
            "--lora-r", str(LORA_R), "--max-steps", str(s["variant_steps"]), "--batch-size", str(s["batch_size"]),
            "--precision", "bf16", "--device", dev, "--log-steps", str(max(1, s["variant_steps"] // 10)), *flags])
           for name, flags in TRAIN_VARIANTS.items()},
        "profile": lambda: ["profile", str(work / "logs" / "profile_table.txt"), "train", "--model", model,
                            "--quant", QUANT, "--cache", cache, "--out", str(work / "profile"),
                            *(["--quantizer", str(quantizer)] if quantizer.exists() else []), "--preset",
                            "recovery-lora", "--lora-r", str(LORA_R), "--max-steps",
                            str(max(s["variant_steps"], PROFILE_WAIT + 2 + PROFILE_STEPS)),
                            "--batch-size", str(s["batch_size"]), "--precision", "bf16", "--device", dev,
                            "--log-steps", "10", *a.train_args.split()],
        "generate": lambda: ["generate-data", "--model", model, "--data", str(work / "data" / "train"),
                             "--out", str(work / "self"), "--tokens", str(s["generate_tokens"]),
                             "--max-new-tokens", "128", "--batch-size", str(GENERATE_BATCH[a.shape]),
                             "--shard-samples", str(GENERATE_BATCH[a.shape]), "--device", dev],
        "eval": lambda: ["eval", "--model", model, *student, "--cache", cache, "--text", str(work / "data" / "heldout.txt"),
                         "--seq-len", str(s["seq_len"]), "--max-tokens", str(s["ppl_tokens"]),
                         "--batch-size", str(s["batch_size"]), "--device", dev, "--precision", "bf16",
                         "--json-out", str(work / "eval.json")],
        "export": lambda: ["export", "--model", model, *student, "--out", str(work / "export"), *export_format],
    }


def _table(report: dict) -> str:
    rows = [f"{'stage':11s} {'rc':>4s} {'wall_s':>8s} {'gpu_MiB':>9s} {'host_MiB':>9s} {'tok/s':>10s} {'mfu':>7s}  note"]
    for name, r in report["stages"].items():
        gpu, tps, mfu = r.get("gpu_peak_mib"), r.get("tokens_per_s"), r.get("mfu")
        rows.append(f"{name:11s} {str(r.get('rc')):>4s} {r.get('wall_s', 0):8.1f} "
                    f"{'-' if gpu is None else f'{gpu:.0f}':>9s} {r.get('host_peak_rss_mib') or 0:9.0f} "
                    f"{'-' if tps is None else f'{tps:,.0f}':>10s} {'-' if mfu is None else f'{mfu:.1%}':>7s}  "
                    f"{r.get('error') or r.get('skipped') or ''}"[:160])
    rows += [f"{k}: {v}" for k, v in report["ratios"].items()]
    rows += [f"chain (cache, quantize, train, eval, export): {report['chain_s']} s"] if "chain_s" in report else []
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke run)")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES), help="tiny: a 2-layer hidden-64 model")
    for flag in ("steps", "cache-tokens", "calib-sequences", "batch-size", "seq-len"):
        p.add_argument(f"--{flag}", type=int, help="default: per --shape (SIZES)")
    p.add_argument("--work", default="runs/gpu_check", help="scratch folder (replaced by a rerun)")
    p.add_argument("--json", help="the report (default: WORK/gpu_check.json)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100 SXM: 989)")
    p.add_argument("--budget-s", type=float, default=480.0, help="no stage starts or runs past this many seconds")
    p.add_argument("--skip", nargs="*", default=[], choices=STAGES[1:], metavar="STAGE", help=" ".join(STAGES[1:]))
    p.add_argument("--train-args", default="", help="extra `qat-lora train` flags, e.g. '--storage-dtype bf16'")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    s = {**SIZES[a.shape], **{k: v for k, v in vars(a).items() if k in SIZES[a.shape] and v is not None}}
    s["variant_steps"] = min(s["variant_steps"], s["steps"])
    work = Path(a.work).resolve()
    _prepare_work(work)
    json_path = Path(a.json) if a.json else work / "gpu_check.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    ctx = {"peak_tflops": a.peak_tflops, "export_format": "gguf" if importlib.util.find_spec("gguf") else "dense"}
    report = {"script": "benchmarks/gpu_check.py", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "git_commit": _git_commit(), "card": None, "device": a.device, "shape": a.shape, "quant": QUANT,
              "lora_r": LORA_R, "sizes": s, "peak_tflops": a.peak_tflops, "export_format": ctx["export_format"],
              "versions": {"python": sys.version.split()[0], **{k: _version(k) for k in (
                  "torch", "transformers", "peft", "tokenizers", "safetensors", "qat-lora", "gguf")}}, "stages": {}, "ratios": {}}
    deadline = time.monotonic() + a.budget_s
    for name in STAGES:
        missing = [n for n in NEEDS.get(name, []) if report["stages"].get(n, {}).get("rc") != 0]
        left = deadline - time.monotonic()
        why = ("--skip" if name in a.skip else f"needs {', '.join(missing)}" if missing
               else "time budget (--budget-s) spent" if left < 1 else None)
        print(f"== {name}" + (f": skipped ({why})" if why else " ..."), flush=True)
        record = {"rc": None, "skipped": why} if why else _run_stage(name, _command_lines(a, s, work, ctx)[name](),
                                                                       work, left)
        if record["rc"] == 0:
            try:
                _stage_results(name, record, work, ctx)
            except Exception as e:  # a report that does not read is this stage's failure, not the run's
                record.update(rc=1, error=f"reading the stage's report: {type(e).__name__}: {e}")
        if name == "setup" and record["rc"] == 0:
            ctx.update(record["result"])
            report["card"], report["parameters"] = ctx["card"], ctx["parameters"]
        report["stages"][name] = record
        tps = {k: report["stages"].get(k, {}).get("tokens_per_s") for k in ("train", "peft", "cache", "forward",
                                                                              *TRAIN_VARIANTS)}
        report["ratios"] = {f"{x}_vs_{y}": round(tps[x] / tps[y], 3) for x, y in (
            ("train", "peft"), ("cache", "forward"), ("train", "train_eager"), ("train", "train_fp32"),
            ("train_eager", "peft"), ("train_fp32", "peft"), ("train_graphs", "train"), ("train_graphs", "peft"))
            if tps[x] and tps[y]}
        if all(report["stages"].get(k, {}).get("rc") == 0 for k in CHAIN):
            report["chain_s"] = round(sum(report["stages"][k]["wall_s"] for k in CHAIN), 1)
        tmp = json_path.with_suffix(".tmp")  # after every stage: a killed run keeps what it measured
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, json_path)
        if not why:
            print(f"   rc={record['rc']} wall={record['wall_s']} s tok/s={record.get('tokens_per_s')} "
                  f"gpu_MiB={record.get('gpu_peak_mib')} {record.get('error', '')}", flush=True)
    print(f"\ncard: {report['card']}  parameters: {report.get('parameters')}  export: {ctx['export_format']}")
    print(_table(report))
    print(f"written {json_path}")
    failed = [n for n, r in report["stages"].items() if r["rc"] not in (0, None) or r.get("skipped", "--skip") != "--skip"]
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--child" and sys.argv[3] == "--":
        sys.exit(_child(sys.argv[2], sys.argv[4:]))
    sys.exit(main())
