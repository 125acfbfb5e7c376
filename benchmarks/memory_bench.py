"""Memory and throughput at real shapes (issue 29, items 3 and 4): random-weight students and teachers with the
exact configs of Qwen3-0.6B, Llama-3.2-1B, Qwen3-1.7B and Llama-3.2-3B, measured on the CPU against the byte
counts of docs/BENCHMARKS.md, *Which model sizes fit on TPU v6e, per mode*.

    nohup nice -n 10 .venv/bin/python benchmarks/memory_bench.py --json docs/results/memory_real_shapes.json \
        > /tmp/memory_bench.log 2>&1 &

Resumable: rows already in --json are skipped; rerun the same command after an interruption. Every figure comes
from its own subprocess (peaks must not mix). No download: the configs' numbers are written below from each
model's public config.json.

Modes (one record per config x mode x depth):
- build-fp32 / build-bf16: one cache-build batch: the teacher (cache/builder._teacher_to to the dtype) runs one
  no-grad forward over B x L tokens and TopKEncoding.select picks the top-64 (the per-batch work of
  cache/builder._build_split). A bf16 teacher is built directly in bf16 (the same parameters as fp32 then
  _teacher_to, without the fp32 copy a host would drop anyway).
- train-fp32: --storage-dtype fp32, w4g64 fake-quant + LoRA r 16 (recovery-lora), fp32 compute (the CPU's
  --precision auto), chunked loss (128 positions), AdamW: a warm-up step (it allocates the optimizer state) and
  one more (step_bench.time_steps).
- train-bf16: --storage-dtype bf16 under bf16 autocast (what a TPU runs: --precision auto is bf16 there).
- train-bf16-fp32-compute (not in the default --modes): --storage-dtype bf16 under the CPU's fp32 compute.
- fsdp-fp32 / fsdp-bf16: `--parallel fsdp` over 4 XLA:CPU devices (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=4), the
  student placed by the backend's shard_model_ as the trainer places it, global batch 4 x 64 (1 per device:
  FSDP_SEQ_LEN), one step (the AdamW state exists after it); per-device bytes of every tensor alive after it
  (parameters, cached Wq, gradients, AdamW states), read from the devices' own buffers (sharding.held_bytes;
  sharding.device_bytes, from the shardings, where the tree lacks it). XLA:CPU has no per-device memory
  statistics under SPMD ("MemoryInfo not supported for SPMD virtual device"), so the step's transient
  activations are not in this figure. The record says whether the tied head is still tied on the device, and
  the figure without its second copy if not.

CPU peak: the process's peak resident set (VmHWM) minus its resident set after imports, before the model, or, if
larger, the peak of its anonymous resident memory sampled every millisecond minus its value then (`_AnonPeak`:
under memory pressure from other processes the kernel drops file-backed pages and VmHWM reads low). The children
run with MALLOC_MMAP_THRESHOLD_=65536, so that resident = live (glibc would otherwise keep freed blocks), and
without the trainer's host-allocator tuning: the figure is the live bytes a device would have to hold.

Depth: every config and mode is measured with the exact config but 2 and 4 decoder layers (fsdp: 1 and 2, as
XLA compiles every layer); at full depth where the process stays under --max-gib. Full-depth figures that were not
measured are extrapolated linearly in layers (labelled so); where full depth was also measured, the
extrapolation's error is recorded. The summary compares each full-depth figure with the table's formula
(`table_bytes`) and with the tensors counted by role (`counted_bytes`) at the same B, L, V.

Throughput (speed rows, under `flock /tmp/qat-bench.lock`): a train-fp32 step (as above) at 2 and 4 layers,
--steps timed steps after a warm-up; each step's MFU = tokens/s x model FLOPs per token
(step_bench.step_flops_per_token: 4 N_frozen + 6 N_grad + attention) / the rate of an fp32 torch.matmul of
[B L, hidden] x [hidden, intermediate] measured right after that step in the same child; the record holds the
medians. Full depth: the 4-layer row's MFU applied to the full config's FLOPs per token (`speed_summary`).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_bench, when imported as a module by the tests
from step_bench import _batch, _peak_bytes, _proc_status_bytes, _reset_peak, child_main  # noqa: E402

CONFIGS = {  # from each model's public config.json (hub: Qwen/Qwen3-0.6B, meta-llama/Llama-3.2-1B, ...)
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1000000.0),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1000000.0),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0),
}
LLAMA3_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # Llama 3.2's rope_scaling (changes no byte count)
# Published sizes (model cards): total parameters, and Qwen3's non-embedding count.
PUBLISHED = {"qwen3-0.6b": dict(total=0.6e9, non_embedding=0.44e9), "llama-3.2-1b": dict(total=1.23e9),
             "qwen3-1.7b": dict(total=1.7e9, non_embedding=1.4e9), "llama-3.2-3b": dict(total=3.21e9)}
CPU_MODES = ("build-fp32", "build-bf16", "train-fp32", "train-bf16", "train-bf16-fp32-compute")
DEFAULT_MODES = ("build-fp32", "build-bf16", "train-fp32", "train-bf16", "fsdp-fp32", "fsdp-bf16")
FSDP_MODES = ("fsdp-fp32", "fsdp-bf16")
QUANT, GROUP, LORA_R, TOP_K, CHUNK, DEVICES = "w4g64", 64, 16, 64, 128, 4
SHALLOW = {"cpu": (2, 4), "speed": (2, 4), "fsdp": (1, 2)}  # XLA:CPU compiles every layer: fewer there
LOCK = "/tmp/qat-bench.lock"
# What an fsdp row measures (parameters, cached Wq, gradients, AdamW states after a step) does not depend on the
# step's length; XLA:CPU's step time does: its step runs over 64 positions per sequence.
FSDP_SEQ_LEN = 64


def parameter_counts(name: str, layers: int | None = None, lora_r: int = LORA_R) -> dict[str, int]:
    """Parameters of the config by role, at `layers` decoder layers (default: the config's): `embedding` (V x
    hidden, shared with the lm_head when tied), `lm_head` (0 when tied), `linear` (every decoder projection:
    what quantize_ fake-quantises), `norm` (RMSNorm weights, Qwen3's q/k norms included), `lora` (A and B of
    rank `lora_r` on every decoder projection), `total` (embedding + lm_head + linear + norm: the model's)."""
    c = CONFIGS[name]
    h, i, v, heads, kv = (c[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
                                         "num_key_value_heads"))
    d = c.get("head_dim") or h // heads
    n = c["num_hidden_layers"] if layers is None else layers
    shapes = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h), (h, i), (h, i), (i, h)]  # (in, out)
    per_layer_norm = 2 * h + (2 * d if c["model_type"] == "qwen3" else 0)
    counts = {"embedding": v * h, "lm_head": 0 if c["tie_word_embeddings"] else v * h,
              "linear": n * sum(a * b for a, b in shapes), "norm": n * per_layer_norm + h,
              "lora": n * lora_r * sum(a + b for a, b in shapes)}
    counts["total"] = counts["embedding"] + counts["lm_head"] + counts["linear"] + counts["norm"]
    return counts


