"""What --loss-chunk-size costs on XLA: the lm_head + KD loss (forward and backward) of one step, as the trainer
runs it, compiled for several chunk sizes. The chunk loop is unrolled into the graph, so its size and compile
time grow with the number of chunks; peak memory grows with the chunk (DESIGN §6, README "--loss-chunk-size").

    PJRT_DEVICE=CPU python benchmarks/xla_loss_chunk.py --positions 2048 --chunks 128 1024 0 --json /tmp/chunks.json

Each chunk size runs in its own process (compile counters are process-wide). Reported per chunk size: HLO
instructions of the step's graph, graphs compiled, compile seconds, and the median time of 3 executions after
the compile. Random weights and targets of the SmolLM2-135M head shape (V = 49,152, d = 576), fp32, top-64.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = """
import json, sys, time
import torch, torch_xla
import torch_xla.core.xla_model as xm
from qat_lora.runtime import device as dev
from qat_lora.runtime import xla
from qat_lora.train.loss import KDLossConfig, kd_loss_chunked

positions, chunk, vocab, hidden, k = map(int, sys.argv[1:6])
device = torch_xla.device()
g = torch.Generator().manual_seed(0)
h = torch.randn(1, positions, hidden, generator=g).to(device).requires_grad_()
w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device).requires_grad_()
batch = {"input_ids": torch.randint(0, vocab, (1, positions), generator=g),
         "attention_mask": torch.ones(1, positions, dtype=torch.uint8),
         "topk_ids": torch.randint(0, vocab, (1, positions, k), generator=g),
         "topk_logprobs": torch.log_softmax(torch.randn(1, positions, k, generator=g), -1)}
batch = {key: v.to(device) for key, v in batch.items()}

def step():
    out = kd_loss_chunked(h, w, batch, KDLossConfig(), chunk or positions)
    out["loss"].backward()
    return [out["loss"], h.grad, w.grad]

hlo = torch_xla._XLAC._get_xla_tensors_hlo(step())
instructions = sum(1 for line in hlo.splitlines() if " = " in line)
h.grad = w.grad = None
times = []
for _ in range(4):
    started = time.perf_counter()
    dev.to_host(step()[:1])
    times.append(time.perf_counter() - started)
    h.grad = w.grad = None
print(json.dumps({"chunk": chunk, "hlo_instructions": instructions, **xla.compile_metrics(),
                  "first_step_s": times[0], "step_s": sorted(times[1:])[1]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, default=2048, help="B x L positions of one step")
    parser.add_argument("--chunks", type=int, nargs="+", default=[128, 1024, 0], help="chunk sizes (0 = one chunk)")
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--json", default="", help="also write the records here")
    args = parser.parse_args()
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    records = []
    for chunk in args.chunks:
        result = subprocess.run([sys.executable, "-c", CHILD, str(args.positions), str(chunk), str(args.vocab),
                                 str(args.hidden), str(args.top_k)], env=env, capture_output=True, text=True, check=True)
        record = json.loads(result.stdout.strip().splitlines()[-1])
        records.append(record)
        print(f"chunk {chunk or args.positions:5d}: {record['hlo_instructions']:6d} HLO instructions, "
              f"{record['graphs_compiled']} graph(s) compiled in {record['compile_seconds']:.1f} s, "
              f"step {record['step_s']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"positions": args.positions, "vocab": args.vocab, "hidden": args.hidden,
                       "top_k": args.top_k, "date": time.strftime("%Y-%m-%d"), "records": records}, f, indent=2)


if __name__ == "__main__":
    main()
