"""Trainer benchmarks (issue 5) on the CPU: our step time ÷ a plain transformers + PEFT LoRA step on the same
model and batch (goal <= 1.3), and the throughput of 1 vs 2 gloo processes.

    python benchmarks/train_bench.py --teacher /tmp/qat_assets/smollm2-135m-instruct \
        --text /tmp/qat_assets/text/train --json /tmp/train_bench.json

Every trainer run is a subprocess (`qat-lora train`, `scripts/train_recovery_lora_multi.py`); step times are the
median of the per-step wall times in metrics.jsonl after the first `--skip` steps (start-up and warm-up excluded).
The plain step is a transformers forward with `labels` (full-logit CE), backward and AdamW over PEFT LoRA on the
same linears, in this process. On a shared host, run it when the machine is otherwise idle.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _step_seconds(run: Path, skip: int) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in records if "loss" in r]
    return statistics.median(b - a for a, b in zip(elapsed[skip:], elapsed[skip + 1:]))


def _train(args, out: Path, num_chips: int) -> float:
    flags = ["--model", args.teacher, "--cache", str(args.work / "cache"), "--quant", args.quant, "--out", str(out),
             "--max-steps", str(args.steps), "--batch-size", str(args.batch_size), "--log-steps", "1",
             "--lora-r", str(args.lora_r), "--device", "cpu", "--overwrite"]
    cmd = ([sys.executable, str(ROOT / "scripts" / "train_recovery_lora_multi.py"), "--num-chips", str(num_chips)]
           if num_chips > 1 else [sys.executable, "-m", "qat_lora", "train"])
    subprocess.run(cmd + flags, check=True, capture_output=True, timeout=3600)
    return _step_seconds(out, args.skip)


def _plain_peft_step(args) -> float:
    """Median seconds of a plain transformers + PEFT LoRA step (no quantisation, no KD) on the cache's batches."""
    from peft import LoraConfig, get_peft_model

    from qat_lora.cache.reader import KDCache
    from qat_lora.runtime.host import tune_host_allocator
    from qat_lora.data.models import load_causal_lm

    tune_host_allocator()  # as `qat-lora train` does on the CPU: both sides run with the same allocator settings
    torch.manual_seed(0)
    model = load_causal_lm(args.teacher, attn_implementation="sdpa")
    targets = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and "lm_head" not in n})
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=targets))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batches = KDCache(args.work / "cache").batches("train", args.batch_size)
    times = []
    for _ in range(args.steps):
        ids = next(batches)["input_ids"]
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times[args.skip:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher", required=True, help="transformers folder of the model")
    parser.add_argument("--text", required=True, help="text folder for the KD cache")
    parser.add_argument("--work", type=Path, default=Path("/tmp/train_bench"), help="cache and run folders")
    parser.add_argument("--quant", default="w3g64")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    if not (args.work / "cache" / "manifest.json").exists():
        from qat_lora.cache.builder import build_cache
        from qat_lora.cache.config import CacheBuildConfig

        tokens = args.seq_len * args.batch_size * 2 * (args.steps + 2)
        build_cache(CacheBuildConfig(teacher=args.teacher, data=[args.text], out=str(args.work / "cache"),
                                     seq_len=args.seq_len, top_k=64, max_tokens=tokens, device="cpu"))
    ours = _train(args, args.work / "ours-1", 1)
    plain = _plain_peft_step(args)
    two = _train(args, args.work / "ours-2", 2)
    tokens = args.batch_size * args.seq_len
    result = {"host": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "model": args.teacher, "quant": args.quant, "seq_len": args.seq_len, "batch_size": args.batch_size,
              "lora_r": args.lora_r, "ours_step_s": ours, "plain_peft_step_s": plain, "ratio": ours / plain,
              "tokens_per_s_1_process": tokens / ours, "tokens_per_s_2_processes": 2 * tokens / two,
              "speedup_2_vs_1": (2 * tokens / two) / (tokens / ours)}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
