"""Training-step harness (issue 7): loss memory, step tokens/s, MFU and peak memory, cache build vs forward-only.

    python benchmarks/step_bench.py --shape smollm2-135m --batch-size 2 --seq-len 256 --steps 3 --rounds 3 \
        --devices cpu xla --json docs/results/step_bench.json
    python benchmarks/step_bench.py --batch-size 4 --seq-len 1024 --loss-only --json /tmp/loss_memory.json

Random weights from a config of the named shape (speed does not depend on the values). Every figure comes from
its own subprocess: allocator state and warm caches would carry over from one configuration to the next, XLA's
compile counters are process-wide and its runtime is fixed when it starts. One run measures, for one shape:
- loss memory: lm_head + top-64 KD loss alone (forward and backward), full logits ("naive") vs chunks of
  positions; `loss_peak_memory_ratio` = chunked / naive.
- training steps, one record per device x linear x preset x loss: plain nn.Linear + PEFT LoRA, or fake-quant
  linears (--quant) under each training preset (recovery-lora, qat, qat+lora; the QAT presets train the
  quantiser, which a plain Linear lacks); naive or chunked loss. A step is the trainer's: forward + KD loss under
  the trainer's autocast, backward, gradient clipping, AdamW, zero_grad(set_to_none=False), one sync.
  Warm-up steps come first (one; on XLA, until a step compiles no new graph), then the median of --steps.
- cache build vs teacher forward-only (cache_bench.throughput) on a random-weight teacher of the shape.
--accumulation-steps N: each step runs N micro-batches of --batch-size, as the trainer does (the QAT presets'
quantiser Wq built once per step, quant/fake_quant.quantized_weights_once_per_step), plus, for those presets, rows that
build Wq per micro-batch (`wq_once_per_step` false; `step_s_vs_wq_per_micro_batch` is the per-round ratio).
The step configurations run round-robin, --rounds times, so a change of machine load hits all alike; a record
holds the median over rounds, and its ratios (step_s_vs_plain, step_s_vs_naive) are medians of per-round ratios.

MFU = tokens/s x model FLOPs per token / peak FLOP/s. Model FLOPs per token of a training step (recomputation
not counted; Chowdhery et al. 2022, PaLM, App. B):
    4 N_frozen + 6 N_grad + 12 n_layers n_heads d_head L
N_frozen: weights of linears whose weight gets no gradient (2N forward + 2N for the activation gradient): the
lm_head, the plain or fake-quant base linears under LoRA. N_grad: linears that also need dL/dW (2N more): the
LoRA A and B matrices, and every fake-quant linear under qat / qat+lora, whose scale, zero and codebook
gradients are computed from dL/dWq = g^T x, a full [out x in] product per token. The last term is attention
(QK^T and AV: 4 L H d forward, twice that backward; full L x L, causality not halved). A teacher forward (the
cache rows) counts 2 N_all + 4 n_layers n_heads d_head L. Peak: --peak-tflops (a datasheet figure) or the fp32
1024^3 matmul rate measured on the device (XLA:CPU runs on the host CPU and shares its figure).

Peak memory: torch.cuda.max_memory_allocated on CUDA; elsewhere the process's peak resident set (VmHWM, restarted
through /proc/self/clear_refs once the model is built) minus what was resident then. A CPU step child first calls
`host.tune_host_allocator()`, as the trainer does, so its figure includes what glibc keeps for reuse (what the
trainer's process holds); the loss-memory children instead make resident = live (see run_child). The XLA:CPU
figure includes the compiler's memory (XLA:CPU has no allocator statistics). A cache row's peak spans the
alternating rounds, build_cache's own copy of the teacher included.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qat_lora.quant.fake_quant import get_preset
from qat_lora.train.config import TRAIN_PRESETS

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,  # smoke tests
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True),
}
DEVICES = ("cpu", "cuda", "xla")
LOSSES = ("naive", "chunked")
PLAIN = "nn.Linear"
TOP_K = 64
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_config(shape: str, seq_len: int):
    from transformers import AutoConfig

    params = dict(SHAPES[shape])
    return AutoConfig.for_model(params.pop("model_type"), max_position_embeddings=max(seq_len, 2048), **params)


def build_model(shape: str, seq_len: int, linear: str, preset: str, device: torch.device, lora_r: int = 16):
    """The student the trainer would build, with random weights: `linear` is PLAIN (nn.Linear + PEFT LoRA on
    the same projections) or a quantisation preset, made trainable by `preset` (train/student.make_trainable_)."""
    from transformers import AutoModelForCausalLM

    from qat_lora.quant.fake_quant import quantize_
    from qat_lora.train.student import make_trainable_, resolve_attn

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(shape, seq_len),
                                             attn_implementation=resolve_attn("auto", device))
    if linear != PLAIN:
        model = make_trainable_(quantize_(model, linear), preset, lora_r, 2.0 * lora_r)
    else:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules=LORA_TARGETS))
    return model.to(device).train()


def _attention_flops(config, seq_len: int) -> float:
    """Forward FLOPs per token of QK^T and AV over all layers (full L x L)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 4.0 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len


