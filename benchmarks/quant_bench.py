"""Quantised-student benchmarks (issue 4): fake-quant linear cost, and PTQ perplexity RTN vs our init.

    python benchmarks/quant_bench.py timing                                   # fwd+bwd ÷ nn.Linear
    python benchmarks/quant_bench.py ppl --presets w3g64 w2g64 --teacher-row  # PTQ ppl, RTN vs default init
    python benchmarks/quant_bench.py ppl --presets w3g64 --fp32-scales        # + the effect of fp16 scales
    python benchmarks/quant_bench.py ppl --presets w2g32 --inits mse+act      # activation-weighted init

Results are merged into --json (default docs/results/quant_bench.json) and printed as a markdown table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from qat_lora.quant import grid

from qat_lora.quant import inits as quant_init
from qat_lora.quant.calibration import activation_importance
from qat_lora.data.assets import Assets, default_assets_dir
from qat_lora.train.metrics import perplexity
from qat_lora.data.models import load_causal_lm, load_tokenizer
from qat_lora.quant.fake_quant import FakeQuantLinear, get_preset, quantize_

ASSETS = Assets.at(default_assets_dir())  # `qat-lora fetch-assets`; override with --teacher / --eval-text
SHAPES = ((576, 576), (576, 1536), (1536, 576))  # SmolLM2-135M: attention/o_proj, up/gate, down (in, out)
TIMING_CASES = {
    "int w3g64, frozen quantiser (LoRA preset)": (get_preset("w3g64"), ()),
    "int w3g64, QAT (weights + scales + zeros)": (get_preset("w3g64"), ("weight", "scale", "zero")),
    "lut lut2g32, QAT (weights + scales + codebook)": (get_preset("lut2g32"), ("weight", "scale", "codebook")),
    "int w2g32 + rank-4 scales, QAT (scales)": (replace(get_preset("w2g32"), scale_rank=4),
                                                ("scale", "scale_a", "scale_b", "zero")),
}


def _set_trainable_(layer: FakeQuantLinear, names: tuple[str, ...]) -> None:
    """Train exactly the named tensors of the layer's weight and quantiser (its bias is left as it is)."""
    for name, p in {"weight": layer.weight, **layer.quant_parameters()}.items():
        p.requires_grad_(name in names)


def _fwd_bwd_seconds(layer: nn.Module, x: torch.Tensor) -> float:
    """Seconds of one forward + backward (to the input and every trainable parameter)."""
    xi = x.detach().requires_grad_()
    started = time.perf_counter()
    layer(xi).square().mean().backward()
    elapsed = time.perf_counter() - started
    layer.zero_grad(set_to_none=True)
    return elapsed


def _interleaved(base: nn.Module, layer: nn.Module, x: torch.Tensor, reps: int) -> tuple[float, float, float]:
    """Median base time, median layer time and median per-round ratio, the two timed back to back in each
    round so that load from other processes on a shared machine hits both alike."""
    pairs = []
    for i in range(reps + 2):
        pair = (_fwd_bwd_seconds(base, x), _fwd_bwd_seconds(layer, x))
        if i >= 2:  # two warm-up rounds
            pairs.append(pair)
    return (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
            statistics.median(p[1] / p[0] for p in pairs))


def run_timing(tokens: int, reps: int) -> list[dict]:
    rows = []
    for in_f, out_f in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(tokens, in_f)
        for name, (cfg, trainable) in TIMING_CASES.items():
            linear = nn.Linear(in_f, out_f)
            linear.requires_grad_(bool(trainable))  # compare like with like: frozen vs frozen
            layer = FakeQuantLinear.from_linear(nn.Linear(in_f, out_f), cfg)
            _set_trainable_(layer, trainable)
            base, t, ratio = _interleaved(linear, layer, x, reps)
            rows.append({"shape": f"{in_f}x{out_f}", "tokens": tokens, "case": name, "linear_ms": 1e3 * base,
                         "linear_weight_trainable": bool(trainable), "fake_quant_ms": 1e3 * t, "ratio": ratio})
            print(f"{in_f:5d}x{out_f:<5d} {name:50s} {1e3 * base:7.2f} ms {1e3 * t:7.2f} ms  x{ratio:.2f}")
    return rows


@contextlib.contextmanager
def fp32_scales():
    """Disable fp16 snapping of scales/codebooks (init and forward), to measure what fp16 storage costs."""
    saved = grid._fp16_ste, quant_init.snap_fp16
    grid._fp16_ste = quant_init.snap_fp16 = lambda x: x
    try:
        yield
    finally:
        grid._fp16_ste, quant_init.snap_fp16 = saved


def _calibration_batches(teacher: str, calib_text: str, seq_len: int, num_batches: int) -> list[torch.Tensor]:
    """`num_batches` x [4, seq_len] input_ids from the training text (never the eval text)."""
    from qat_lora.data import text as data

    stream = data.token_stream(data.list_text_files([calib_text]), load_tokenizer(teacher), 4 * seq_len * num_batches)
    ids, _ = data.pack(stream, seq_len)
    ids = torch.as_tensor(ids[:4 * num_batches], dtype=torch.long)
    return list(ids.split(4))


