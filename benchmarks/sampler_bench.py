"""What drawing the sampled cache's targets costs: one batch of logits, N draws per position.

    python benchmarks/sampler_bench.py --json docs/results/sampler_bench.json
    PJRT_DEVICE=CPU python benchmarks/sampler_bench.py --device xla --batch 2 --json docs/results/sampler_bench_xla.json

On the CPU it times, alternated in rounds on the same logits: `SampledEncoding.select` (inverse CDF with
searchsorted, the CPU/CUDA path), the `torch.multinomial` path it replaced (one generator per row), and the
blocked count XLA uses, run on the CPU. With `--device xla` it times `select` of the sampled encoding against
top-K's on the device (logits already there; the first call, which compiles, is left out). Medians, seconds.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from qat_lora.cache.encodings import SampledEncoding, TopKEncoding, blocked_count_at_most


def multinomial_draws(logits: torch.Tensor, seeds: list[int], n: int) -> list[torch.Tensor]:
    """The sampler before 2026-11-27: softmax, then torch.multinomial with one CPU generator per row."""
    probs = torch.softmax(logits.float(), dim=-1)
    return [torch.multinomial(p, n, replacement=True, generator=torch.Generator().manual_seed(s))
            for p, s in zip(probs, seeds)]


def blocked_draws(logits: torch.Tensor, n: int) -> torch.Tensor:
    cdf = torch.softmax(logits.float(), dim=-1).cumsum_(-1)
    return blocked_count_at_most(cdf, torch.rand(*cdf.shape[:-1], n) * cdf[..., -1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=49_152, help="SmolLM2's")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--top-k", type=int, default=64, help="--device xla: the top-K select to compare with")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=("cpu", "xla"))
    p.add_argument("--json", default="")
    args = p.parse_args()
    seeds = list(range(args.batch))
    logits = torch.randn(args.batch, args.seq_len, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    sampled = SampledEncoding(args.num_samples)
    if args.device == "xla":
        import torch_xla  # only here: the benchmark runs either way

        logits = logits.to(torch_xla.device())
        topk = TopKEncoding(args.top_k, 16)
        variants = {"sampled_select": lambda: sampled.select(logits, seeds),
                    f"top{args.top_k}_select": lambda: topk.select(logits, seeds)}
        for run in variants.values():
            run()  # compiles
    else:
        variants = {"inverse_cdf_select": lambda: sampled.select(logits, seeds),
                    "multinomial_before": lambda: multinomial_draws(logits, seeds, args.num_samples),
                    "blocked_count_on_cpu": lambda: blocked_draws(logits, args.num_samples)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    result = {"args": vars(args), "host": {"machine": platform.machine(), "threads": torch.get_num_threads(),
                                           "torch": torch.__version__},
              "median_s": {name: round(statistics.median(t), 4) for name, t in times.items()}, "times_s": times}
    print(json.dumps(result["median_s"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