def step_flops_per_token(model, seq_len: int) -> float:
    """Model FLOPs per token of one training step: 4 N_frozen + 6 N_grad + attention (module docstring)."""
    from qat_lora.quant.fake_quant import FakeQuantLinear

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    total = 3.0 * _attention_flops(base.config, seq_len)
    for module in base.modules():
        if isinstance(module, torch.nn.Linear):
            weight_grad = module.trains() if isinstance(module, FakeQuantLinear) else module.weight.requires_grad
            total += (6.0 if weight_grad else 4.0) * module.weight.numel()
    return total


def forward_flops_per_token(model, seq_len: int) -> float:
    """Model FLOPs per token of a forward pass: 2 N_all + attention."""
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 2.0 * linears + _attention_flops(model.config, seq_len)


def _batch(vocab: int, batch_size: int, seq_len: int, device) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    logprobs = torch.log_softmax(torch.randn(batch_size, seq_len, TOP_K, generator=g), -1) - 1.0
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "topk_ids": torch.randint(0, vocab, (batch_size, seq_len, TOP_K), generator=g).to(device),
            "topk_logprobs": logprobs.sort(-1, descending=True).values.to(device)}


def _wait(device: torch.device) -> None:
    """Block until the device has finished the work queued so far (the step's wall time must include it)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()


def _graphs_compiled() -> int:
    from qat_lora.runtime import xla

    return xla.compile_metrics().get("graphs_compiled", 0)


def time_steps(model, batch: dict, chunk: int, steps: int, device: torch.device, accumulation: int = 1,
               wq_once: bool = True) -> tuple[list[float], int]:
    """Seconds of each of `steps` training steps (of `accumulation` micro-batches, as the trainer runs them:
    with `wq_once`, a trainable quantiser's Wq is built once per step) after the warm-up; returns (times,
    warm-up steps)."""
    from qat_lora.runtime import device as dev
    from qat_lora.runtime import precision
    from qat_lora.train.loss import KDLossConfig
    from qat_lora.quant.fake_quant import quantized_weights_once_per_step
    from qat_lora.train.loss import forward_loss

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    amp_dtype, loss_cfg = precision.autocast_dtype(device, "auto"), KDLossConfig()

    def step() -> float:
        started = time.perf_counter()
        with quantized_weights_once_per_step(model, enabled=wq_once and accumulation > 1) as backward_quantizers:
            for _ in range(accumulation):
                with precision.autocast(device, amp_dtype):
                    loss = forward_loss(model, batch, loss_cfg, chunk)["loss"]
                (loss / accumulation).backward()
            backward_quantizers()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dev.sync(device)
        _wait(device)
        return time.perf_counter() - started

    warmup = 0
    while True:  # at least one step (allocations, caches, optimizer state); on XLA, until nothing compiles
        compiled, warmup = _graphs_compiled(), warmup + 1
        step()
        if not dev.is_xla(device) or (warmup >= 2 and _graphs_compiled() == compiled) or warmup == 5:
            break
    return [step() for _ in range(steps)], warmup


def measured_matmul_flops(device: torch.device) -> float:
    a = torch.randn(1024, 1024, device=device)
    b = torch.randn(1024, 1024, device=device)
    a @ b
    _wait(device)
    started, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    _wait(device)
    return 2 * 1024**3 * reps / (time.perf_counter() - started)


def _proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (Linux), in bytes; OSError elsewhere."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise OSError(f"/proc/self/status has no {field}")


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    try:
        return _proc_status_bytes("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux, bytes on macOS


def _reset_peak(device: torch.device) -> int:
    """Start a peak measurement; returns its baseline (subtract it from `_peak_bytes`)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    try:  # Linux: restart the peak resident set (VmHWM) here, so the baseline is what is resident now
        Path("/proc/self/clear_refs").write_text("5")
        return _proc_status_bytes("VmRSS")
    except OSError:  # elsewhere the peak only grows (one measurement per process): the baseline is the peak so far
        return _peak_bytes(device)