def table_bytes(mode: str, p: float, batch: int, seq_len: int, vocab: int, devices: int = DEVICES) -> float:
    """Bytes the v6e table (docs/BENCHMARKS.md, 2026-11-24) predicts for `mode`, for P = `p` parameters, all
    counted as quantised linears: build 4 P | 2 P + 2 x B x L x V x 4 (logits and log-softmax); train fp32
    8.125 P (latent + cached Wq + w4g64 quantiser 8 P / 64) and bf16 2.125 P, plus LoRA r 16 as 16 bytes x 0.6 %
    of P; fsdp: the frozen part / devices + the LoRA whole. The bf16-storage rows under fp32 compute have the
    bf16 row's prediction."""
    logits, lora = 2 * batch * seq_len * vocab * 4, 16 * 0.006 * p
    frozen = {"fp32": 8.125 * p, "bf16": 2.125 * p}
    if mode.startswith("build-"):
        return (4 if mode == "build-fp32" else 2) * p + logits
    dtype = "fp32" if mode.endswith("fp32") and "bf16" not in mode else "bf16"
    return frozen[dtype] / (devices if mode.startswith("fsdp") else 1) + lora


def counted_bytes(name: str, mode: str, layers: int | None = None, devices: int = DEVICES) -> float:
    """Bytes of the tensors a mode keeps, counted by role as the code holds them (not the table's "every
    parameter a quantised linear"): a teacher 4 | 2 bytes per parameter; a student's embedding (the tied head),
    norms and an untied head 4 | 2 bytes (set_storage_dtype_), its decoder projections 4 latent + 4 cached Wq
    (fp32) or 2 Wq (bf16) + 8 / 64 quantiser (w4g64 scale and zero, fp32), LoRA 16 bytes per parameter (fp32
    value, gradient, two AdamW moments); fsdp: the frozen part / devices. No activations, logits or loss."""
    c = parameter_counts(name, layers)
    if mode.startswith("build-"):
        return (4 if mode == "build-fp32" else 2) * c["total"]
    other, fp32 = c["embedding"] + c["lm_head"] + c["norm"], mode in ("train-fp32", "fsdp-fp32")
    frozen = (4 if fp32 else 2) * other + ((8 if fp32 else 2) + 8 / GROUP) * c["linear"]
    return frozen / (devices if mode.startswith("fsdp") else 1) + 16 * c["lora"]