def run_ppl(presets: list[str], teacher_row: bool, with_fp32: bool, tokens: int, seq_len: int, teacher: str,
            eval_text: str, calib_text: str = "", calib_batches: int = 8,
            inits: tuple[str, ...] = ("rtn", "mse")) -> list[dict]:
    """PTQ perplexity per preset for each of `inits`: round-to-nearest, the MSE/k-means init, and (`mse+act`,
    needs `calib_text`) the activation-weighted init (`activation_importance` on `calib_batches` x 4 training sequences)."""
    tokenizer = load_tokenizer(teacher)
    device = torch.device("cpu")
    variants = [("teacher", None, "", False)] if teacher_row else []
    for name in presets:
        cfg = get_preset(name)
        variants += [(name, replace(cfg, init=init.removesuffix("+act")), init, False) for init in inits]
        if with_fp32:
            variants.append((name, replace(cfg, init="mse"), "mse", True))
    if "mse+act" in inits and not calib_text:
        raise ValueError("--inits mse+act needs --calib-text (training text for the activation statistics)")
    calibration = _calibration_batches(teacher, calib_text, seq_len, calib_batches) if "mse+act" in inits else []
    rows = []
    for name, cfg, init, fp32 in variants:
        started = time.perf_counter()
        with fp32_scales() if fp32 else contextlib.nullcontext():
            model = load_causal_lm(teacher, attn_implementation="sdpa")
            if cfg is not None:
                importance = activation_importance(model, calibration, cfg) if init == "mse+act" else None
                quantize_(model, cfg, importance=importance)
            init_s = time.perf_counter() - started
            result = perplexity(model, tokenizer, [eval_text], seq_len, tokens, 4, device)
        row = {"model": name, "init": init or "-", "scales": "fp32" if fp32 else "fp16", "ppl": result["ppl"],
               "nll": result["nll"], "tokens": result["tokens"], "init_s": round(init_s, 1),
               "bits_per_weight": None if cfg is None else _bpw(model),
               "wall_s": round(time.perf_counter() - started, 1)}
        rows.append(row)
        print(json.dumps(row))
    return rows


def _bpw(model) -> float:
    from qat_lora.quant.state import bits_per_weight

    return round(bits_per_weight(model), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=("timing", "ppl"))
    parser.add_argument("--presets", nargs="+", default=["w3g64", "w2g64", "w2g32", "lut2g32"])
    parser.add_argument("--teacher-row", action="store_true", help="also evaluate the full-precision teacher")
    parser.add_argument("--fp32-scales", action="store_true", help="also evaluate the default init with fp32 scales")
    parser.add_argument("--inits", nargs="+", choices=("rtn", "mse", "mse+act", "ggml"), default=["rtn", "mse"],
                        help="PTQ inits to evaluate; mse+act = MSE clipping weighted by activations of --calib-text; "
                             "ggml = llama.cpp's reference quantiser (q*_0 / q4_1 / K-quant presets)")
    parser.add_argument("--calib-text", default=str(ASSETS.train_text_dir), help="training text for calibration")
    parser.add_argument("--calib-batches", type=int, default=8, help="calibration batches of 4 sequences")
    parser.add_argument("--tokens", type=int, default=16_384, help="perplexity token budget (same for every row)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--timing-tokens", type=int, default=1024, help="rows of x in the timing (batch x seq)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default="docs/results/quant_bench.json")
    parser.add_argument("--teacher", default=str(ASSETS.teacher_dir), help="full-precision model folder")
    parser.add_argument("--eval-text", default=str(ASSETS.eval_text), help="held-out text for perplexity")
    args = parser.parse_args()

    path = Path(args.json)
    results = json.loads(path.read_text()) if path.exists() else {}
    results.setdefault("machine", {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                                   "torch": torch.__version__})
    if args.part == "timing":
        results["timing"] = run_timing(args.timing_tokens, args.reps)
    else:
        rows = run_ppl(args.presets, args.teacher_row, args.fp32_scales, args.tokens, args.seq_len, args.teacher,
                       args.eval_text, args.calib_text, args.calib_batches, tuple(args.inits))
        keep = [r for r in results.get("ppl", []) if (r["model"], r["init"], r["scales"]) not in
                {(n["model"], n["init"], n["scales"]) for n in rows}]
        results["ppl"] = keep + rows
        print("\n| model | init | scales | bits/weight | ppl | NLL |\n|---|---|---|---|---|---|")
        for r in results["ppl"]:
            print(f"| {r['model']} | {r['init']} | {r['scales']} | {r['bits_per_weight'] or '-'} | {r['ppl']:.2f} | "
                  f"{r['nll']:.4f} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
