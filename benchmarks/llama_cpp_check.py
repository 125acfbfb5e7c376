"""The exported GGUF, run by llama.cpp itself: held-out perplexity and logits next to the toolkit's own (issues 18,
28).

    # llama.cpp from llama-cpp-python's source package (its vendored llama.cpp, its CMake configuration):
    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    pip install --no-deps -e llama_cpp_python-*/   # or, on a small machine, only the libraries:
    #   cmake -S llama_cpp_python-* -B build -G Ninja -DLLAVA_BUILD=OFF && ninja -C build llama
    #   export LLAMA_CPP_LIB_PATH=$PWD/build/bin PYTHONPATH=$PWD/llama_cpp_python-*
    python benchmarks/llama_cpp_check.py --quant q4_k --tokens 4096 --seq-len 256 [--adapter RUN/adapter]
    python benchmarks/llama_cpp_check.py --tiny-arch qwen3 --quant q4_0 --random-adapter 8
    python benchmarks/llama_cpp_check.py --model GEMMA3_DIR --quant q4_0 --tokens 4096 --seq-len 1024 --no-repack

Builds the student (`--quant`, optionally a trained `--quantizer` and a recovery `--adapter`, or a random stand-in
adapter with `--random-adapter R`), writes its GGUF (and adapter.gguf) with the export's own writers, and scores
the same non-overlapping windows of the held-out text twice: the fp32 fake-quant student (metrics.perplexity) and
llama.cpp on the file (llama-cpp-python, CPU, the adapter applied at run time as `--lora` does). Both also give the
logits of the first window: their differences (largest, mean, relative to the logits' spread), the KL between the
two next-token distributions and their top-1 agreement are the second set of figures. llama.cpp's CPU kernels
multiply quantised weights by activations quantised to 8 bits (Q8_0 / Q8_K) and store embeddings and head at F16,
so its logits are close to ours, not equal; the perplexity is the figure to hold within 1 %. With
`--emulate-activations` the student is also scored with that arithmetic (`toolkit_emulated`): what remains between
it and llama.cpp is neither the export's nor the activations'.
`--kv-f32` keeps llama.cpp's KV cache in F32 (default F16), another of its roundings told apart.
`--tiny-arch llama|mistral|qwen2|qwen3|gemma3_text|phi3` checks a family's layout on a random model with the
teacher's vocabulary (Qwen: a Qwen2-style pre-tokenizer; Gemma 3: 6 layers, a 128-token window): logits only, its
perplexity means nothing. Every record also says whether llama.cpp's tokenizer, reading the file's vocabulary,
gives the HF tokenizer's ids on the start of the eval text (`tokenizer_agreement`). `--no-repack` loads llama.cpp's
weights without its AMX / repacked buffers, whose kernels crashed on this host for Gemma 3 and the tiny models.
Not part of CI: it needs llama.cpp built (bash benchmarks/build_llama_cpp.sh). Prints one JSON line (`--json`
also writes it).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from qat_lora.data import text as data
from qat_lora.data.assets import Assets, default_assets_dir
from qat_lora.train.config import StudentSpec
from qat_lora.export.gguf.writer import GGUF_FILE, save_gguf
from qat_lora.export.gguf.lora import ADAPTER_FILE, save_gguf_lora
from qat_lora.train.lora import add_recovery_lora_
from qat_lora.train.metrics import perplexity
from qat_lora.data.models import load_tokenizer, sequence_prefix
from qat_lora.train.student import load_student

ASSETS = Assets.at(default_assets_dir())


def load_llama_cpp(gguf_path: str, n_ctx: int, threads: int, lora_path: str | None, repack: bool = True,
                   kv_f32: bool = False):
    """llama.cpp (llama-cpp-python's Llama) on the file, every position's logits kept, the adapter applied at run
    time if given. `repack=False` loads the weights into plain CPU buffers, without the AMX / repacked ones (whose
    kernels crashed on this host: the tiny models, Gemma 3); `kv_f32` keeps keys and values in F32 instead of
    llama.cpp's default F16, to tell that rounding from the rest."""
    import llama_cpp
    from llama_cpp import Llama

    default = llama_cpp.llama_cpp.llama_model_default_params
    if not repack:  # the binding takes no such argument: its default parameters are swapped for the load
        def plain():
            params = default()
            params.use_extra_bufts = False
            return params
        llama_cpp.llama_cpp.llama_model_default_params = plain
    try:
        kv = {"type_k": 0, "type_v": 0} if kv_f32 else {}  # 0: GGML_TYPE_F32
        return Llama(model_path=gguf_path, n_ctx=n_ctx, logits_all=True, n_threads=threads, verbose=False,
                     lora_path=lora_path, **kv)
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default


ROWS = 64  # logit rows turned to float64 at a time: a 262k vocabulary (Gemma 3) makes a whole window GBs


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis."""
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def llama_cpp_scores(llm, windows: np.ndarray, mask: np.ndarray, keep: int) -> tuple[dict, np.ndarray]:
    """(exp(mean NLL) of every window's next tokens where `mask` marks real tokens, the first `keep` positions'
    logits of the first window [keep, vocab] float32), scored by llama.cpp."""
    nll, count, first = 0.0, 0, None
    for ids, real in zip(windows, mask):
        n = int(real.sum())
        llm.reset()
        llm.eval([int(t) for t in ids[:n]])
        logits = np.asarray(llm.scores[:n])  # [n, vocab] float32, llama-cpp-python's own buffer
        first = logits[:keep].copy() if first is None else first
        for start in range(0, n - 1, ROWS):
            stop = min(start + ROWS, n - 1)
            logp = _log_softmax(logits[start:stop])
            nll -= float(logp[np.arange(stop - start), ids[start + 1:stop + 1]].sum())
        count += n - 1
    return {"ppl": math.exp(nll / max(count, 1)), "nll": nll / max(count, 1), "tokens": count}, first


def compare_logits(ours: np.ndarray, theirs: np.ndarray) -> dict:
    """Differences between two [n, vocab] logit arrays: largest, mean, relative to our logits' spread, the mean
    KL(ours || theirs) of the next-token distributions and their top-1 agreement (row chunks in float64)."""
    kl, largest, total = 0.0, 0.0, 0.0
    for start in range(0, len(ours), ROWS):
        a, b = ours[start:start + ROWS].astype(np.float64), theirs[start:start + ROWS].astype(np.float64)
        diff = np.abs(a - b)
        largest, total = max(largest, float(diff.max())), total + float(diff.sum())
        la, lb = _log_softmax(a), _log_softmax(b)
        kl += float((np.exp(la) * (la - lb)).sum())
    std = float(ours.astype(np.float64).std())
    return {"logits_max_abs_diff": largest, "logits_std": std, "logits_max_rel_diff": largest / std,
            "logits_mean_abs_diff": total / ours.size, "kl_ours_to_llama_cpp": kl / len(ours),
            "top1_agreement": float((theirs.argmax(-1) == ours.argmax(-1)).mean())}


def emulate_llama_cpp_arithmetic_(student) -> None:
    """Make the student compute as llama.cpp's CPU kernels do, to tell their rounding from an export error:
    embeddings and head rounded to F16 (as stored), and every quantised linear's input quantised to 8 bits per
    block (Q8_K: 256 for K-quant layers, Q8_0: 32 otherwise; scale = max |x| / 127), as ggml's dot products take it."""
    from qat_lora.quant.fake_quant import FakeQuantLinear
    from qat_lora.quant.inits import snap_fp16

    def q8(x: torch.Tensor, block: int) -> torch.Tensor:
        blocks = x.reshape(-1, block)
        d = blocks.abs().amax(-1, keepdim=True) / 127
        d = torch.where(d == 0, torch.ones_like(d), d)
        return (torch.round(blocks / d).clamp(-127, 127) * d).reshape(x.shape)

    with torch.no_grad():
        for p in (student.get_input_embeddings().weight, student.get_output_embeddings().weight):
            p.copy_(snap_fp16(p))
    for layer in student.modules():
        if isinstance(layer, FakeQuantLinear):
            block = layer.quantizer.gguf_block
            layer.register_forward_pre_hook(lambda m, args, b=block: (q8(args[0], b), *args[1:]))


TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")


def tiny_model_dir(arch: str, tokenizer, out: Path) -> Path:
    """A random 4-layer model of a GGUF family with the teacher's vocabulary: Qwen2 (q/k/v biases) or Qwen3 (q/k
    norms, head_dim 128 as released Qwen3s) with the tokenizer given Qwen2's split regex so the GGUF states the
    `qwen2` pre-tokenizer; Gemma 3 with 6 layers (5 local, 1 global) and a 128-token window, so windows of 256
    tokens exercise llama.cpp's sliding-window attention; Llama, Mistral, Phi-3 (fused qkv / gate_up) plain."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    common = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.05,
                  tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    extra = {"qwen2": dict(rope_theta=1e6), "qwen3": dict(head_dim=128, rope_theta=1e6),
             "gemma3_text": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=128, num_hidden_layers=6),
             "phi3": dict(original_max_position_embeddings=1024, tie_word_embeddings=False)}.get(arch, {})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **{**common, **extra})).save_pretrained(out)
    if arch.startswith("qwen"):
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ASSETS.teacher_dir), help="full-precision model folder or .gguf")
    parser.add_argument("--tiny-arch", choices=TINY_FAMILIES, help="a random tiny model of this family")
    parser.add_argument("--quant", default="q4_k")
    parser.add_argument("--quantizer", default="", help="a qat run's quantizer.safetensors (default: PTQ init)")
    parser.add_argument("--adapter", default="", help="a recovery run's adapter/ (PEFT), applied by llama.cpp")
    parser.add_argument("--random-adapter", type=int, default=0, help="rank of a random stand-in adapter (0: none)")
    parser.add_argument("--eval-text", default=str(ASSETS.eval_text))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--emulate-activations", action="store_true",
                        help="also score the student with llama.cpp's F16 embeddings and 8-bit activations")
    parser.add_argument("--logit-positions", type=int, default=256,
                        help="positions of the first window whose logits are compared")
    parser.add_argument("--no-repack", action="store_true",
                        help="load llama.cpp's weights without AMX / repacked buffers (needed for the tiny models)")
    parser.add_argument("--kv-f32", action="store_true", help="llama.cpp's KV cache in F32 (default: F16)")
    parser.add_argument("--json", default="", help="also write the record here")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        tokenizer = load_tokenizer(model)
        if args.tiny_arch:
            model = str(tiny_model_dir(args.tiny_arch, tokenizer, Path(tmp) / "tiny"))
        student = load_student(StudentSpec(model, args.quant, args.quantizer), args.adapter)
        if args.random_adapter:  # B random (a trained B is non-zero), so the adapter changes every logit
            student = add_recovery_lora_(student, r=args.random_adapter, alpha=2.0 * args.random_adapter).eval()
            with torch.no_grad():
                gen = torch.Generator().manual_seed(0)
                for name, p in student.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
        adapted = hasattr(student, "get_base_model")
        ours = perplexity(student, tokenizer, [args.eval_text], args.seq_len, args.tokens, 4, torch.device("cpu"))
        stream = data.token_stream(data.list_text_files([args.eval_text]), tokenizer, args.tokens)
        # the windows perplexity scored: each opened by BOS where the model needs one (Gemma)
        windows, mask = (np.asarray(x) for x in data.pack(stream, args.seq_len, prefix=sequence_prefix(tokenizer)))
        n = int(mask[0].sum())
        keep = min(n, args.logit_positions)
        with torch.no_grad():  # causal: the first `keep` positions' logits need only the first `keep` tokens
            our_logits = student(input_ids=torch.from_numpy(windows[:1, :keep]).long()).logits[0].numpy()
        teacher_gguf = model if model.endswith(".gguf") else None
        # PEFT wraps the linears in place: the GGUF base is written from a student built without the adapter
        base = load_student(StudentSpec(model, args.quant, args.quantizer)) if adapted else student
        report = save_gguf(base, tmp, tokenizer, "student", teacher_gguf)
        lora = save_gguf_lora(student, tmp) if adapted else None
        if args.emulate_activations:  # after the logits above and the file: those are the plain student's
            emulate_llama_cpp_arithmetic_(student)
            emulated = perplexity(student, tokenizer, [args.eval_text], args.seq_len, args.tokens, 4,
                                  torch.device("cpu"))
        del student, base  # llama.cpp's logits buffers take GBs with a 262k vocabulary: make room first
        gc.collect()
        llm = load_llama_cpp(f"{tmp}/{GGUF_FILE}", windows.shape[1], args.threads,
                             f"{tmp}/{ADAPTER_FILE}" if adapted else None, repack=not args.no_repack,
                             kv_f32=args.kv_f32)
        theirs, their_logits = llama_cpp_scores(llm, windows, mask, keep)
        # the file's own tokenizer against the HF one, on the start of the eval text (no BOS on either side)
        sample = data.list_text_files([args.eval_text])[0].read_text(encoding="utf-8")[:20000]
        hf_ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
        cpp_ids = llm.tokenize(sample.encode("utf-8"), add_bos=False, special=False)
        same = next((i for i, (a, b) in enumerate(zip(hf_ids, cpp_ids)) if a != b), min(len(hf_ids), len(cpp_ids)))
    record = {"model": args.tiny_arch or Path(args.model).name, "quant": args.quant, "quantizer": args.quantizer,
              "adapter": args.adapter or (f"random r{args.random_adapter}" if args.random_adapter else ""),
              "seq_len": args.seq_len, "toolkit": ours, "llama_cpp": theirs, "ratio": theirs["ppl"] / ours["ppl"],
              "toolkit_emulated": emulated if args.emulate_activations else None, "logit_positions": keep,
              **compare_logits(our_logits, their_logits),
              "types": report["types"], "exact_layers": report["exact_layers"], "layers": len(report["layers"]),
              "arch": report["arch"], "repack": not args.no_repack, "kv_cache": "f32" if args.kv_f32 else "f16",
              "tokenizer_agreement": {"hf_tokens": len(hf_ids), "llama_cpp_tokens": len(cpp_ids),
                                      "identical_prefix": same},
              "bits_per_weight": report["bits_per_weight"], "adapter_bytes": lora["bytes"] if lora else 0,
              "cpu": platform.machine(), "date": time.strftime("%Y-%m-%d"),
              "wall_s": round(time.perf_counter() - started, 1)}
    write_record(record, args.json)


def write_record(record: dict, json_path: str) -> None:
    """Print the record as one JSON line and, with a path, write it there too."""
    line = json.dumps(record)
    print(line)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(line + "\n")


if __name__ == "__main__":
    main()