def activation_bytes(name: str, mode: str, layers: int | None, batch: int, seq_len: int) -> float:
    """What one training step adds to `counted_bytes`, read from the code (not fitted): the decoder's saved
    activations, per token and layer about 4 hidden (two RMSNorms' inputs and normalised outputs) + 6 H d (q,
    its norm and rotation, attention output, o_proj input) + 4 KV d (k, v) + 4 intermediate (gate, up, SiLU,
    down's input) values, at 4 bytes (fp32 compute) or 2 (bf16 autocast); plus the chunked loss's working set, about
    six fp32 [CHUNK, V] tensors (logits, log-softmax, softmax, their gradients) whatever B and L. A cache-build
    batch adds the logits and log-softmax of the batch, 2 x B x L x V x 4 bytes (fp32 teacher), or with a bf16
    teacher its bf16 logits, their fp32 copy and the log-softmax: B x L x V x (2 + 4 + 4). fsdp figures are the
    tensors alive after a step, so nothing is added."""
    c = CONFIGS[name]
    v, tokens = c["vocab_size"], batch * seq_len
    if mode.startswith("build-"):
        return tokens * v * (8 if mode == "build-fp32" else 10)
    if mode.startswith("fsdp-"):
        return 0.0
    d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = (4 * c["hidden_size"] + 6 * c["num_attention_heads"] * d + 4 * c["num_key_value_heads"] * d
                 + 4 * c["intermediate_size"])
    n = c["num_hidden_layers"] if layers is None else layers
    return tokens * n * per_token * (2 if mode == "train-bf16" else 4) + 6 * CHUNK * v * 4


def step_flops_per_token(name: str, layers: int | None, seq_len: int, lora_r: int = LORA_R) -> float:
    """step_bench's count (4 N_frozen + 6 N_grad + 12 n_layers n_heads d_head L) from the config alone, for the
    recovery-LoRA step: the fake-quant projections and the (tied) lm_head frozen, the LoRA factors trained."""
    c, counts = CONFIGS[name], parameter_counts(name, layers, lora_r)
    n = c["num_hidden_layers"] if layers is None else layers
    d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    head = c["vocab_size"] * c["hidden_size"]
    return (4.0 * (counts["linear"] + head) + 6.0 * counts["lora"]
            + 12.0 * n * c["num_attention_heads"] * d * seq_len)


def model_config(name: str, layers: int, seq_len: int):
    from transformers import AutoConfig

    params = dict(CONFIGS[name])
    if params["model_type"] == "llama":
        params["rope_scaling"] = dict(LLAMA3_ROPE)
    params["num_hidden_layers"] = layers
    return AutoConfig.for_model(params.pop("model_type"), max_position_embeddings=max(seq_len, 2048), **params)


