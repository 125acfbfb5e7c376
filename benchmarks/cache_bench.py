"""KD cache benchmark: bytes per token and fidelity of every encoding, and build throughput vs forward-only.

    python benchmarks/cache_bench.py --teacher ~/.cache/qat-lora/assets/smollm2-135m-instruct \
        --data ~/.cache/qat-lora/assets/text/train --tokens 8192 --json docs/results/cache_bench.json

Fidelity: for each position, KL(decoded || exact) over the encoding's own buckets (top-K: the K ids + the
tail; sampled: the drawn ids + everything else), where "exact" is the teacher's fp32 distribution.
Throughput: one run times (a) teacher forwards alone over the same fixed-shape batches and (b) the real
`build_cache` (forward, on-device top-K, background writer), and reports (b) / (a) in tokens/s. The step
harness (step_bench.py) runs the same `throughput` on a random teacher of a model shape.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from qat_lora.data import text as data

from qat_lora.data import models
from qat_lora.cache.builder import build_cache
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.cache.encodings import SampledEncoding, TopKEncoding, encode_rows

ENCODINGS = [TopKEncoding(k, bits) for k in (32, 64, 128) for bits in (32, 16, 8)] + \
            [SampledEncoding(n) for n in (25, 50, 100)]


def _label(enc) -> str:
    return f"topk K={enc.top_k} {enc.value_bits}-bit" if enc.name == "topk" else f"sampled N={enc.num_samples}"


def _fidelity(enc, decoded: dict, logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over real positions of KL(decoded || exact) over the encoding's buckets. logprobs [L, V]."""
    if enc.name == "topk":
        ids, q = decoded["topk_ids"], decoded["topk_logprobs"].double().exp()
    else:
        ids, q = decoded["sample_ids"], decoded["sample_weights"].double()
    p = logprobs.double().exp().gather(-1, ids) * (q > 0)
    p_rest = (1 - p.sum(-1)).clamp(min=1e-300)
    q_rest = (1 - q.sum(-1)).clamp(min=0)
    kl = (q * (q.clamp(min=1e-300).log() - p.clamp(min=1e-300).log())).sum(-1)
    kl = kl + q_rest * (q_rest.clamp(min=1e-300).log() - p_rest.log())
    return float((kl * mask).sum() / mask.sum())


def encoding_table(teacher, rows: np.ndarray, mask: np.ndarray, vocab: int, batch_size: int) -> list[dict]:
    stats = {_label(e): {"bytes": 0, "kl_sum": 0.0} for e in ENCODINGS}
    for start in range(0, len(rows), batch_size):
        ids = torch.from_numpy(rows[start:start + batch_size]).long()
        real = torch.from_numpy(mask[start:start + batch_size]).double()
        with torch.no_grad():
            logits = teacher(input_ids=ids).logits.float()
        logprobs = torch.log_softmax(logits, -1)
        for enc in ENCODINGS:
            packed = encode_rows(enc, logits, vocab, [start + i for i in range(len(ids))])
            for b, row in enumerate(packed):
                # Raw bytes (+ an 8-byte offset for ragged rows); shard headers amortise over ~1000 rows.
                stats[_label(enc)]["bytes"] += sum(v.nbytes for v in row.values()) + 8 * len(enc.ragged_keys)
                decoded = enc.decode(row, ids.shape[1], vocab)
                stats[_label(enc)]["kl_sum"] += _fidelity(enc, decoded, logprobs[b], real[b]) * float(real[b].sum())
    tokens = float(mask.sum())
    return [{"encoding": label, "target_bytes_per_token": round(s["bytes"] / tokens, 1),
             "bytes_per_token_with_inputs": round(s["bytes"] / tokens + 5, 1),  # + int32 id + uint8 mask
             "mean_kl_decoded_to_exact": s["kl_sum"] / tokens} for label, s in stats.items()]


def _forward_only(args, teacher, rows: np.ndarray) -> float:
    """Seconds of teacher forwards + top-K over `rows` in fixed-shape batches; `teacher` lives on args.device."""
    device = torch.device(args.device)
    started = time.perf_counter()
    for start in range(0, len(rows), args.batch_size):
        ids = np.zeros((args.batch_size, rows.shape[1]), dtype=np.int64)
        ids[:len(rows[start:start + args.batch_size])] = rows[start:start + args.batch_size]
        with torch.no_grad():
            teacher(input_ids=torch.from_numpy(ids).to(device)).logits.float().log_softmax(-1).topk(args.top_k, -1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _build(args) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        # top-K explicitly: the forward-only baseline takes the top-K, and the default encoding is sampled now.
        cfg = CacheBuildConfig(teacher=args.teacher, data=args.data, out=tmp, seq_len=args.seq_len, encoding="topk",
                               top_k=args.top_k, value_bits=16, max_tokens=args.tokens, batch_size=args.batch_size,
                               holdout_fraction=0.0, device=args.device)
        build_cache(cfg, log=lambda _: None)
        return json.loads((Path(tmp) / "manifest-r000.json").read_text())["seconds"]  # excludes model loading


def throughput(args, teacher, rows: np.ndarray, mask: np.ndarray) -> dict:
    """Forward-only and full builds over the same tokens, alternated for `--rounds` rounds (medians), so a
    change of machine load hits both alike."""
    forward_s, build_s = [], []
    _forward_only(args, teacher, rows[:args.batch_size])  # warm-up: the process's first forward pays one-time costs
    for _ in range(args.rounds):
        forward_s.append(_forward_only(args, teacher, rows))
        build_s.append(_build(args))
    tokens = float(mask.sum())
    ratios = [f / b for f, b in zip(forward_s, build_s)]
    return {"tokens": int(tokens), "rounds": args.rounds,
            "forward_only_tokens_per_s": round(tokens / float(np.median(forward_s)), 1),
            "build_tokens_per_s": round(tokens / float(np.median(build_s)), 1),
            "build_over_forward_median": round(float(np.median(ratios)), 3),
            "build_over_forward_per_round": [round(r, 3) for r in ratios]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--data", nargs="+", required=True)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="alternating forward-only / build rounds")
    parser.add_argument("--skip-fidelity", action="store_true", help="only the throughput part")
    parser.add_argument("--device", default="cpu", help="device of the throughput part (cpu or cuda)")
    parser.add_argument("--json", default="docs/results/cache_bench.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer, teacher = models.load_tokenizer(args.teacher), models.load_causal_lm(args.teacher)
    stream = data.token_stream(data.list_text_files(args.data), tokenizer, args.tokens)
    rows, mask = data.pack(stream, args.seq_len)
    table = [] if args.skip_fidelity else encoding_table(teacher, rows, mask, models.vocab_size(teacher),
                                                           args.batch_size)
    speed = throughput(args, teacher.to(args.device), rows, mask)
    result = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "teacher": args.teacher, "encodings": table, "throughput": speed}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'encoding':24s} {'B/token':>8s} {'KL(decoded||exact)':>20s}")
    for r in table:
        print(f"{r['encoding']:24s} {r['target_bytes_per_token']:8.1f} {r['mean_kl_decoded_to_exact']:20.3e}")
    print(f"build {speed['build_tokens_per_s']} tok/s / forward-only {speed['forward_only_tokens_per_s']} tok/s: "
          f"median ratio {speed['build_over_forward_median']} (rounds {speed['build_over_forward_per_round']})")


if __name__ == "__main__":
    main()
