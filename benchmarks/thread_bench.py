"""Intra-op threads on a CPU that another process keeps busy: the demo's training step under each thread policy.

    python benchmarks/thread_bench.py --model ~/.cache/qat-lora/assets/smollm2-135m-instruct --busy 1 \
        --steps 3 --batch-size 1 --seq-len 256

The step is the demo's student: SmolLM2-135M at w3g64 + LoRA r = 16, forward + cross-entropy + backward (the KD
loss costs the same lm_head work) on --batch-size x --seq-len tokens (the demo's: 4 x 256). Each configuration (torch threads, OMP_WAIT_POLICY) runs in
its own process, after `--busy` processes that spin one core each (as `yes > /dev/null` does) have started;
they are stopped at the end. One warm-up step, then the median of --steps. Results: docs/BENCHMARKS.md, the
demo section.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = ({"threads": 2}, {"threads": 1}, {"threads": 2, "wait": "PASSIVE"})


def _child(model_path: str, threads: int, steps: int, batch_size: int, seq_len: int) -> None:
    import torch

    from qat_lora.data.models import load_causal_lm
    from qat_lora.quant.fake_quant import quantize_
    from qat_lora.train.lora import add_recovery_lora_

    torch.set_num_threads(threads)
    model = add_recovery_lora_(quantize_(load_causal_lm(model_path), "w3g64"), r=16, alpha=32.0)
    ids = torch.randint(0, 40_000, (batch_size, seq_len))
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - start)
    print(json.dumps({"step_s": statistics.median(times[1:])}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the teacher folder (fetch-assets)")
    parser.add_argument("--busy", type=int, default=1, help="processes spinning one core each")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # a configuration's threads
    args = parser.parse_args()
    if args.child:
        return _child(args.model, args.child, args.steps, args.batch_size, args.seq_len)
    spinners = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.busy)]
    try:
        for config in CONFIGS:
            env = {**os.environ, **({"OMP_WAIT_POLICY": config["wait"]} if "wait" in config else {})}
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                                  "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                                  "--child", str(config["threads"])], env=env, capture_output=True, text=True,
                                 check=True).stdout.splitlines()[-1]
            print(json.dumps({**config, "busy": args.busy, "load_before": round(load, 2), **json.loads(out)}),
                  flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


if __name__ == "__main__":
    main()