def _random_model(name: str, layers: int, seq_len: int, dtype: torch.dtype = torch.float32, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(name, layers, seq_len), attn_implementation=attn,
                                            dtype=dtype)


def _student(spec: dict, storage: str, attn: str = "sdpa"):
    from qat_lora.quant.fake_quant import quantize_
    from qat_lora.train.student import make_trainable_, set_storage_dtype_

    model = _random_model(spec["config"], spec["layers"], spec["seq_len"], attn=attn)
    model = make_trainable_(quantize_(model, QUANT), "recovery-lora", LORA_R, 2.0 * LORA_R)
    return set_storage_dtype_(model, storage)


def _steps(model, batch: dict, steps: int, amp_dtype) -> list[float]:
    """Trainer-like steps (step_bench.time_steps) under `amp_dtype` autocast on the CPU (None: fp32)."""
    from step_bench import time_steps

    autocast = torch.autocast("cpu", dtype=amp_dtype) if amp_dtype else torch.autocast("cpu", enabled=False)
    with autocast:  # time_steps's own autocast is the CPU's (none), so this one applies
        times, _ = time_steps(model, batch, CHUNK, steps, torch.device("cpu"))
    return times


def _rss() -> int:
    return _proc_status_bytes("VmRSS")


class _AnonPeak:
    """The peak of the process's anonymous resident memory (RssAnon), sampled every millisecond by a thread (torch
    ops release the GIL). VmHWM also counts file-backed pages, which the kernel drops from the resident set when
    other processes need memory: the resident set then shrinks below its baseline and peak - baseline comes out
    low (measured: a 4-layer row under its 2-layer one). Anonymous memory is not dropped without swap."""

    def __init__(self) -> None:
        import threading

        self.baseline = self.peak = _proc_status_bytes("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _proc_status_bytes("RssAnon"))
            time.sleep(0.001)

    def stop(self) -> int:
        """Peak growth over the baseline, in bytes."""
        self._stop.set()
        self._thread.join()
        return max(self.peak, _proc_status_bytes("RssAnon")) - self.baseline


def cpu_child(spec: dict) -> dict:
    """One CPU memory measurement (module docstring); bytes relative to the resident set before the model."""
    from qat_lora.cache.builder import _teacher_to
    from qat_lora.cache.encodings import TopKEncoding
    import qat_lora.train.loss, qat_lora.quant.fake_quant, qat_lora.train.student, peft  # noqa: F401, E401 (imported before the baseline)

    cpu, mode = torch.device("cpu"), spec["mode"]
    baseline, anon = _rss(), _AnonPeak()
    if mode.startswith("build-"):
        dtype = torch.float32 if mode == "build-fp32" else torch.bfloat16
        model = _random_model(spec["config"], spec["layers"], spec["seq_len"], dtype).eval()
        _teacher_to(model, cpu, dtype)
    else:
        model = _student(spec, "fp32" if mode == "train-fp32" else "bf16").train()
    setup_peak = _peak_bytes(cpu) - baseline
    model_bytes = _rss() - baseline
    batch = _batch(CONFIGS[spec["config"]]["vocab_size"], spec["batch_size"], spec["seq_len"], cpu)
    _reset_peak(cpu)
    anon.peak = _proc_status_bytes("RssAnon")  # the step's peak, not the model build's
    if mode.startswith("build-"):
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits
        TopKEncoding(TOP_K).select(logits, list(range(spec["batch_size"])))
    else:
        _steps(model, batch, 1, torch.bfloat16 if mode == "train-bf16" else None)
    resident, anonymous = int(_peak_bytes(cpu) - baseline), anon.stop()
    return {"peak_bytes": max(resident, anonymous), "peak_resident_bytes": resident, "peak_anon_bytes": anonymous,
            "model_bytes": int(model_bytes),
            "setup_peak_bytes": int(setup_peak), "baseline_bytes": int(baseline),
            "parameters": sum(p.numel() for p in model.parameters())}


def _held(tensors: list[torch.Tensor]) -> dict[str, int]:
    """{device: bytes} of `tensors`, read from each device's own buffers one tensor at a time (a shard's copy
    comes to the host: tensor by tensor keeps that small); sharding.held_bytes where this tree has it, else the
    shapes the shardings give (sharding.device_bytes, the same on every device)."""
    from qat_lora.runtime import sharding

    if not hasattr(sharding, "held_bytes"):
        return {"xla:0": sharding.device_bytes(tensors)}
    held: dict[str, int] = {}
    for t in tensors:
        for device, n in sharding.held_bytes([t]).items():
            held[device] = held.get(device, 0) + n
    return held


def fsdp_child(spec: dict) -> dict:
    """Per-device bytes of everything alive after one fsdp step over 4 XLA:CPU devices (placed as the trainer
    places it: backend.shard_model_)."""
    import inspect

    import torch_xla

    from qat_lora.train.loss import KDLossConfig, forward_loss
    from qat_lora.quant.fake_quant import FakeQuantLinear
    from qat_lora.runtime.sharding import FsdpBackend, device_bytes

    backend = FsdpBackend()  # before any XLA work: SPMD on
    device = torch_xla.device()
    baseline = _rss()
    student = _student(spec, spec["mode"].removeprefix("fsdp-"), "eager")
    if "device" in inspect.signature(backend.shard_model_).parameters:  # the tree's placement (moved as split)
        model = backend.shard_model_(student, device)
    else:
        model = backend.shard_model_(student.to(device))
    model.train()
    seq_len = min(spec["seq_len"], FSDP_SEQ_LEN)
    batch = _batch(CONFIGS[spec["config"]]["vocab_size"], spec["batch_size"] * backend.data_parallel, seq_len,
                   torch.device("cpu"))
    batch = {k: backend.shard_rows_(v.to(device)) for k, v in batch.items()}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    forward_loss(model, batch, KDLossConfig(), CHUNK)["loss"].backward()  # one step: AdamW's state exists after it
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    torch_xla.sync()
    base = model.get_base_model()
    tied = base.lm_head.weight is base.get_input_embeddings().weight
    groups = {"frozen": [p for p in model.parameters() if not p.requires_grad],
              "cached_wq": [m._cached_wq for m in model.modules()
                            if isinstance(m, FakeQuantLinear) and m._cached_wq is not None],
              "trainable": params, "grads": [p.grad for p in params if p.grad is not None],
              "optimizer": [t for s in optimizer.state.values() for t in s.values()
                            if torch.is_tensor(t) and t.dim() > 0]}
    parts = {name: _held(tensors) for name, tensors in groups.items()}
    per_device = {d: sum(p.get(d, 0) for p in parts.values()) for d in parts["frozen"]}
    whole = sum(t.numel() * t.element_size() for t in groups["frozen"] + groups["cached_wq"])
    untied_head = 0 if tied else max(_held([base.lm_head.weight]).values())
    return {"peak_bytes": max(per_device.values()), "per_device_bytes": per_device,
            "parts": {name: max(p.values()) if p else 0 for name, p in parts.items()},
            "spec_bytes": sum(device_bytes(t) for t in groups.values()), "devices": backend.data_parallel,
            "frozen_and_cached_whole_bytes": whole, "cached_wq_tensors": len(groups["cached_wq"]),
            "embedding_tied_on_device": tied, "untied_head_bytes_per_device": untied_head,
            "peak_bytes_if_tied": max(per_device.values()) - untied_head,
            "host_rss_growth_bytes": int(_peak_bytes(torch.device("cpu")) - baseline),
            "parameters": sum(p.numel() for p in model.parameters()), "step_seq_len": seq_len}


def _gemm_rate(a: torch.Tensor, b: torch.Tensor, reps: int = 10) -> float:
    """FLOP/s of `reps` fp32 a @ b."""
    started = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1] * reps / (time.perf_counter() - started)


