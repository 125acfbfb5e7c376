"""Where a quantised student loses: held-out perplexity with one class of linears (or one block) put back to the
teacher's full-precision weights, everything else as quantised. The gain of each row is what a higher bit width
there could buy at most, which is how the mixed presets (`w4g64-v8`: v_proj at 8 bits) were chosen.

    qat-lora quantize --model smollm2-135m --quant w4g64 --init gptq --cache <cache> --out runs/init-w4
    python benchmarks/module_sensitivity.py --model smollm2-135m --quant w4g64 \\
        --quantizer runs/init-w4/quantizer.safetensors --text runs/selfgen/prefix-320k \\
        --json docs/results/w4g64_sensitivity_train.json

Each row runs the same perplexity as `qat-lora eval` (non-overlapping windows of --seq-len over the first
--max-tokens of --text); the patterns are fnmatch patterns over the linears' names ("*": all of them, the
teacher's own perplexity). --text is calibration or training text: a preset chosen by the evaluation text's
perplexity would be tuned on the text it is judged by, so the assets' evaluation folder is refused.
"""
from __future__ import annotations

import argparse
import fnmatch
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from qat_lora.data import assets, models
from qat_lora.data.text import list_text_files
from qat_lora.quant.fake_quant import quantised_layers
from qat_lora.runtime.files import atomic_write_json
from qat_lora.train.config import StudentSpec
from qat_lora.train.metrics import perplexity
from qat_lora.train.student import build_student

PATTERNS = ("*", "*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*.gate_proj", "*.up_proj", "*.down_proj",
            "*layers.0.*", "*layers.1.*", "*layers.2.*", "*layers.27.*", "*layers.28.*", "*layers.29.*")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="teacher folder, or a fetch-assets teacher name")
    p.add_argument("--quant", default="w4g64", help="the student's preset")
    p.add_argument("--quantizer", default="", help="its quantiser state (a quantize or train run's file)")
    p.add_argument("--text", nargs="+", required=True,
                   help="calibration or training text (files, folders): never the evaluation text")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), help="fnmatch patterns, one row each")
    p.add_argument("--json", required=True, help="results file")
    return p.parse_args(argv)


def training_side_text(paths: list[str]) -> list[Path]:
    """The text files under `paths`, refusing the assets' evaluation text (the presets are judged on it)."""
    try:
        files = list_text_files(paths, "--text")
    except ValueError as err:
        raise SystemExit(str(err)) from None
    held_out = (assets.default_assets_dir() / "text" / "eval").resolve()
    for file in files:
        if file.resolve().is_relative_to(held_out):
            raise SystemExit(f"--text {file}: the evaluation text; measure sensitivity on calibration or training "
                             f"text (the teacher-written text, or {held_out.parent / 'train'})")
    return files


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = args.model  # a fetch-assets teacher's name stands for its folder
    text = [str(p) for p in training_side_text(args.text)]
    student = build_student(StudentSpec(model, args.quant, quantizer=args.quantizer)).eval()
    full = {n: m.weight.detach().clone() for n, m in models.load_causal_lm(model).named_modules()
            if isinstance(m, torch.nn.Linear)}
    tokenizer = models.load_tokenizer(model)
    layers = quantised_layers(student)

    def ppl() -> float:
        return perplexity(student, tokenizer, text, args.seq_len, args.max_tokens, 4, torch.device("cpu"))["ppl"]

    rows = [{"restored": "nothing", "layers": 0, "ppl": ppl()}]
    for pattern in args.patterns:
        chosen = [n for n in layers if fnmatch.fnmatchcase(n, pattern)]
        for name in chosen:  # the teacher's weight in place of Wq, for this row only
            layers[name].forward = (lambda w, b: lambda x: F.linear(x, w.to(x.dtype), b))(full[name], layers[name].bias)
        started = time.perf_counter()
        rows.append({"restored": pattern, "layers": len(chosen), "ppl": ppl(),
                     "seconds": round(time.perf_counter() - started, 1)})
        for name in chosen:
            del layers[name].forward  # back to the class's forward
        print(f"{pattern:14s} {len(chosen):3d} layers  ppl {rows[-1]['ppl']:.3f}  (quantised: {rows[0]['ppl']:.3f})")
    command = "python benchmarks/module_sensitivity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    atomic_write_json(Path(args.json), {"command": command,
                                        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
                                        "date": date.today().isoformat(), "model": args.model, "quant": args.quant,
                                        "quantizer": args.quantizer, "text": text, "seq_len": args.seq_len,
                                        "max_tokens": args.max_tokens, "rows": rows})


if __name__ == "__main__":
    main()
