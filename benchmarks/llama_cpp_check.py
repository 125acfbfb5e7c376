"""The exported GGUF, run by llama.cpp itself: held-out perplexity and logits next to the toolkit's own (issue 18).

    # llama.cpp from llama-cpp-python's source package (its vendored llama.cpp, its CMake configuration):
    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    pip install --no-deps -e llama_cpp_python-*/   # or, on a small machine, only the libraries:
    #   cmake -S llama_cpp_python-* -B build -G Ninja -DLLAVA_BUILD=OFF && ninja -C build llama
    #   export LLAMA_CPP_LIB_PATH=$PWD/build/bin PYTHONPATH=$PWD/llama_cpp_python-*
    python benchmarks/llama_cpp_check.py --quant q4_k --tokens 4096 --seq-len 256 [--adapter RUN/adapter]
    python benchmarks/llama_cpp_check.py --tiny-arch qwen3 --quant q4_0 --random-adapter 8

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
`--tiny-arch qwen2|qwen3` checks the Qwen layouts on a random 4-layer model with the teacher's vocabulary and a
Qwen2-style pre-tokenizer (no Qwen checkpoint is on this machine): logits only, its perplexity means nothing.
Not part of CI: it needs llama.cpp built (~30 min on 2 cores). Prints one JSON line (`--json` also writes it).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from qat_lora import data
from qat_lora.assets import Assets, default_assets_dir
from qat_lora.config import StudentSpec
from qat_lora.gguf_export import GGUF_FILE, save_gguf
from qat_lora.gguf_lora import ADAPTER_FILE, save_gguf_lora
from qat_lora.lora import add_recovery_lora_
from qat_lora.metrics import perplexity
from qat_lora.models import load_tokenizer
from qat_lora.student import load_student

ASSETS = Assets.at(default_assets_dir())


def llama_cpp_scores(gguf_path: str, windows: np.ndarray, mask: np.ndarray, threads: int,
                     lora_path: str | None) -> tuple[dict, np.ndarray]:
    """(exp(mean NLL) of every window's next tokens where `mask` marks real tokens, first window's logits
    [n, vocab]), scored by llama.cpp on the file, the LoRA adapter file applied at run time if given."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf_path, n_ctx=windows.shape[1], logits_all=True, n_threads=threads, verbose=False,
                lora_path=lora_path)
    nll, count, first = 0.0, 0, None
    for ids, real in zip(windows, mask):
        n = int(real.sum())
        llm.reset()
        llm.eval([int(t) for t in ids[:n]])
        logits = np.asarray(llm.scores[:n], dtype=np.float64)  # [n, vocab]
        first = logits if first is None else first
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(n - 1), ids[1:n]].sum())
        count += n - 1
    return {"ppl": math.exp(nll / max(count, 1)), "nll": nll / max(count, 1), "tokens": count}, first


def emulate_llama_cpp_arithmetic_(student) -> None:
    """Make the student compute as llama.cpp's CPU kernels do, to tell their rounding from an export error:
    embeddings and head rounded to F16 (as stored), and every quantised linear's input quantised to 8 bits per
    block (Q8_K: 256 for K-quant layers, Q8_0: 32 otherwise; scale = max |x| / 127), as ggml's dot products take it."""
    from qat_lora.quant import FakeQuantLinear
    from qat_lora.quant_init import snap_fp16

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
            block = 256 if layer.cfg.scheme == "kquant" else 32
            layer.register_forward_pre_hook(lambda m, args, b=block: (q8(args[0], b), *args[1:]))


def tiny_model_dir(arch: str, tokenizer, out: Path) -> Path:
    """A random 4-layer Qwen2 (q/k/v biases) or Qwen3 (q/k norms, head_dim 128 as released Qwen3s) with the
    teacher's vocabulary, its tokenizer given Qwen2's split regex so the GGUF states the `qwen2` pre-tokenizer."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    common = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rope_theta=1e6,
                  initializer_range=0.05, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    config = Qwen3Config(head_dim=128, **common) if arch == "qwen3" else Qwen2Config(**common)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ASSETS.teacher_dir), help="full-precision model folder or .gguf")
    parser.add_argument("--tiny-arch", choices=("qwen2", "qwen3"), help="a random tiny model of this architecture")
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
        windows, mask = (np.asarray(x) for x in data.pack(stream, args.seq_len))  # the windows perplexity scored
        n = int(mask[0].sum())
        with torch.no_grad():
            our_logits = student(input_ids=torch.from_numpy(windows[:1, :n]).long()).logits[0].double().numpy()
        teacher_gguf = model if model.endswith(".gguf") else None
        # PEFT wraps the linears in place: the GGUF base is written from a student built without the adapter
        base = load_student(StudentSpec(model, args.quant, args.quantizer)) if adapted else student
        report = save_gguf(base, tmp, tokenizer, "student", teacher_gguf)
        lora = save_gguf_lora(student, tmp) if adapted else None
        theirs, their_logits = llama_cpp_scores(f"{tmp}/{GGUF_FILE}", windows, mask, args.threads,
                                                f"{tmp}/{ADAPTER_FILE}" if adapted else None)
        if args.emulate_activations:  # after the logits above: those are the plain student's
            emulate_llama_cpp_arithmetic_(student)
            emulated = perplexity(student, tokenizer, [args.eval_text], args.seq_len, args.tokens, 4,
                                  torch.device("cpu"))
    diff = np.abs(their_logits - our_logits)
    logp = {k: v - v.max(-1, keepdims=True) for k, v in (("ours", our_logits), ("theirs", their_logits))}
    logp = {k: v - np.log(np.exp(v).sum(-1, keepdims=True)) for k, v in logp.items()}
    kl = float((np.exp(logp["ours"]) * (logp["ours"] - logp["theirs"])).sum(-1).mean())  # KL(ours || llama.cpp)
    record = {"model": args.tiny_arch or Path(args.model).name, "quant": args.quant, "quantizer": args.quantizer,
              "adapter": args.adapter or (f"random r{args.random_adapter}" if args.random_adapter else ""),
              "seq_len": args.seq_len, "toolkit": ours, "llama_cpp": theirs, "ratio": theirs["ppl"] / ours["ppl"],
              "toolkit_emulated": emulated if args.emulate_activations else None,
              "logits_max_abs_diff": float(diff.max()), "logits_std": float(our_logits.std()),
              "logits_max_rel_diff": float(diff.max() / our_logits.std()),
              "logits_mean_abs_diff": float(diff.mean()), "kl_ours_to_llama_cpp": kl,
              "top1_agreement": float((their_logits.argmax(-1) == our_logits.argmax(-1)).mean()),
              "types": report["types"], "exact_layers": report["exact_layers"],
              "bits_per_weight": report["bits_per_weight"], "adapter_bytes": lora["bytes"] if lora else 0,
              "cpu": platform.machine(), "date": time.strftime("%Y-%m-%d"),
              "wall_s": round(time.perf_counter() - started, 1)}
    line = json.dumps(record)
    print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(line + "\n")


if __name__ == "__main__":
    main()