def speed_child(spec: dict) -> dict:
    """Step times of train-fp32 and, right after each step, the fp32 GEMM rate of a relevant size
    ([B L, hidden] x [hidden, intermediate]): on a shared host the load moves both together, so each step's MFU
    is taken against the rate measured next to it, and the record holds the median of those."""
    from step_bench import step_flops_per_token as counted

    c = CONFIGS[spec["config"]]
    tokens = spec["batch_size"] * spec["seq_len"]
    model = _student(spec, "fp32").train()
    batch = _batch(c["vocab_size"], spec["batch_size"], spec["seq_len"], torch.device("cpu"))
    a, b = torch.randn(tokens, c["hidden_size"]), torch.randn(c["hidden_size"], c["intermediate_size"])
    a @ b
    _steps(model, batch, 1, None)  # warm-up (its own warm-up step too: allocations, optimizer state)
    times, rates = [], []
    for _ in range(spec["steps"]):
        times += _steps(model, batch, 1, None)[-1:]
        rates.append(_gemm_rate(a, b))
    flops = counted(model, spec["seq_len"])
    mfu = [tokens / t * flops / r for t, r in zip(times, rates)]
    return {"step_s": statistics.median(times), "step_s_all": times, "gemm_flops": statistics.median(rates),
            "gemm_flops_all": rates, "gemm_shape": [tokens, c["hidden_size"], c["intermediate_size"]],
            "mfu": statistics.median(mfu), "mfu_all": mfu, "flops_per_token": flops,
            "threads": torch.get_num_threads()}


