"""What each kind of KD target costs per training step and per cached token (issue 30): the same trainer, model,
tokens and flags, trained from a top-K cache, a sampled cache, or an online teacher (`train --online-teacher`:
the teacher runs inside the step, no target bytes).

    flock /tmp/qat-bench.lock python benchmarks/target_bench.py --teacher <assets>/smollm2-135m-instruct \
        --variant top32:runs/recovery/caches/topk-k32-... --variant online:runs/recovery/caches/topk-k32-... \
        --json docs/results/target_steps.json

Each `--variant NAME:CACHE` is one `qat-lora train` subprocess of --steps steps (a name starting with `online`
trains with --online-teacher --teacher on that cache's tokens); its step time is the median of the per-step wall
times in metrics.jsonl after the first --skip steps (start-up and warm-up excluded). --rounds > 1 runs the
variants in turn again (ABC ABC), so that a change in the host's load reaches every variant alike; the reported
step time is the median over rounds. bytes/token is the cache's (`cache inspect`): every target byte plus the
token's own 5 (int32 id, mask byte); an online variant reads only those 5. The quality of each target at the
recovery budget is benchmarks/recovery.py's (rows lora-topk-tail, lora-topk-wide, lora-sampled, lora-online).
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

from qat_lora.cache.reader import TOKEN_BYTES

ROOT = Path(__file__).resolve().parents[1]


def step_seconds(run: Path, skip: int) -> float:
    """Median wall seconds between consecutive logged steps after the first `skip` (metrics.jsonl, log_steps 1)."""
    elapsed = [r["elapsed_s"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    gaps = [b - a for a, b in zip(elapsed[skip:], elapsed[skip + 1:])]
    if not gaps:
        raise ValueError(f"{run}: fewer than {skip + 2} logged steps; raise --steps")
    return statistics.median(gaps)


def train_variant(args: argparse.Namespace, name: str, cache: str, out: Path) -> float:
    flags = ["--model", args.teacher, "--cache", cache, "--quant", args.quant, "--out", str(out), "--max-steps",
             str(args.steps), "--batch-size", str(args.batch_size), "--lora-r", str(args.lora_r), "--lora-alpha",
             str(2.0 * args.lora_r), "--lr", str(args.lr), "--log-steps", "1", "--device", "cpu", "--overwrite"]
    if name.startswith("online"):
        flags += ["--online-teacher", args.teacher]
    result = subprocess.run([sys.executable, "-m", "qat_lora", "train", *flags], capture_output=True, text=True,
                            timeout=3600)
    if result.returncode != 0:
        raise ValueError(f"--variant {name}:{cache}: training failed: {result.stderr.strip().splitlines()[-1]}")
    return step_seconds(out, args.skip)


def parse_variants(specs: list[str]) -> dict[str, str]:
    variants = {}
    for spec in specs:
        name, _, cache = spec.partition(":")
        if not name or not (Path(cache) / "manifest.json").is_file():
            raise ValueError(f"--variant {spec}: pass NAME:CACHE_FOLDER (a folder with a manifest.json)")
        variants[name] = cache
    return variants


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", required=True, help="full-precision model (student base and online teacher)")
    p.add_argument("--variant", action="append", required=True, help="NAME:CACHE; NAME online*: --online-teacher")
    p.add_argument("--quant", default="w3g64")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the median")
    p.add_argument("--rounds", type=int, default=1, help="times every variant runs, in turn")
    p.add_argument("--work", type=Path, default=Path("/tmp/target_bench"), help="run folders")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args(argv)
    try:
        variants = parse_variants(args.variant)
    except ValueError as e:
        p.error(str(e))
    from qat_lora.cache.reader import inspect_cache

    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        for name, cache in variants.items():
            times[name].append(train_variant(args, name, cache, args.work / f"{name}-{round_}"))
            print(f"{name} round {round_}: {times[name][-1]:.2f} s/step", flush=True)
    rows = []
    for name, cache in variants.items():
        info = inspect_cache(cache)
        online = name.startswith("online")
        rows.append({"variant": name, "cache": Path(cache).name, "encoding": {"name": "online"} if online else
                     info["encoding"], "bytes_per_token": TOKEN_BYTES if online else info["bytes_per_token"],
                     "step_s": round(statistics.median(times[name]), 3), "step_s_rounds": [round(t, 3) for t in
                                                                                          times[name]],
                     "tokens_per_step": args.batch_size * info["seq_len"]})
    base = rows[0]["step_s"]
    for row in rows:
        row["step_time_vs_first"] = round(row["step_s"] / base, 3)
    result = {"date": time.strftime("%Y-%m-%d"), "host": {"cpu_count": os.cpu_count(), "threads":
              torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__},
              "settings": {k: v for k, v in vars(args).items() if k not in ("variant", "work", "json")}, "rows": rows}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"target_bench.py: error: {e}")