def _child_device(name: str) -> tuple[torch.device, bool]:
    """The child's device; on the CPU the trainer's host-allocator tuning is applied first (returns whether)."""
    from qat_lora.runtime import device as dev
    from qat_lora.runtime import host

    device = dev.resolve_device(name)
    return device, host.tune_host_allocator() if device.type == "cpu" else False


def loss_child(spec: dict) -> dict:
    """lm_head + KD loss alone. On the CPU, the parent sets MALLOC_MMAP_THRESHOLD_ (see run_child) so that
    resident = live, and tune_host_allocator() is not called (it would keep freed blocks, and it is a no-op
    when that variable is set anyway): this figure compares the live peaks of the two loss forms."""
    from qat_lora.runtime import device as dev
    from qat_lora.train.loss import KDLossConfig, kd_loss, kd_loss_chunked

    device = dev.resolve_device(spec["device"])
    hidden_size, vocab = SHAPES[spec["shape"]]["hidden_size"], SHAPES[spec["shape"]]["vocab_size"]
    batch = _batch(vocab, spec["batch_size"], spec["seq_len"], device)
    hidden = torch.randn(spec["batch_size"], spec["seq_len"], hidden_size, device=device, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, device=device) * 0.02
    base = _reset_peak(device)
    if spec["chunk"]:
        out = kd_loss_chunked(hidden, weight, batch, KDLossConfig(), spec["chunk"], None)
    else:
        out = kd_loss(hidden @ weight.T, batch, KDLossConfig())
    out["loss"].backward()
    return {"peak_mem_bytes": int(_peak_bytes(device) - base)}


def step_child(spec: dict) -> dict:
    """One training-step configuration: median step time, FLOPs, peak memory (and XLA compile counts)."""
    from qat_lora.runtime import device as dev
    from qat_lora.runtime import precision, xla

    device, tuned = _child_device(spec["device"])
    model = build_model(spec["shape"], spec["seq_len"], spec["linear"], spec["preset"], device)
    batch = _batch(SHAPES[spec["shape"]]["vocab_size"], spec["batch_size"], spec["seq_len"], device)
    base = _reset_peak(device)
    times, warmup = time_steps(model, batch, spec["chunk"], spec["steps"], device, spec["accumulation"],
                               spec["wq_once"])
    compiled_after_warmup = _graphs_compiled()
    result = {"step_s": statistics.median(times), "warmup_steps": warmup, "host_allocator_tuned": tuned,
              "flops_per_token": step_flops_per_token(model, spec["seq_len"]),
              "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "precision": str(precision.autocast_dtype(device, "auto") or torch.float32).removeprefix("torch."),
              "peak_mem_bytes": int(_peak_bytes(device) - base)}
    if dev.is_xla(device):
        import torch_xla.runtime as xr

        result["compile"] = {**xla.compile_metrics(), "graphs_compiled_timed": _graphs_compiled() -
                             compiled_after_warmup, "pjrt_device": xr.device_type()}
    return result