CHILDREN = {"cpu": cpu_child, "fsdp": fsdp_child, "speed": speed_child}


def run_child(spec: dict, timeout: int = 3600) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    if spec["kind"] == "fsdp":
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(DEVICES))
    else:
        env["USE_TORCH_XLA"] = "0"
    if spec["kind"] == "speed":
        command = ["flock", LOCK, *command]  # one timed benchmark at a time on this host
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode:
        raise RuntimeError(f"{json.dumps(spec)} failed: {result.stderr[-3000:]}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    out["child_s"] = round(time.perf_counter() - started, 1)
    return out


def _key(spec: dict) -> str:
    return f"{spec['kind']}:{spec['config']}:{spec['mode']}:{spec['layers']}"


def fits(name: str, mode: str, max_gib: float) -> bool:
    """Whether the full-depth child stays under `max_gib` (a generous estimate: the fp32 model it is built from,
    the mode's weights, 25 % more for activations, 1 GiB of imports)."""
    counts = parameter_counts(name)
    build = 2 if mode == "build-bf16" else 4
    weights = {"build-fp32": 4 * counts["total"], "build-bf16": 2 * counts["total"],
               "train-fp32": 4 * counts["total"] + 4.125 * counts["linear"]}.get(mode, 2.2 * counts["total"])
    return (max(build * counts["total"], 1.25 * weights) + 2**30) / 2**30 < max_gib


def specs(args) -> list[dict]:
    """Every measurement, most useful first: the shallow rows (all configs), speed, fsdp, then full depth."""
    common = dict(batch_size=args.batch_size, seq_len=args.seq_len)
    out = [dict(kind="cpu", config=c, mode=m, layers=n, **common) for n in SHALLOW["cpu"] for c in args.configs
           for m in args.modes if m in CPU_MODES]
    out += [dict(kind="speed", config=c, mode="train-fp32", layers=n, steps=args.steps, **common)
            for c in args.configs for n in SHALLOW["speed"]] if args.speed else []
    out += [dict(kind="fsdp", config=c, mode=m, layers=n, **common) for c in args.configs for n in SHALLOW["fsdp"]
            for m in args.modes if m in FSDP_MODES]
    out += [dict(kind="cpu", config=c, mode=m, layers=CONFIGS[c]["num_hidden_layers"], **common)
            for c in args.configs for m in args.modes if m in CPU_MODES and fits(c, m, args.max_gib)]
    return [s for s in out if s["kind"] in args.kinds]


def _extrapolate(a: tuple[int, float], b: tuple[int, float], layers: int) -> float:
    (n1, y1), (n2, y2) = a, b
    return y1 + (y2 - y1) / (n2 - n1) * (layers - n1)


def summarise(rows: dict[str, dict], args) -> list[dict]:
    """Full-depth figure per config x mode (measured, or extrapolated from 2 and 4 layers) vs the table."""
    summary = []
    for name in args.configs:
        full = CONFIGS[name]["num_hidden_layers"]
        for mode in args.modes:
            kind = "fsdp" if mode in FSDP_MODES else "cpu"
            shallow = SHALLOW[kind]
            got = {n: rows.get(f"{kind}:{name}:{mode}:{n}") for n in (*shallow, full)}
            if got[shallow[0]] is None or got[shallow[1]] is None:
                continue
            extrapolated = _extrapolate(*((n, got[n]["peak_bytes"]) for n in shallow), full)
            measured = got[full]["peak_bytes"] if got[full] else None
            value = measured if measured is not None else extrapolated
            counts = parameter_counts(name)
            predicted = table_bytes(mode, counts["total"], args.batch_size, args.seq_len, CONFIGS[name]["vocab_size"])
            counted = counted_bytes(name, mode)
            formula = counted + activation_bytes(name, mode, None, args.batch_size, args.seq_len)
            entry = {
                "config": name, "mode": mode, "layers": full, "parameters": counts["total"],
                "source": "measured" if measured is not None else f"extrapolated from {shallow[0]} and "
                                                                  f"{shallow[1]} layers",
                "peak_bytes": int(value), "extrapolated_bytes": int(extrapolated),
                "extrapolation_error": None if measured is None else round(extrapolated / measured - 1, 4),
                "table_bytes": int(predicted), "table_error": round(predicted / value - 1, 4),
                "counted_bytes": int(counted), "counted_error": round(counted / value - 1, 4),
                "formula_bytes": int(formula), "formula_error": round(formula / value - 1, 4)}
            if kind == "fsdp":  # the same without the head's second copy (the tie lost when moved to XLA)
                tied = _extrapolate(*((n, got[n]["peak_bytes_if_tied"]) for n in shallow), full)
                entry.update(peak_bytes_if_tied=int(tied), table_error_if_tied=round(predicted / tied - 1, 4),
                             counted_error_if_tied=round(counted / tied - 1, 4),
                             formula_error_if_tied=round(formula / tied - 1, 4))
            summary.append(entry)
    return summary


def speed_summary(rows: dict[str, dict], args) -> list[dict]:
    """Per config: tokens/s and MFU at 2 and 4 layers, and a full-depth projection: the deeper row's MFU applied
    to the full config's FLOPs per token (under this host's load a linear fit of step time in layers is noisier
    than the MFU, which each step takes against the GEMM rate measured next to it)."""
    out = []
    for name in args.configs:
        shallow = SHALLOW["speed"]
        got = [rows.get(f"speed:{name}:train-fp32:{n}") for n in shallow]
        if None in got or "mfu" not in got[-1]:
            continue
        full, tokens = CONFIGS[name]["num_hidden_layers"], args.batch_size * args.seq_len
        flops, deep = step_flops_per_token(name, None, args.seq_len), got[-1]
        tokens_per_s = deep["mfu"] * deep["gemm_flops"] / flops
        entry = {"config": name, "layers": full, "source": f"MFU of the {shallow[-1]}-layer row x its GEMM rate / "
                 "the full config's FLOPs per token", "step_s": round(tokens / tokens_per_s, 2),
                 "tokens_per_s": round(tokens_per_s, 1), "flops_per_token": flops, "gemm_flops": deep["gemm_flops"],
                 "mfu": round(deep["mfu"], 4)}
        for n, r in zip(shallow, got):
            entry[f"mfu_{n}_layers"] = round(r["mfu"], 4)
            entry[f"tokens_per_s_{n}_layers"] = round(tokens / r["step_s"], 1)
        out.append(entry)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="model configs")
    parser.add_argument("--modes", nargs="+", choices=CPU_MODES + FSDP_MODES, default=list(DEFAULT_MODES),
                        help="what to measure (module docstring)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step or teacher batch (per device)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per speed row (median)")
    parser.add_argument("--no-speed", dest="speed", action="store_false", help="skip the throughput rows")
    parser.add_argument("--kinds", nargs="+", choices=tuple(CHILDREN), default=list(CHILDREN),
                        help="which measurements: cpu (memory), fsdp (XLA per-device bytes), speed (throughput)")
    parser.add_argument("--max-gib", type=float, default=12.0,
                        help="full-depth rows only where the estimated process peak stays below this")
    parser.add_argument("--json", default="docs/results/memory_real_shapes.json", help="results (resumed)")
    parser.add_argument("--summary-only", action="store_true", help="recompute the summaries of --json, run nothing")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("batch_size", "seq_len", "steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive")
    return args


