"""The exported GGUF, run by llama.cpp itself: held-out perplexity next to the toolkit's own (issue 18).

    pip install --no-binary llama-cpp-python llama-cpp-python   # builds llama.cpp from its source package
    python benchmarks/llama_cpp_check.py --quant q4_k --tokens 4096 --seq-len 256

Builds the student (`--quant`, optionally a trained `--quantizer`), writes its GGUF with `save_gguf`, and scores
the same non-overlapping windows of the held-out text twice: the fp32 fake-quant student (metrics.perplexity)
and llama.cpp on the file (llama-cpp-python, CPU). Not part of CI: it needs a compiler and ~10 min of build.
Prints one JSON line: both perplexities, their ratio, and the export's types and bits per weight.
Not yet run (2026-11-24): the llama.cpp build did not finish within the session on a shared 2-core machine
(24 of 178 objects after 27 min at nice 19), so no figure from it is in docs/BENCHMARKS.md yet.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time

import numpy as np
import torch

from qat_lora import data
from qat_lora.assets import Assets, default_assets_dir
from qat_lora.config import StudentSpec
from qat_lora.gguf_export import GGUF_FILE, save_gguf
from qat_lora.metrics import perplexity
from qat_lora.models import load_tokenizer
from qat_lora.student import load_student

ASSETS = Assets.at(default_assets_dir())


def llama_cpp_perplexity(gguf_path: str, windows: np.ndarray, mask: np.ndarray, threads: int) -> dict:
    """exp(mean NLL) of every window's next tokens (where `mask` marks real tokens), scored by llama.cpp."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf_path, n_ctx=windows.shape[1], logits_all=True, n_threads=threads, verbose=False)
    nll, count = 0.0, 0
    for ids, real in zip(windows, mask):
        n = int(real.sum())
        llm.reset()
        llm.eval([int(t) for t in ids[:n]])
        logits = np.asarray(llm.scores[:n], dtype=np.float64)  # [n, vocab]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(n - 1), ids[1:n]].sum())
        count += n - 1
    return {"ppl": math.exp(nll / max(count, 1)), "nll": nll / max(count, 1), "tokens": count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ASSETS.teacher_dir), help="full-precision model folder or .gguf")
    parser.add_argument("--quant", default="q4_k")
    parser.add_argument("--quantizer", default="", help="a qat run's quantizer.safetensors (default: PTQ init)")
    parser.add_argument("--eval-text", default=str(ASSETS.eval_text))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    started = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    student = load_student(StudentSpec(args.model, args.quant, args.quantizer))
    ours = perplexity(student, tokenizer, [args.eval_text], args.seq_len, args.tokens, 4, torch.device("cpu"))
    stream = data.token_stream(data.list_text_files([args.eval_text]), tokenizer, args.tokens)
    windows, mask = data.pack(stream, args.seq_len)  # the windows metrics.perplexity scored
    with tempfile.TemporaryDirectory() as tmp:
        teacher_gguf = args.model if args.model.endswith(".gguf") else None
        report = save_gguf(student, tmp, tokenizer, "student", teacher_gguf)
        theirs = llama_cpp_perplexity(f"{tmp}/{GGUF_FILE}", np.asarray(windows), np.asarray(mask), args.threads)
    print(json.dumps({"quant": args.quant, "quantizer": args.quantizer, "seq_len": args.seq_len,
                      "toolkit": ours, "llama_cpp": theirs, "ratio": theirs["ppl"] / ours["ppl"],
                      "types": report["types"], "exact_layers": report["exact_layers"],
                      "bits_per_weight": report["bits_per_weight"], "cpu": platform.machine(),
                      "wall_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