def _synthetic_teacher(shape: str, seq_len: int, folder: Path, tokens: int) -> Path:
    """A random-weight teacher of `shape` saved as a transformers folder, a byte-level tokenizer (every byte a
    token, ids < 257), and a text folder of at least `tokens` bytes of pseudo-words."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(model_config(shape, seq_len)).save_pretrained(folder / "teacher")
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab={**vocab, "<|endoftext|>": len(vocab)}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(folder / "teacher")
    rng, words = random.Random(0), ["".join(random.Random(i).choices("etaoinshrdlu", k=1 + i % 7)) for i in range(200)]
    docs = [" ".join(rng.choices(words, k=120)) for _ in range(tokens // 500 + 2)]  # ~500 bytes per document
    (folder / "text").mkdir()
    (folder / "text" / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    return folder


def cache_child(spec: dict) -> dict:
    """cache_bench.throughput on a random teacher of the shape: forward-only vs build_cache, alternated."""
    from cache_bench import throughput  # benchmarks/ is this script's folder, hence on sys.path
    from qat_lora.data import text as data
    from qat_lora.data import models

    device, tuned = _child_device(spec["device"])  # build_cache tunes too: the forward-only rounds must match
    with tempfile.TemporaryDirectory() as tmp:
        folder = _synthetic_teacher(spec["shape"], spec["seq_len"], Path(tmp), spec["tokens"])
        args = argparse.Namespace(teacher=str(folder / "teacher"), data=[str(folder / "text")], tokens=spec["tokens"],
                                  seq_len=spec["seq_len"], top_k=TOP_K, batch_size=spec["batch_size"],
                                  rounds=spec["rounds"], device=spec["device"])
        tokenizer, teacher = models.load_tokenizer(args.teacher), models.load_causal_lm(args.teacher).to(device)
        rows, mask = data.pack(data.token_stream(data.list_text_files(args.data), tokenizer, args.tokens), args.seq_len)
        base = _reset_peak(device)
        speed = throughput(args, teacher, rows, mask)
    return {**speed, "host_allocator_tuned": tuned, "peak_mem_bytes": int(_peak_bytes(device) - base),
            "flops_per_token": forward_flops_per_token(teacher, spec["seq_len"])}


CHILDREN = {"loss": loss_child, "step": step_child, "cache": cache_child}


def run_child(spec: dict) -> dict:
    env = dict(os.environ)
    if spec["device"] == "xla":
        env.setdefault("PJRT_DEVICE", "CPU")  # a TPU host sets PJRT_DEVICE=TPU itself
        env.setdefault("CPU_NUM_DEVICES", "1")
    else:
        env.setdefault("USE_TORCH_XLA", "0")  # accelerate (via peft) would import torch_xla: ~2 s, unused here
    if spec["kind"] == "loss" and spec["device"] == "cpu":
        # glibc keeps freed blocks under its (adaptive) mmap threshold in the heap, so the peak resident set
        # would count memory that is no longer live; mmap-ing every block over 64 KiB makes resident = live, which
        # is what the naive-vs-chunked comparison is about. The step children instead run with the trainer's
        # tuning (tune_host_allocator, a no-op when this variable is set), to measure what the trainer holds.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    started = time.perf_counter()
    result = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                            env=env)
    if result.returncode:
        raise RuntimeError(f"{json.dumps(spec)} failed: {result.stderr[-3000:]}")
    what = " ".join(str(spec[k]) for k in ("kind", "device", "linear", "preset", "chunk") if k in spec)
    what += " (Wq per micro-batch)" if spec.get("wq_once") is False else ""
    print(f"  {what}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def step_specs(args) -> list[dict]:
    """Every requested step configuration, in a fixed order (the reference rows first)."""
    common = dict(kind="step", shape=args.shape, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                  accumulation=args.accumulation_steps)
    specs = []
    for device in args.devices:
        for linear in (PLAIN, args.quant):
            for preset in args.presets:
                if linear == PLAIN and preset != "recovery-lora":
                    continue  # qat / qat+lora train the quantiser: a plain Linear has none
                for loss in args.losses:
                    chunk = args.chunk if loss == "chunked" else 0
                    spec = {**common, "device": device, "linear": linear, "preset": preset, "chunk": chunk}
                    specs.append({**spec, "wq_once": True})
                    if args.accumulation_steps > 1 and preset != "recovery-lora":  # the trained quantiser's Wq
                        specs.append({**spec, "wq_once": False})  # built per micro-batch: the comparison row
    return specs


def _loss_name(chunk: int) -> str:
    return f"chunked({chunk})" if chunk else "naive"


def _median_ratio(num: list[float] | None, den: list[float] | None) -> float | None:
    """Median over rounds of num[r] / den[r] (both measured in round r); None when either was not run."""
    if num is None or den is None or num is den:
        return None
    return round(statistics.median(a / b for a, b in zip(num, den)), 3)


def step_records(specs: list[dict], rounds: list[dict], peaks: dict[str, float]) -> list[dict]:
    """One record per configuration: medians over rounds, and ratios of per-round step times."""
    def key(spec, **change):
        s = {**spec, **change}
        return s["device"], s["linear"], s["preset"], s["chunk"], s["wq_once"]

    times = {key(s): [r[key(s)]["step_s"] for r in rounds] for s in specs}
    records = []
    for spec in specs:
        runs, step_s = [r[key(spec)] for r in rounds], statistics.median(times[key(spec)])
        tokens_per_s = spec["batch_size"] * spec["accumulation"] * spec["seq_len"] / step_s
        last = runs[-1]
        record = {"kind": "step", "shape": spec["shape"], "device": spec["device"], "linear": spec["linear"],
                  "quant": "none" if spec["linear"] == PLAIN else spec["linear"], "preset": spec["preset"],
                  "loss": _loss_name(spec["chunk"]), "batch_size": spec["batch_size"], "seq_len": spec["seq_len"],
                  "accumulation_steps": spec["accumulation"], "wq_once_per_step": spec["wq_once"],
                  "precision": last["precision"], "rounds": len(runs), "step_s_median": round(step_s, 6),
                  "step_s_per_round": [round(r["step_s"], 6) for r in runs], "tokens_per_s": round(tokens_per_s, 1),
                  "flops_per_token": last["flops_per_token"],
                  "mfu": round(tokens_per_s * last["flops_per_token"] / peaks[spec["device"]], 4),
                  "peak_mem_bytes": max(r["peak_mem_bytes"] for r in runs),
                  "step_s_vs_plain": _median_ratio(times[key(spec)],
                                                   times.get(key(spec, linear=PLAIN, preset="recovery-lora"))),
                  "step_s_vs_naive": _median_ratio(times[key(spec)], times.get(key(spec, chunk=0))),
                  "step_s_vs_wq_per_micro_batch": _median_ratio(times[key(spec)], times.get(key(spec, wq_once=False))),
                  "trainable_parameters": last["trainable_parameters"], "warmup_steps": last["warmup_steps"],
                  "host_allocator_tuned": last["host_allocator_tuned"]}
        if "compile" in last:
            record["compile"] = last["compile"]
        records.append(record)
    return records


def cache_record(args, device: str, peak: float) -> dict:
    r = run_child({"kind": "cache", "device": device, "shape": args.shape, "seq_len": args.seq_len,
                   "batch_size": args.batch_size, "tokens": args.cache_tokens, "rounds": args.rounds})
    return {"kind": "cache-build", "shape": args.shape, "device": device, "linear": PLAIN, "quant": "none",
            "preset": "teacher-forward", "loss": "none", "batch_size": args.batch_size, "seq_len": args.seq_len,
            "tokens_per_s": r["build_tokens_per_s"], "forward_only_tokens_per_s": r["forward_only_tokens_per_s"],
            "build_over_forward_median": r["build_over_forward_median"],
            "build_over_forward_per_round": r["build_over_forward_per_round"], "tokens": r["tokens"],
            "rounds": r["rounds"], "flops_per_token": r["flops_per_token"],
            "mfu": round(r["build_tokens_per_s"] * r["flops_per_token"] / peak, 4),
            "peak_mem_bytes": r["peak_mem_bytes"], "host_allocator_tuned": r["host_allocator_tuned"]}


def _peaks(args) -> dict[str, float]:
    """Peak FLOP/s per device: the datasheet figure if given, else a measured fp32 matmul (XLA:CPU = the host)."""
    if args.peak_tflops:
        return {d: args.peak_tflops * 1e12 for d in args.devices}
    measured = {d: measured_matmul_flops(torch.device(d)) for d in {"cpu" if d == "xla" else d for d in args.devices}}
    return {d: measured["cpu" if d == "xla" else d] for d in args.devices}


def print_summary(result: dict) -> None:
    mem = result["loss_peak_mem_bytes"]
    print(f"loss peak memory ({result['loss_memory_device']}): naive {mem['naive'] / 2**20:.0f} MiB, "
          f"{result['loss_memory_chunked']} {mem['chunked'] / 2**20:.0f} MiB, "
          f"ratio {result['loss_peak_memory_ratio']}")
    for r in (r for r in result["records"] if r["kind"] == "cache-build"):
        print(f"cache build ({r['device']}): {r['tokens_per_s']} tok/s vs forward-only "
              f"{r['forward_only_tokens_per_s']} tok/s: build / forward {r['build_over_forward_median']} "
              f"(rounds {r['build_over_forward_per_round']})")
    head = ("device", "linear", "preset", "loss", "step s", "tok/s", "MFU", "peak MiB", "x plain", "x naive",
            "x Wq/mb", "graphs")
    print(f"{head[0]:6s} {head[1]:9s} {head[2]:17s} {head[3]:12s} " + " ".join(f"{h:>8s}" for h in head[4:]))
    for r in (r for r in result["records"] if r["kind"] == "step"):
        ratios = [f"{x:8.2f}" if x is not None else f"{'-':>8s}"
                  for x in (r["step_s_vs_plain"], r["step_s_vs_naive"], r["step_s_vs_wq_per_micro_batch"])]
        graphs = str(r["compile"]["graphs_compiled"]) if "compile" in r else "-"
        preset = r["preset"] + ("" if r["wq_once_per_step"] else " Wq/mb")
        print(f"{r['device']:6s} {r['linear']:9s} {preset:17s} {r['loss']:12s} {r['step_s_median']:8.3f} "
              f"{r['tokens_per_s']:8.1f} {r['mfu']:8.2%} {r['peak_mem_bytes'] / 2**20:8.0f} {' '.join(ratios)} "
              f"{graphs:>8s}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="smollm2-135m", help="model shape (random weights)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per step (and per teacher forward)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=1, help="round-robin repetitions of every configuration")
    parser.add_argument("--accumulation-steps", type=int, default=1,
                        help="micro-batches of --batch-size per step; > 1 adds, for the QAT presets, rows that "
                             "build the quantiser's Wq per micro-batch instead of once per step")
    parser.add_argument("--chunk", type=int, default=128, help="positions per lm_head + loss chunk (chunked rows)")
    parser.add_argument("--quant", default="w3g64", help="quantisation preset of the fake-quant rows")
    parser.add_argument("--presets", nargs="+", choices=tuple(TRAIN_PRESETS), default=list(TRAIN_PRESETS),
                        help="training presets (plain nn.Linear rows run with recovery-lora only)")
    parser.add_argument("--losses", nargs="+", choices=LOSSES, default=list(LOSSES),
                        help="full logits (naive) and/or lm_head + loss over --chunk positions at a time")
    parser.add_argument("--devices", "--device", nargs="+", choices=DEVICES,
                        default=["cuda" if torch.cuda.is_available() else "cpu"],
                        help="xla = torch_xla, PJRT_DEVICE=CPU unless set (XLA:CPU; on a TPU give --peak-tflops)")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="datasheet peak for MFU, applied to every device (0 = measure an fp32 GEMM per device)")
    parser.add_argument("--cache-tokens", type=int, default=4096, help="tokens of the cache-build rows (0 = skip)")
    parser.add_argument("--json", default="docs/results/step_bench.json", help="where the results go")
    parser.add_argument("--loss-only", action="store_true", help="only the loss peak-memory comparison")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return args
    try:
        get_preset(args.quant)
    except ValueError as e:
        parser.error(str(e))
    for name in ("batch_size", "seq_len", "steps", "rounds", "chunk", "accumulation_steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive")
    if "xla" in args.devices and importlib.util.find_spec("torch_xla") is None:
        parser.error("--devices xla: torch_xla is not installed (pip install 'qat-lora[xla]')")
    args.devices = list(dict.fromkeys(args.devices))
    return args


def child_main(spec_json: str, children: dict) -> None:
    """One measurement in its own process (peaks must not mix): the spec in, one JSON line out."""
    spec = json.loads(spec_json)
    print(json.dumps(children[spec["kind"]](spec)))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child, CHILDREN)
    peaks = _peaks(args)
    memory_device = next((d for d in args.devices if d != "xla"), "cpu")  # XLA:CPU: no allocator statistics
    loss = dict(kind="loss", device=memory_device, shape=args.shape, batch_size=args.batch_size, seq_len=args.seq_len)
    naive_mem = run_child({**loss, "chunk": 0})["peak_mem_bytes"]
    chunked_mem = run_child({**loss, "chunk": args.chunk})["peak_mem_bytes"]
    specs = [] if args.loss_only else step_specs(args)
    rounds = [{(s["device"], s["linear"], s["preset"], s["chunk"], s["wq_once"]): run_child(s) for s in specs}
              for _ in range(args.rounds if specs else 0)]
    records = step_records(specs, rounds, peaks)
    if args.cache_tokens and not args.loss_only:
        records += [cache_record(args, d, peaks[d]) for d in args.devices if d != "xla"]  # no warm-up in build_cache
    first = args.devices[0]
    result = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "command": " ".join(["python", "benchmarks/step_bench.py", *sys.argv[1:]]),
              "peak_flops": peaks[first], "peak_flops_by_device": peaks,
              "peak_source": "datasheet" if args.peak_tflops else "measured fp32 1024^3 matmul",
              "flops_per_token_formula": "step: 4 N_frozen + 6 N_grad + 12 n_layers n_heads d_head L; "
                                         "forward: 2 N + 4 n_layers n_heads d_head L (see the module docstring)",
              # None if no growth could be measured (a host without /proc and a shape below the import-time peak)
              "loss_peak_memory_ratio": round(chunked_mem / naive_mem, 4) if naive_mem > 0 else None,
              "loss_memory_device": memory_device,
              "loss_memory_chunked": _loss_name(args.chunk),
              "loss_peak_mem_bytes": {"naive": naive_mem, "chunked": chunked_mem}, "records": records}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)


if __name__ == "__main__":
    main()