def _write(path: Path, result: dict) -> None:
    from qat_lora.runtime.files import atomic_write_json

    atomic_write_json(path, result)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child, CHILDREN)
    path = Path(args.json)
    result = json.loads(path.read_text()) if path.exists() else {}
    rows = {r["key"]: r for r in result.get("records", [])}
    if not args.summary_only:  # the run's own record of where and how it ran
        result.update(machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                              f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
                      torch=torch.__version__,
                      command=" ".join(["python", "benchmarks/memory_bench.py", *sys.argv[1:]]),
                      batch_size=args.batch_size, seq_len=args.seq_len, quant=QUANT, lora_r=LORA_R, top_k=TOP_K,
                      loss_chunk=CHUNK, fsdp_devices=DEVICES, fsdp_step_seq_len=FSDP_SEQ_LEN,
                      parameter_counts={c: parameter_counts(c) for c in CONFIGS})
    for spec in [] if args.summary_only else specs(args):
        if _key(spec) in rows:
            continue
        try:
            rows[_key(spec)] = {"key": _key(spec), **spec, **run_child(spec)}
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # one failure (e.g. out of memory) skips one row
            print(f"{_key(spec)}: {str(e)[-600:]}", file=sys.stderr, flush=True)
            continue
        r = rows[_key(spec)]
        figure = f"{r['step_s']:.2f} s/step" if spec["kind"] == "speed" else f"{r['peak_bytes'] / 2**30:.2f} GiB"
        print(f"{_key(spec)}: {figure} ({r['child_s']} s)", file=sys.stderr, flush=True)
        result.update(records=list(rows.values()), summary=summarise(rows, args), speed=speed_summary(rows, args))
        _write(path, result)
    result.update(records=list(rows.values()), summary=summarise(rows, args), speed=speed_summary(rows, args))
    _write(path, result)
    print_tables(result)


