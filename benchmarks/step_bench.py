"""Training-step benchmark: loss memory (naive vs chunked lm_head + loss) and step throughput / MFU.

    python benchmarks/step_bench.py --shape smollm2-135m --batch-size 2 --seq-len 256 \
        --json docs/results/step_bench.json

Random weights from a config of the named shape (speed does not depend on the values). Each loss-memory
figure runs in its own subprocess: peak resident memory on the CPU (ru_maxrss, minus the process's
baseline) or torch.cuda.max_memory_allocated on a GPU. MFU is achieved FLOP/s over a peak: the GPU's
datasheet bf16 figure when given (--peak-tflops), else the fp32 matrix-multiply rate measured here first.
FLOPs per token of a frozen-base LoRA step: 2N forward + 2N backward (activation gradients only), N = the
parameters of the linears and lm_head (attention scores excluded: small at these lengths).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
}


def build_model(shape: str, seq_len: int, quant: str | None, lora_r: int, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    from qat_lora.lora import add_recovery_lora_
    from qat_lora.quant import quantize_

    params = dict(SHAPES[shape])
    config = AutoConfig.for_model(params.pop("model_type"), max_position_embeddings=max(seq_len, 2048), **params)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if quant:
        quantize_(model, quant)
        model = add_recovery_lora_(model, r=lora_r)
    else:  # plain nn.Linear + the same LoRA, straight through PEFT
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules=targets))
    return model.to(device).train()


def linear_flops_per_token(model) -> float:
    base = model.get_base_model()
    n = sum(m.weight.numel() for m in base.modules() if isinstance(m, torch.nn.Linear))
    return 4.0 * n


def _batch(vocab: int, batch_size: int, seq_len: int, top_k: int, device) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    logprobs = torch.log_softmax(torch.randn(batch_size, seq_len, top_k, generator=g), -1) - 1.0
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "topk_ids": torch.randint(0, vocab, (batch_size, seq_len, top_k), generator=g).to(device),
            "topk_logprobs": logprobs.sort(-1, descending=True).values.to(device)}


def time_steps(model, batch: dict, chunk: int, steps: int, device) -> list[float]:
    from qat_lora import device as dev
    from qat_lora.loss import KDLossConfig
    from qat_lora.train import forward_loss

    times = []
    for i in range(steps + 1):  # the first step warms up (allocations, caches)
        started = time.perf_counter()
        forward_loss(model, batch, KDLossConfig(), chunk)["loss"].backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - started)
    return times


def measured_matmul_flops(device: torch.device) -> float:
    a = torch.randn(1024, 1024, device=device)
    b = torch.randn(1024, 1024, device=device)
    a @ b
    started, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * 1024**3 * reps / (time.perf_counter() - started)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak(device: torch.device) -> int:
    """Baseline for a peak measurement (on the CPU, ru_maxrss only grows: one configuration per process)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return _peak_bytes(device)


def child(args) -> dict:
    """One configuration in a fresh process: `loss` (lm_head + loss alone) or `step` (a whole training step)."""
    from qat_lora.loss import KDLossConfig, kd_loss, kd_loss_chunked
    from qat_lora import device as dev

    device = torch.device(args.device)
    hidden_size, vocab = SHAPES[args.shape]["hidden_size"], SHAPES[args.shape]["vocab_size"]
    batch = _batch(vocab, args.batch_size, args.seq_len, 64, device)
    if args.child == "loss":
        hidden = torch.randn(args.batch_size, args.seq_len, hidden_size, device=device, requires_grad=True)
        weight = torch.randn(vocab, hidden_size, device=device) * 0.02
        base = _reset_peak(device)
        if args.chunk:
            out = kd_loss_chunked(hidden, weight, batch, KDLossConfig(), args.chunk)
        else:
            out = kd_loss(hidden @ weight.T, batch, KDLossConfig())
        out["loss"].backward()
        return {"peak_mem_bytes": int(_peak_bytes(device) - base)}
    quant = None if args.quant == "none" else args.quant
    model = build_model(args.shape, args.seq_len, quant, 16, device)
    base = _reset_peak(device)
    median = statistics.median(time_steps(model, batch, args.chunk, args.steps, device))
    tokens_per_s = args.batch_size * args.seq_len / median
    return {"step_s_median": round(median, 3), "tokens_per_s": round(tokens_per_s, 1),
            "flops_per_token": linear_flops_per_token(model), "peak_mem_bytes": int(_peak_bytes(device) - base)}


def run_child(args, kind: str, chunk: int, quant: str = "none") -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--chunk", str(chunk), "--quant", quant, "--shape", args.shape,
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--device", args.device]
    env = dict(os.environ)
    if kind == "loss" and args.device == "cpu":
        # glibc keeps freed blocks under its (adaptive) mmap threshold in the heap, so ru_maxrss would count
        # memory that is no longer live; mmap-ing every block over 64 KiB makes resident = live.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode:
        raise RuntimeError(f"{kind} chunk={chunk} quant={quant} failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="smollm2-135m")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--quant", default="w3g64")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="datasheet peak for MFU (0 = measure fp32 GEMM)")
    parser.add_argument("--json", default="docs/results/step_bench.json")
    parser.add_argument("--child", choices=("loss", "step"), help=argparse.SUPPRESS)
    parser.add_argument("--loss-only", action="store_true", help="only the loss peak-memory comparison")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    device = torch.device(args.device)
    peak = args.peak_tflops * 1e12 or measured_matmul_flops(device)
    naive_mem = run_child(args, "loss", 0)["peak_mem_bytes"]
    chunked_mem = run_child(args, "loss", args.chunk)["peak_mem_bytes"]
    records = []
    for quant in () if args.loss_only else ("none", args.quant):
        for chunk in (0, args.chunk):
            r = run_child(args, "step", chunk, quant)
            records.append({"shape": args.shape, "device": str(device), "linear": "nn.Linear" if quant == "none" else quant,
                            "preset": "recovery-lora", "loss": f"chunked({chunk})" if chunk else "naive",
                            "batch_size": args.batch_size, "seq_len": args.seq_len, **r,
                            "mfu": round(r["tokens_per_s"] * r["flops_per_token"] / peak, 4)})
    result = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "peak_flops": peak,
              "peak_source": "datasheet" if args.peak_tflops else "measured fp32 1024^3 matmul",
              "loss_peak_memory_ratio": round(chunked_mem / naive_mem, 4),
              "loss_peak_mem_bytes": {"naive": naive_mem, "chunked": chunked_mem}, "records": records}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"loss peak memory: naive {naive_mem / 2**20:.0f} MiB, chunked({args.chunk}) {chunked_mem / 2**20:.0f} MiB, "
          f"ratio {result['loss_peak_memory_ratio']}")
    print(f"{'linear':10s} {'loss':14s} {'step s':>8s} {'tok/s':>8s} {'MFU':>7s} {'peak MiB':>9s}")
    for r in records:
        print(f"{r['linear']:10s} {r['loss']:14s} {r['step_s_median']:8.3f} {r['tokens_per_s']:8.1f} {r['mfu']:7.2%} "
              f"{r['peak_mem_bytes'] / 2**20:9.0f}")


if __name__ == "__main__":
    main()
