"""Where a recovery's gain goes on an eval text: the NLL gap closed on tokens whose id occurs in the training cache
("seen") and on the rest ("unseen"), per eval text (issue 30 item 4: why news recovers less than Wikipedia).

    python benchmarks/token_split.py --teacher <assets>/smollm2-135m-instruct --quant w3g64 \
        --quantizer runs/recovery/init/w3g64-gptq-.../quantizer.safetensors \
        --adapter runs/recovery/runs/cpu-small/w3g64-lora-topk-tail-r16-.../adapter \
        --cache runs/recovery/caches/topk-k32-... --text <assets>/text/eval/wikipedia_leads.txt \
        <assets>/text/eval/news_lee.txt --json docs/results/token_split_smollm2.json

Three models score the same windows as benchmarks/recovery.py's perplexity (the first --eval-tokens tokens, windows
of --seq-len opened by the tokenizer's prefix): the teacher, the PTQ start (--quantizer) and the trained student
(--quantizer + --adapter). share_closed = (NLL_start - NLL_trained) / (NLL_start - NLL_teacher), summed over the
tokens of each class; the "all" class is recovery.py's gap recovered in nats.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from qat_lora.data import text as data

from qat_lora.data import models
from qat_lora.cache.reader import KDCache
from qat_lora.train.config import StudentSpec
from qat_lora.train.student import load_student


def training_ids(cache_dir: str) -> set[int]:
    ids: set[int] = set()
    for batch in KDCache(cache_dir).batches("train", 8, shuffle=False, drop_last=False):
        ids.update(batch["input_ids"].flatten().tolist())
    return ids


@torch.no_grad()
def token_nll(model, input_ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Next-token NLL [N, L-1] of every window."""
    rows = []
    for start in range(0, len(input_ids), batch_size):
        ids = input_ids[start:start + batch_size]
        logits = model(input_ids=ids).logits[:, :-1].float()
        rows.append(F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none"))
    return torch.cat(rows)


def split_shares(nll: dict[str, torch.Tensor], valid: torch.Tensor, seen: torch.Tensor) -> dict[str, dict]:
    out = {}
    for part, mask in (("all", valid), ("seen", valid & seen), ("unseen", valid & ~seen)):
        teacher, start, trained = (float(nll[k][mask].sum()) for k in ("teacher", "start", "trained"))
        tokens = int(mask.sum())
        out[part] = {"tokens": tokens, "gap_nats_per_token": (start - teacher) / max(tokens, 1),
                     "share_closed": (start - trained) / (start - teacher) if start != teacher else None}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", required=True, help="full-precision model folder")
    p.add_argument("--quant", required=True, help="the student's preset")
    p.add_argument("--quantizer", default="", help="the PTQ start's quantizer.safetensors (also the trained base)")
    p.add_argument("--adapter", required=True, help="the trained student's adapter/ folder")
    p.add_argument("--cache", required=True, help="the training cache (its training split defines 'seen')")
    p.add_argument("--text", nargs="+", required=True, help="eval text files, each reported on its own")
    p.add_argument("--eval-tokens", type=int, default=8_192)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--json", required=True, help="output JSON")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    tokenizer = models.load_tokenizer(args.teacher)
    seen_ids = training_ids(args.cache)
    specs = {"teacher": (StudentSpec(args.teacher, ""), ""), "start": (StudentSpec(args.teacher, args.quant,
             args.quantizer), ""), "trained": (StudentSpec(args.teacher, args.quant, args.quantizer), args.adapter)}
    windows = {}
    for text in args.text:
        stream = data.token_stream(data.list_text_files([text], "--text"), tokenizer, args.eval_tokens)
        ids, mask = data.pack(stream, args.seq_len, prefix=models.sequence_prefix(tokenizer))
        windows[text] = (torch.from_numpy(np.asarray(ids)).long(), torch.from_numpy(np.asarray(mask)).bool())
    nll: dict[str, dict[str, torch.Tensor]] = {text: {} for text in args.text}
    for name, (spec, adapter) in specs.items():  # one model in memory at a time
        model = load_student(spec, adapter)
        for text, (ids, _) in windows.items():
            nll[text][name] = token_nll(model, ids, args.batch_size)
        del model
    result = {"config": vars(args), "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "texts": {}}
    for text, (ids, mask) in windows.items():
        seen = torch.tensor([[t in seen_ids for t in row] for row in ids[:, 1:].tolist()], dtype=torch.bool)
        result["texts"][Path(text).name] = split_shares(nll[text], mask[:, 1:], seen)
        print(Path(text).name, json.dumps(result["texts"][Path(text).name]))
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