def print_tables(result: dict) -> None:
    """The summaries as the markdown tables docs/BENCHMARKS.md quotes (GB = 1e9 bytes)."""
    print("| config | mode | source | measured GB | table GB | table error | counted + step GB | its error |")
    print("|---|---|---|---|---|---|---|---|")
    for s in result["summary"]:
        tied = (f" ({s['peak_bytes_if_tied'] / 1e9:.3f} if tied: {s['table_error_if_tied']:+.1%}, "
                f"{s['formula_error_if_tied']:+.1%})" if "peak_bytes_if_tied" in s else "")
        extra = f", extrapolation error {s['extrapolation_error']:+.1%}" if s["extrapolation_error"] is not None else ""
        print(f"| {s['config']} | {s['mode']} | {s['source']}{extra} | {s['peak_bytes'] / 1e9:.3f}{tied} | "
              f"{s['table_bytes'] / 1e9:.3f} | {s['table_error']:+.1%} | {s['formula_bytes'] / 1e9:.3f} | "
              f"{s['formula_error']:+.1%} |")
    print("\n| config | layers timed | tokens/s (2, 4 layers) | MFU (2, 4 layers) | full depth: step s | tokens/s | "
          "MFU | GEMM GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for s in result["speed"]:
        print(f"| {s['config']} | 2, 4 | {s['tokens_per_s_2_layers']}, {s['tokens_per_s_4_layers']} | "
              f"{s['mfu_2_layers']:.1%}, {s['mfu_4_layers']:.1%} | {s['step_s']} | {s['tokens_per_s']} | "
              f"{s['mfu']:.1%} | {s['gemm_flops'] / 1e9:.0f} |")


if __name__ == "__main__":
    main()
