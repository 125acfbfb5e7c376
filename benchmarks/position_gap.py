"""Where in the context window a quantised student loses: next-token NLL of the teacher and of each student per band
of positions (0-127, 128-255, ... of windows of --seq-len), so a student trained on shorter sequences than it is
evaluated at shows whether the positions it never trained on keep more of the gap.

    python benchmarks/position_gap.py --model smollm2-135m --quant w3g32-v8 --text <assets>/text/train \\
        --student gptq=runs/init/quantizer.safetensors trained=runs/train/quantizer.safetensors \\
        --json docs/results/position_gap.json

The windows are `qat-lora eval`'s (non-overlapping, each opened as the model's sequences are); --text is
calibration or training text, as in module_sensitivity.py (a training length chosen on the evaluation text would be
tuned on the text it is judged by), so the assets' evaluation folder is refused.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import date

import numpy as np
import torch
import torch.nn.functional as F

from module_sensitivity import training_side_text
from qat_lora.data import models
from qat_lora.data import text as data
from qat_lora.runtime.files import atomic_write_json
from qat_lora.train.config import StudentSpec
from qat_lora.train.student import load_student


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="teacher folder, or a fetch-assets teacher name")
    p.add_argument("--quant", required=True, help="the students' preset")
    p.add_argument("--student", nargs="+", required=True, metavar="LABEL=QUANTIZER",
                   help="students: a label and its quantiser state (a quantize or train run's file)")
    p.add_argument("--text", nargs="+", required=True, help="calibration or training text: never the evaluation text")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--band", type=int, default=128, help="positions per band")
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--json", required=True, help="results file")
    args = p.parse_args(argv)
    if any("=" not in s for s in args.student):
        p.error("--student: pass LABEL=QUANTIZER (e.g. gptq=runs/init/quantizer.safetensors)")
    return args


@torch.no_grad()
def band_nll(model, input_ids: torch.Tensor, mask: torch.Tensor, band: int) -> list[float]:
    """Mean next-token NLL per band of target positions (position t predicts token t + 1)."""
    sums = torch.zeros(input_ids.shape[1] - 1, dtype=torch.float64)
    counts = torch.zeros_like(sums)
    for start in range(0, len(input_ids), 4):
        ids, real = input_ids[start:start + 4], mask[start:start + 4]
        logits = model(input_ids=ids, attention_mask=real).logits[:, :-1].float()
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        sums += (nll * real[:, 1:]).sum(0).double()
        counts += real[:, 1:].sum(0).double()
    return [float(sums[i:i + band].sum() / counts[i:i + band].sum()) for i in range(0, len(sums), band)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    text = training_side_text(args.text)
    tokenizer = models.load_tokenizer(args.model)
    stream = data.token_stream(text, tokenizer, args.max_tokens)
    ids, mask = data.pack(stream, args.seq_len, prefix=models.sequence_prefix(tokenizer))
    ids, mask = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))
    rows, started = {}, time.perf_counter()
    for label, quantizer in [("teacher", None)] + [tuple(s.split("=", 1)) for s in args.student]:
        spec = StudentSpec(args.model, "" if quantizer is None else args.quant, quantizer or "")
        rows[label] = band_nll(load_student(spec, "", "sdpa").eval(), ids, mask, args.band)
        gaps = [round(s - t, 4) for s, t in zip(rows[label], rows["teacher"])]
        print(f"{label}: NLL per band {[round(v, 4) for v in rows[label]]}, minus the teacher's {gaps}", flush=True)
    command = "python benchmarks/position_gap.py " + " ".join(argv if argv is not None else sys.argv[1:])
    atomic_write_json(args.json, {
        "command": command, "date": str(date.today()),
        "machine": f"{platform.machine()} cpu ({torch.get_num_threads()} threads)", "model": args.model,
        "quant": args.quant, "students": dict(s.split("=", 1) for s in args.student),
        "text": [str(p) for p in args.text], "seq_len": args.seq_len, "band": args.band, "windows": len(ids),
        "tokens": int(mask.sum()), "seconds": round(time.perf_counter() - started, 1), "nll": rows,
        "gap_nats": {k: [s - t for s, t in zip(v, rows["teacher"])] for k, v in rows.items()}})


if __name__ == "__main__":
    main()
