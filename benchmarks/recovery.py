"""Recovery benchmark (issue 6): how much of the quantisation loss the toolkit recovers, for how much compute.

For the teacher (SmolLM2-135M-Instruct by default) it builds one top-K and one sampled KD cache of offline prose
(never the eval text), then evaluates, for each preset, held-out perplexity on Wikipedia leads (context
--eval-seq-len) and KD KL / top-1 agreement on the top-K cache's held-out split for these rows (`method`):

    teacher                the full-precision model
    ptq-rtn, ptq-init      post-training quantisation: round-to-nearest (uniform codebook for LUT presets), and the
                           best cheap init (MSE clipping search for int, k-means codebook for LUT)
    ptq-hqq                HQQ-style data-free fit of zero and scale (half-quadratic, l_p < 1 shrinkage)
    ptq-act, ptq-gptq      data-aware inits (`qat-lora quantize`), calibrated on --calib-sequences of the top-K
                           cache's training split: activation-weighted clipping; GPTQ (the weights move)
    ptq-blockwise          GPTQ, then block-wise reconstruction (--blockwise-steps per decoder block, teacher's
                           block outputs as targets; still no end-to-end training)
    lora-topk-renorm       recovery LoRA on top-K targets renormalised over the K (tail dropped; the baseline)
    lora-topk-tail         recovery LoRA on top-K + tail targets (the default; the only one swept over --ranks)
    lora-sampled           recovery LoRA on sampled (RS-KD) targets at about the top-K cache's bytes per token
                           (or --sampled-n draws)
    lora-topk-wide         recovery LoRA on top-K + tail targets of a wider cache (--wide-top-k, default 128)
    lora-online            recovery LoRA on the teacher's whole distribution, computed in each step
                           (`train --online-teacher`; no target bytes: the top-K cache gives only the tokens)
    lora-topk-tail-ce      recovery LoRA on half top-K + tail KD, half next-token CE on the text (alpha = 0.5): on
                           teacher-written text the next token is a teacher sample, so the CE term is a one-sample
                           estimate of the KL over the whole vocabulary, tail included
    ce-only                recovery LoRA on plain next-token cross-entropy, no teacher (alpha = 0)
    qat                    the quantiser's own parameters (scales, zeros, codebooks) trained by KD
    qat-online             qat on the teacher's whole distribution, computed in each step (as lora-online)
    qat-norms              qat with the normalisation weights trained too (`train --train-norms`: fp16 vectors
                           the model ships anyway, so the same bits)
    qat+lora               qat, then recovery LoRA on top of its quantiser (tokens and wall time of both stages)
    lora-qat               recovery LoRA and the quantiser's scales and zeros trained together, one stage (`train
                           --preset qat+lora`; the scales at --lr x --quantizer-lr-ratio); the adapter ships
                           with the trained grid
    weight-qat             the latent weights with the quantiser (STE; weights at --weight-lr), saved on the grid
    weight-qat+lora        weight-qat, then recovery LoRA on top of it
    weight-qat-norms       weight-qat with the normalisation weights trained too (as qat-norms)
    weight-qat-online      weight-qat on the teacher's whole distribution, computed in each step (as qat-online)

`--start preset|act|gptq` chooses the init every trained row starts from (default: the preset's own): the
matching PTQ row is run first and its quantiser state file is every training run's `--quantizer`.

Every record holds `gap_recovered` = (ppl_ptq - ppl) / (ppl_ptq - ppl_teacher) and `gap_recovered_nats` (the same
on NLL), where ptq is the PTQ row the trained student starts from (`start_init`: the preset's own init), the
training tokens, the wall time (PTQ rows: the init; trained rows: the training loop of every stage; the shared
cache build is `cache_build_s`), the device and the run folder. Results go to --json, a markdown table next to it
(.md) and PNG plots (loss curves per preset, gap recovered per method).

CPU, small budget (the defaults: 40 steps of 4 x 256 tokens per run, ~41 k tokens). Measured on an idle 2-core
host (docs/RESULTS.md): ~7 s per step, ~5 min per run, ~35 s per evaluation, ~9 min per cache (on a loaded
host); the 2-bit and LUT presets' MSE / k-means init (~1-2 min) is computed once per preset, by its PTQ row, and
reused by every run through TrainConfig.quantizer:

    python benchmarks/recovery.py --ranks 16 --presets w3g64 w2g32 --budget-name cpu-small

GPU, full budget (~5 M training tokens per run, every preset, method and rank; training under bf16 autocast, as
`--precision auto` means on CUDA: pass `--precision fp32` for rows that compare with the CPU's):

    python benchmarks/recovery.py --device cuda --budget-name gpu-5m --max-steps 1200 --batch-size 8 \\
        --seq-len 512 --cache-tokens 5000000 --eval-tokens 65536

Resumable: rerun the same command. Rows already in --json (same key: budget, preset, method, rank and a digest of
every setting that changes the numbers) are skipped; the JSON is rewritten atomically after each row; caches are
built once (an interrupted build continues); each training run has its own folder under --work and continues from
its last checkpoint (TrainConfig.resume="auto"). Keys and cache folders name --train-text by its path; its
content is checked against the cache and the recorded rows, so a text rewritten in place is refused, not reused.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch

from qat_lora.data import text as data

from qat_lora.runtime import device as dev
from qat_lora.runtime import precision

from qat_lora.data import models
from qat_lora.data.assets import Assets, default_assets_dir
from qat_lora.data.teachers import TEACHERS
from qat_lora.cache.reader import MANIFEST, TOKEN_BYTES, KDCache, inspect_cache
from qat_lora.cache.builder import build_cache
from qat_lora.train.config import LORA_INITS, TRAIN_PRESETS, StudentSpec, TrainConfig
from qat_lora.commands.config import QuantizeConfig
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.cache.encodings import SampledEncoding, TopKEncoding, encode_rows
from qat_lora.runtime.files import atomic_write_json
from qat_lora.train.metrics import kd_metrics, perplexity
from qat_lora.train.loss import KDLossConfig
from qat_lora.commands.quantize import quantize
from qat_lora.quant.fake_quant import PRESETS, get_preset, quant_config_dict, quantize_
from qat_lora.runtime.runs import read_metrics
from qat_lora.quant.state import FULL_PRECISION_BITS, bits_per_weight, quantizer_state_dict
from qat_lora.train.student import adapter_bits_per_weight, build_student, load_student, resolve_attn
from qat_lora.train.trainer import train

ASSETS = Assets.at(default_assets_dir())  # `qat-lora fetch-assets`; override with --teacher/--train-text/--eval-text
PTQ_INITS = {"ptq-rtn": "rtn", "ptq-init": "mse", "ptq-hqq": "hqq"}  # QuantConfig.init of each PTQ row
# Data-aware PTQ rows -> their init (`qat-lora quantize`); "blockwise" is GPTQ then --blockwise-steps per block.
DATA_INITS = {"ptq-act": "act", "ptq-gptq": "gptq", "ptq-blockwise": "blockwise"}
# TrainConfig fields each trained method sets on top of the shared ones; the `+lora` methods chain their first
# stage (qat, weight-qat) and lora-topk-tail over its quantiser state.
TRAINED = {"lora-topk-renorm": {"renormalize_topk": True}, "lora-topk-tail": {}, "lora-sampled": {},
           "lora-topk-wide": {}, "lora-online": {},
           "lora-topk-tail-ce": {"alpha": 0.5}, "ce-only": {"alpha": 0.0}, "qat": {"preset": "qat"},
           "qat-online": {"preset": "qat"}, "qat+lora": {},
           "qat-norms": {"preset": "qat", "train_norms": True},
           "weight-qat": {"preset": "weight-qat"}, "weight-qat+lora": {}, "lora-qat": {"preset": "qat+lora"},
           "weight-qat-norms": {"preset": "weight-qat", "train_norms": True},
           "weight-qat-online": {"preset": "weight-qat"}}
CHAINS = {"qat+lora": "qat", "weight-qat+lora": "weight-qat"}  # chained method -> its first stage
# The cache each method trains on (default: the top-K cache); every cache holds the same token sequences, so the
# rows differ only in their targets. The online methods read the top-K cache's tokens and ignore its targets.
ONLINE_METHODS = ("lora-online", "qat-online", "weight-qat-online")
TRAIN_CACHE = {"lora-sampled": "sampled", "lora-topk-wide": "wide"}
# The latent weights train too, at --weight-lr.
WEIGHT_QAT_METHODS = ("weight-qat", "weight-qat-norms", "weight-qat-online")
QAT_METHODS = ("qat", "qat-online", "qat-norms", *WEIGHT_QAT_METHODS)  # the base's own parameters train, at --qat-lr
BASE_ONLY_METHODS = ("teacher", *QAT_METHODS)  # rows with no adapter
METHODS = ("teacher", *PTQ_INITS, *DATA_INITS, *TRAINED)
STARTS = ("preset", *DATA_INITS.values())
HOLDOUT_FRACTION = 0.05  # documents of the training prose held out for the KD metrics (as the demo)
SAMPLED_TOLERANCE = 0.15  # |sampled / top-K bytes per token - 1| above this is reported as unmatched


@dataclass(frozen=True)
class Row:
    preset: str | None  # None: the teacher
    method: str
    lora_r: int | None = None

    @property
    def label(self) -> str:
        if self.preset is None:
            return self.method
        return f"{self.preset}/{self.method}" + (f"/r{self.lora_r}" if self.lora_r else "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", default=str(ASSETS.teacher_dir),
                   help=f"full-precision transformers model folder, or a fetch-assets teacher ({', '.join(TEACHERS)})")
    p.add_argument("--train-text", nargs="+", default=[str(ASSETS.train_text_dir)], help="training prose (files, folders)")
    p.add_argument("--eval-text", default=str(ASSETS.eval_text), help="held-out text for perplexity (never trained on)")
    p.add_argument("--news-text", default=str(ASSETS.eval_text_news),
                   help="a second held-out domain for perplexity (the Lee news articles; never trained or tuned on; "
                        "'' to skip): every row's ppl_news, so a recipe that fits only one domain shows")
    p.add_argument("--work", default="runs/recovery", help="folder for the caches and the training runs")
    p.add_argument("--json", default="docs/results/recovery.json", help="results; the .md table and .png plots go beside")
    p.add_argument("--budget-name", default="cpu-small", help="label stored in every record (part of its key)")
    p.add_argument("--presets", nargs="+", default=["w3g64", "w2g64", "w2g32", "lut2g32"], choices=list(PRESETS))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="rows to run (default: all)")
    p.add_argument("--ranks", nargs="+", type=int, default=[8, 16, 32],
                   help="LoRA ranks swept for lora-topk-tail (--main-rank is always among them)")
    p.add_argument("--main-rank", type=int, default=16, help="LoRA rank of every other LoRA method")
    p.add_argument("--max-steps", type=int, default=40, help="optimizer steps per training run (per stage)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (also for the cache and eval)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per cached training sequence")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of LoRA (as the demo)")
    p.add_argument("--lora-init", default="zero", choices=LORA_INITS,
                   help="start of every LoRA stage: zero (B = 0) or calibrated (each pair the best rank-r "
                        "correction of its layer's quantisation error on the cache's training text)")
    # Scales here are ~0.1 (SmolLM2 w3g64 median 0.12) and Adam moves each by about lr per step: 5e-4 is a
    # <= 0.5 % change per step where LoRA's 2e-3 would be 2 %.
    p.add_argument("--qat-lr", type=float, default=5e-4, help="peak learning rate of the quantiser parameters (qat)")
    p.add_argument("--quantizer-lr-ratio", type=float, default=0.1,
                   help="lora-qat: the scales' and zeros' learning rate as a fraction of --lr (1e-4 at lr 1e-3: "
                        "~0.1 %% of a scale per step)")
    p.add_argument("--weight-lr", type=float, default=2e-3,
                   help="peak learning rate of the latent weights (weight-qat; grid steps here are ~0.03-0.1)")
    p.add_argument("--hidden-weight", type=float, default=0.0,
                   help="online methods: feature distillation, the weight of the decoder layers' hidden-state error "
                        "against the teacher's (`train --hidden-weight`); 0 = off")
    p.add_argument("--start", default="preset", choices=STARTS,
                   help="init of every trained row: the preset's own, or a data-aware one (its PTQ row runs first)")
    p.add_argument("--calib-sequences", type=int, default=128, help="data-aware inits: calibration sequences")
    p.add_argument("--act-order", action="store_true",
                   help="gptq / blockwise inits: quantise columns by decreasing activation energy")
    p.add_argument("--blockwise-steps", type=int, default=100, help="ptq-blockwise: optimizer steps per block")
    p.add_argument("--blockwise-lr", type=float, default=1e-3, help="ptq-blockwise: learning rate of the weights")
    p.add_argument("--blockwise-quant-lr", type=float, default=1e-4,
                   help="ptq-blockwise: learning rate of scales and zeros")
    p.add_argument("--top-k", type=int, default=32, help="top-K cache: teacher log-probs kept per position")
    p.add_argument("--value-bits", type=int, default=16, choices=(32, 16, 8), help="top-K cache: bits per log-prob")
    p.add_argument("--wide-top-k", type=int, default=128, help="lora-topk-wide: K of its wider top-K cache")
    p.add_argument("--sampled-n", type=int, default=0,
                   help="sampled cache: draws per position; 0 = the N whose bytes per token match the top-K cache's")
    p.add_argument("--cache-tokens", type=int, default=45_000, help="teacher tokens per cache (train + held-out)")
    p.add_argument("--eval-tokens", type=int, default=8_192, help="Wikipedia tokens for perplexity (0 = all)")
    p.add_argument("--eval-seq-len", type=int, default=512, help="perplexity context (<= the model's)")
    p.add_argument("--seed", type=int, default=0, help="seed of LoRA init and data order")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, xla or tpu")
    p.add_argument("--precision", default="auto", choices=precision.PRECISIONS,
                   help="training autocast: auto = bf16 on CUDA and TPU, fp32 on the CPU; bf16 rows get keys of their "
                        "own (fp32 to compare a GPU row with the CPU rows)")
    return p


def validate(args: argparse.Namespace) -> None:
    """Cheap checks before any model loads: a typo should not wait for a cache build.

    Raises:
        ValueError: one line naming the bad value and the fix.
    """
    KDLossConfig(hidden_weight=args.hidden_weight)  # the loss's own range check, before any model loads
    offline = [m for m in args.methods if m in TRAINED and m not in ONLINE_METHODS]
    if args.hidden_weight and offline:
        raise ValueError(f"--hidden-weight: needs the teacher in the step, and {offline[0]} trains from the cache; "
                         f"run it without --hidden-weight or use {', '.join(ONLINE_METHODS)}")
    if not Path(args.teacher).exists():  # a fetch-assets name: that teacher's folder in the default asset folder
        args.teacher = str(models.fetched_teacher(args.teacher) or args.teacher)
    if not Path(args.teacher).is_dir():
        raise ValueError(f"--teacher {args.teacher}: no such folder; run `qat-lora fetch-assets` or pass a "
                         "transformers model folder")
    if not Path(args.eval_text).exists():
        raise ValueError(f"--eval-text {args.eval_text}: not found; pass the held-out Wikipedia leads file")
    for path in args.train_text:
        if not Path(path).exists():
            raise ValueError(f"--train-text {path}: no such file or folder; pass the training prose")
    try:
        train_files = {f.resolve() for f in data.list_text_files(args.train_text)}
    except ValueError as e:  # the library names its own flag
        raise ValueError(str(e).replace("--data", "--train-text", 1)) from None
    if any(f.resolve() in train_files for f in data.list_text_files([args.eval_text])):
        raise ValueError(f"--eval-text {args.eval_text}: also in --train-text; the eval text must stay held out")
    if args.news_text and not Path(args.news_text).exists():
        raise ValueError(f"--news-text {args.news_text}: not found; run `qat-lora fetch-assets` (it adds the news "
                         "text to an existing folder) or pass --news-text ''")
    if args.news_text and any(f.resolve() in train_files for f in data.list_text_files([args.news_text])):
        raise ValueError(f"--news-text {args.news_text}: also in --train-text; the eval text must stay held out")
    config = Path(args.teacher) / "config.json"
    limit = json.loads(config.read_text()).get("max_position_embeddings") if config.exists() else None
    for flag, value in (("--eval-seq-len", args.eval_seq_len), ("--seq-len", args.seq_len)):
        if limit is not None and value > limit:
            raise ValueError(f"{flag} {value}: longer than the teacher's context ({limit} positions)")
    for flag in ("max_steps", "batch_size", "seq_len", "cache_tokens", "eval_seq_len", "main_rank", "blockwise_steps",
                 "blockwise_lr", "blockwise_quant_lr"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be positive")
    if args.wide_top_k <= 0:
        raise ValueError(f"--wide-top-k {args.wide_top_k}: must be positive")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.budget_name):  # it names the budget's plot files
        raise ValueError(f"--budget-name {args.budget_name!r}: use letters, digits, '.', '_' and '-' only")
    if min(args.ranks) <= 0 or not 0 <= args.sampled_n <= 255:
        raise ValueError("--ranks must be positive and --sampled-n in [0, 255] (0 = matched to the top-K cache)")


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:10]


def start_method(args: argparse.Namespace, preset: str) -> str:
    """The PTQ row a trained student of `preset` starts from: --start's data-aware init, or the preset's own
    (what build_student builds)."""
    if args.start != "preset":
        return next(m for m, init in DATA_INITS.items() if init == args.start)
    return next(m for m, init in PTQ_INITS.items() if init == get_preset(preset).init)


def plan_rows(args: argparse.Namespace) -> list[Row]:
    """Teacher, then per preset its PTQ rows, then its trained rows, in METHODS order. The teacher and each
    preset's start-init PTQ row are always included: every gap is measured against them."""
    rows = [Row(None, "teacher")]
    for preset in args.presets:
        if set(args.methods) <= {"teacher"}:
            break
        # The start row first: the other rows' gaps are computed against it as soon as they finish.
        start = start_method(args, preset)
        rows += [Row(preset, m) for m in dict.fromkeys((start, *PTQ_INITS, *DATA_INITS))
                 if m == start or m in args.methods]
        for method in (m for m in TRAINED if m in args.methods):
            ranks = sorted({*args.ranks, args.main_rank}) if method == "lora-topk-tail" else [args.main_rank]
            rows += [Row(preset, method, None if method in QAT_METHODS else r) for r in ranks]
    added = [r.label for r in rows if r.method not in args.methods]
    if added:
        print(f"note: also evaluating {', '.join(added)}: the gaps are measured against them")
    return rows


def cache_config(args: argparse.Namespace, encoding: str, num_samples: int = 0, top_k: int = 0) -> CacheBuildConfig:
    """One cache of each encoding (and top-K width: `top_k`, default --top-k), shared by every preset; the folder
    name says what it holds, so changed flags build a new cache instead of mixing."""
    top_k = top_k or args.top_k
    what = f"topk-k{top_k}-v{args.value_bits}" if encoding == "topk" else f"sampled-n{num_samples}"
    name = f"{what}-L{args.seq_len}-t{args.cache_tokens}-{_digest([args.teacher, args.train_text])}"
    out = Path(args.work) / "caches" / name
    return CacheBuildConfig(teacher=args.teacher, data=list(args.train_text), out=str(out),
                            seq_len=args.seq_len, encoding=encoding, top_k=top_k, value_bits=args.value_bits,
                            num_samples=num_samples or 50, max_tokens=args.cache_tokens, batch_size=args.batch_size,
                            holdout_fraction=HOLDOUT_FRACTION, device=args.device, resume=True)


def ensure_cache(cfg: CacheBuildConfig) -> dict:
    """Build the cache unless its manifest exists (resume=True: a killed build continues after its last
    shard); returns inspect_cache's summary plus the build time."""
    corpus = data.corpus_fingerprint(data.list_text_files(cfg.data))
    if not (Path(cfg.out) / MANIFEST).exists():
        build_cache(cfg)
    manifest = KDCache(cfg.out).manifest
    # The folder's name digests the text's path, not its content: a text regenerated or edited in place would
    # otherwise train every later row on the old cache.
    if manifest.get("corpus_sha256", corpus) != corpus:
        raise ValueError(f"--train-text {' '.join(cfg.data)}: changed since {cfg.out} was built from it; move that "
                         "cache away to rebuild it, or keep the new text under a new path")
    return {**inspect_cache(cfg.out), "build_s": manifest.get("build_seconds"), "corpus_sha256": corpus}


def matched_sampled_n(args: argparse.Namespace) -> int:
    """The N whose sampled targets take about as many bytes as the top-K targets, measured by encoding the
    teacher's distributions on two training sequences both ways (the size grows with N; N <= 255)."""
    tokenizer, teacher = models.load_tokenizer(args.teacher), models.load_causal_lm(args.teacher).eval()
    ids, _ = data.pack(data.token_stream(data.list_text_files(args.train_text), tokenizer, 2 * args.seq_len),
                       args.seq_len)
    with torch.no_grad():
        logits = teacher(input_ids=torch.from_numpy(ids).long()).logits
    vocab, seeds, sizes = models.vocab_size(teacher), list(range(len(ids))), {}

    def size(n: int) -> int:  # bytes of the packed targets; n = 0: the top-K encoding
        if n not in sizes:
            encoding = SampledEncoding(n) if n else TopKEncoding(args.top_k, args.value_bits)
            sizes[n] = sum(a.nbytes for row in encode_rows(encoding, logits, vocab, seeds) for a in row.values())
        return sizes[n]

    lo, hi = 1, 255
    while lo < hi:  # the smallest N at least as large as the top-K targets
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if size(mid) < size(0) else (lo, mid)
    if lo > 1 and size(0) - size(lo - 1) < size(lo) - size(0):
        lo -= 1
    print(f"sampled N = {lo}: {size(lo) / ids.size:.1f} target bytes per position, top-{args.top_k} at "
          f"{args.value_bits} bits {size(0) / ids.size:.1f} (probe of {ids.size} positions)")
    return lo


def prepare_caches(args: argparse.Namespace, rows: list[Row]) -> dict[str, dict]:
    """The top-K cache (always: its held-out split gives every row's KD metrics) and, if a row trains on them,
    the wider top-K cache (--wide-top-k) and the sampled cache, with N matched once (remembered under --work)
    unless --sampled-n is given."""
    caches = {"topk": ensure_cache(cache_config(args, "topk"))}
    if any(r.method == "lora-topk-wide" for r in rows):
        caches["wide"] = ensure_cache(cache_config(args, "topk", top_k=args.wide_top_k))
    if not any(r.method == "lora-sampled" for r in rows):
        return caches
    n = args.sampled_n
    if not n:
        memo = Path(args.work) / "caches" / f"sampled-n-for-{Path(caches['topk']['path']).name}.json"
        if not memo.exists():
            atomic_write_json(memo, {"sampled_n": matched_sampled_n(args)})
        n = json.loads(memo.read_text())["sampled_n"]
    caches["sampled"] = ensure_cache(cache_config(args, "sampled", n))
    ratio = caches["sampled"]["bytes_per_token"] / caches["topk"]["bytes_per_token"]
    if abs(ratio - 1) > SAMPLED_TOLERANCE:
        print(f"note: the sampled cache takes {ratio:.2f}x the top-K cache's bytes per token (N = {n}); "
              "pass --sampled-n to match them more closely")
    return caches


def eval_settings(args: argparse.Namespace, caches: dict[str, dict]) -> dict:
    """Everything that changes an evaluation's numbers (part of every row's key)."""
    return {"teacher": args.teacher, "eval_text": args.eval_text, "eval_tokens": args.eval_tokens,
            "eval_seq_len": args.eval_seq_len, "kd_cache": Path(caches["topk"]["path"]).name}


def _init_quantizer_path(args: argparse.Namespace, preset: str) -> Path:
    config = get_preset(preset)
    return Path(args.work) / "init" / f"{preset}-{_digest([args.teacher, quant_config_dict(config)])}.safetensors"


def _save_quantizer(model, path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in quantizer_state_dict(model).items()}, str(tmp))
    os.replace(tmp, path)


def data_init_settings(args: argparse.Namespace, preset: str, init: str, caches: dict[str, dict]) -> dict:
    """Everything that changes a data-aware init (part of its file name and of its rows' keys)."""
    settings = {"teacher": args.teacher, "quant": quant_config_dict(get_preset(preset)), "init": init,
                "calib_sequences": args.calib_sequences, "calib_cache": Path(caches["topk"]["path"]).name}
    if init == "blockwise":
        settings.update(blockwise_steps=args.blockwise_steps, blockwise_lr=args.blockwise_lr,
                        blockwise_quant_lr=args.blockwise_quant_lr)
    if args.act_order and init in ("gptq", "blockwise"):
        settings["act_order"] = True  # only when set: earlier inits keep their names and rows their keys
    return settings


def _quantize_config(args: argparse.Namespace, preset: str, init: str, cache: str, out: Path) -> QuantizeConfig:
    blockwise = dict(init="gptq", blockwise_steps=args.blockwise_steps, blockwise_lr=args.blockwise_lr,
                     blockwise_quant_lr=args.blockwise_quant_lr) if init == "blockwise" else dict(init=init)
    return QuantizeConfig(model=args.teacher, quant=preset, cache=cache, calib_sequences=args.calib_sequences,
                          batch_size=args.batch_size, out=str(out), overwrite=True,
                          act_order=args.act_order and init in ("gptq", "blockwise"), **blockwise)


def _init_label(args: argparse.Namespace, init: str) -> str:
    return f"{init} act-order" if args.act_order and init in ("gptq", "blockwise") else init


def data_init(args: argparse.Namespace, preset: str, init: str, caches: dict[str, dict]) -> tuple[str, float]:
    """(the quantiser state file of a data-aware init, the seconds it took), computed once under --work."""
    folder = Path(args.work) / "init" / f"{preset}-{init}-{_digest(data_init_settings(args, preset, init, caches))}"
    path = folder / "quantizer.safetensors"
    if not path.exists():  # an interrupted blockwise init resumes from folder/blocks/
        quantize(_quantize_config(args, preset, init, caches["topk"]["path"], folder))
    return str(path), json.loads((folder / "quantize.json").read_text())["seconds"]


def init_quantizer(args: argparse.Namespace, preset: str, caches: dict[str, dict]) -> str:
    """The quantiser state every trained row of `preset` starts from, saved under --work, so that a data-aware
    init or the MSE / k-means search of the 2-bit presets (a minute or more on a CPU) does not run again in every
    training run and evaluation: they load it through TrainConfig.quantizer. The preset's start PTQ row (run
    first) saves it; it is computed here only if that file is gone. Empty for round-to-nearest presets."""
    if args.start != "preset":
        return data_init(args, preset, args.start, caches)[0]
    if get_preset(preset).init == "rtn":
        return ""
    path = _init_quantizer_path(args, preset)
    if not path.exists():
        _save_quantizer(build_student(StudentSpec(args.teacher, preset)), path)
    return str(path)


def stage_fields(args: argparse.Namespace, row: Row, caches: dict[str, dict]) -> list[dict]:
    """TrainConfig fields of each training stage of a row, without `out` and `device` (neither changes the
    numbers, so neither is in a digest); a chain's second stage starts from the first's quantizer.safetensors."""
    if row.method in CHAINS:
        head, lora = Row(row.preset, CHAINS[row.method]), Row(row.preset, "lora-topk-tail", row.lora_r)
        first = stage_fields(args, head, caches)[0]
        return [first, {**stage_fields(args, lora, caches)[0],
                        "quantizer": str(Path(run_dir(args, head, first)) / "quantizer.safetensors")}]
    r = row.lora_r or args.main_rank  # qat trains no adapter; the field is then unused
    fields = dict(model=args.teacher, cache=caches[TRAIN_CACHE.get(row.method, "topk")]["path"],
                  quant=row.preset, max_steps=args.max_steps, batch_size=args.batch_size,
                  lr=args.qat_lr if row.method in QAT_METHODS else args.lr,
                  warmup_steps=max(1, args.max_steps // 20), lora_r=r, lora_alpha=2.0 * r, seed=args.seed,
                  quantizer=init_quantizer(args, row.preset, caches))
    if row.method in WEIGHT_QAT_METHODS:
        fields["weight_lr_ratio"] = args.weight_lr / args.qat_lr
    if row.method in ONLINE_METHODS:
        fields["online_teacher"] = args.teacher
        if args.hidden_weight:  # only when on: earlier rows keep their keys
            fields["hidden_weight"] = args.hidden_weight
    if row.method == "lora-qat":
        fields["quantizer_lr_ratio"] = args.quantizer_lr_ratio
    fields = {**fields, **TRAINED[row.method]}
    if getattr(args, "train_precision", "fp32") == "bf16":
        fields["precision"] = "bf16"
    if args.lora_init != "zero" and "lora" in TRAIN_PRESETS[fields.get("preset", "recovery-lora")]:
        fields["lora_init"] = args.lora_init  # only when not the default: earlier rows keep their keys
    return [fields]


def run_dir(args: argparse.Namespace, row: Row, fields: dict) -> str:
    """A run folder per training configuration: the same settings resume the same run, new ones start fresh."""
    name = f"{row.preset}-{row.method.replace('+', '_')}{f'-r{row.lora_r}' if row.lora_r else ''}-{_digest(fields)}"
    return str(Path(args.work) / "runs" / args.budget_name / name)


def row_key(args: argparse.Namespace, row: Row, caches: dict[str, dict]) -> str:
    """Readable prefix + a digest of every setting behind the row's numbers (eval, quantiser, training)."""
    parts: list = [eval_settings(args, caches)]
    if row.preset:
        parts.append(quant_config_dict(get_preset(row.preset)))
    if row.method in DATA_INITS:
        parts.append(data_init_settings(args, row.preset, DATA_INITS[row.method], caches))
    if row.method in TRAINED:
        parts.append(stage_fields(args, row, caches))
    return f"{args.budget_name}/{row.label}/{_digest(parts)}"


def evaluate_model(model, args: argparse.Namespace, caches: dict[str, dict], device: torch.device) -> dict:
    """Held-out perplexity on the eval text (and the news text), KD metrics on the top-K cache's held-out split."""
    started = time.perf_counter()
    model = model.to(device).eval()
    tokenizer = models.load_tokenizer(args.teacher)

    def ppl_of(text: str) -> dict:
        return perplexity(model, tokenizer, [text], args.eval_seq_len, args.eval_tokens or None, args.batch_size,
                          device)

    ppl = ppl_of(args.eval_text)
    news = ppl_of(args.news_text) if args.news_text else None
    kd = kd_metrics(model, KDCache(caches["topk"]["path"]), args.batch_size, device)
    # The news figures are not part of the row's key: rows recorded before them stay valid (without them).
    return {"ppl": ppl["ppl"], "nll": ppl["nll"], "eval_tokens": ppl["tokens"],
            **({"news_text": Path(args.news_text).name, "ppl_news": news["ppl"], "nll_news": news["nll"],
                "news_tokens": news["tokens"]} if news else {}),
            **{k: kd[k] for k in ("kd_kl", "kd_top1", "kd_soft_ce", "kd_ce", "kd_tokens")},
            "eval_s": round(time.perf_counter() - started, 2)}


def run_teacher(args: argparse.Namespace, caches: dict[str, dict], device: torch.device) -> dict:
    model = load_student(StudentSpec(args.teacher, ""), attn_implementation=resolve_attn("auto", device))
    return {"init": None, "tokens": 0, "steps": 0, "wall_s": 0.0, **evaluate_model(model, args, caches, device)}


def run_data_init(args: argparse.Namespace, row: Row, caches: dict[str, dict], device: torch.device) -> dict:
    """A data-aware init (computed once, on the CPU), then its evaluation as a PTQ student."""
    init = DATA_INITS[row.method]
    path, seconds = data_init(args, row.preset, init, caches)
    model = build_student(StudentSpec(args.teacher, row.preset, path), resolve_attn("auto", device))
    return {"init": _init_label(args, init), "calib_sequences": args.calib_sequences, "tokens": 0, "steps": 0,
            "wall_s": round(seconds, 2), "quantizer": path, "bits_per_weight": round(bits_per_weight(model), 4),
            **evaluate_model(model, args, caches, device)}


def run_ptq(args: argparse.Namespace, row: Row, caches: dict[str, dict], device: torch.device) -> dict:
    """Quantise with the row's init (on the device: the init is the PTQ row's only compute), then evaluate."""
    init = PTQ_INITS[row.method]
    model = models.load_causal_lm(args.teacher, attn_implementation=resolve_attn("auto", device)).to(device)
    started = time.perf_counter()
    quantize_(model, replace(get_preset(row.preset), init=init))
    dev.sync(device)
    wall = time.perf_counter() - started
    if init != "rtn" and init == get_preset(row.preset).init:  # the start row: its quantiser is every run's init
        _save_quantizer(model, _init_quantizer_path(args, row.preset))
    return {"init": init, "tokens": 0, "steps": 0, "wall_s": round(wall, 2),
            "bits_per_weight": round(bits_per_weight(model), 4), **evaluate_model(model, args, caches, device)}


def train_stage(args: argparse.Namespace, row: Row, fields: dict) -> dict:
    """Train (or resume, or just read back a finished) stage; its summary as stored in the record."""
    out = run_dir(args, row, fields)
    # A checkpoint every quarter of the run, at most 100 steps apart: a long row killed at a session's end
    # loses minutes, not a quarter of its hours.
    summary = train(TrainConfig(**{"precision": "fp32", **fields}, out=out, device=args.device, resume="auto",
                                save_steps=max(1, min(args.max_steps // 4, 100)),
                                keep_checkpoints=1, log_steps=max(1, args.max_steps // 50)))
    return {"run_dir": out, "train_preset": fields.get("preset", "recovery-lora"), "lr": fields["lr"],
            "precision": fields.get("precision", "fp32"),
            **({"lora_init": fields["lora_init"]} if "lora_init" in fields else {}),
            **({"weight_lr": fields["lr"] * fields["weight_lr_ratio"]} if "weight_lr_ratio" in fields else {}),
            **({"hidden_weight": fields["hidden_weight"]} if "hidden_weight" in fields else {}),
            "steps": summary["steps"], "tokens": summary["tokens"], "wall_s": summary["wall_s"],  # all processes
            "tokens_per_s": summary["tokens_per_s"], "adapter": summary["adapter"],
            "quantizer": summary["quantizer"] or fields.get("quantizer") or None}


def _train_text_label(args: argparse.Namespace) -> list[str] | None:
    """The training text's file or folder names; None for the default assets (older records have none)."""
    return None if args.train_text == [str(ASSETS.train_text_dir)] else [Path(p).name for p in args.train_text]


def run_trained(args: argparse.Namespace, row: Row, caches: dict[str, dict], device: torch.device) -> dict:
    """Every stage of the row, then the trained student (its last adapter over its trained quantiser, if any)."""
    stages = []
    for fields in stage_fields(args, row, caches):
        stage_row = Row(row.preset, fields["preset"]) if fields.get("preset") in CHAINS.values() else row
        stages.append(train_stage(args, stage_row, fields))
    quantizer = stages[-1]["quantizer"] or ""  # the last stage's starting or trained quantiser
    model = load_student(StudentSpec(args.teacher, row.preset, quantizer), stages[-1]["adapter"] or "",
                         resolve_attn("auto", device))
    cache = caches[TRAIN_CACHE.get(row.method, "topk")]
    init = _init_label(args, args.start) if args.start != "preset" else get_preset(row.preset).init
    online = row.method in ONLINE_METHODS
    return {"init": init, "tokens": sum(s["tokens"] for s in stages),
            "steps": sum(s["steps"] for s in stages), "wall_s": round(sum(s["wall_s"] for s in stages), 2),
            "run_dir": stages[-1]["run_dir"], "stages": stages, "cache": cache["path"],
            # online: the cache's tokens only (int32 id + mask byte), its targets unread
            "cache_encoding": {"name": "online"} if online else cache["encoding"],
            "cache_bytes_per_token": TOKEN_BYTES if online else cache["bytes_per_token"],
            "topk_cache_bytes_per_token": caches["topk"]["bytes_per_token"],  # what sampled targets are matched to
            "cache_build_s": None if online else cache["build_s"], "bits_per_weight": round(bits_per_weight(model), 4),
            # an unmerged adapter ships beside the base: the bits it adds (r64 on SmolLM2: ~2.9)
            "adapter_bits_per_weight": round(adapter_bits_per_weight(model), 4),
            **evaluate_model(model, args, caches, device)}


def gap_fields(record: dict, teacher: dict, ptq: dict | None) -> dict:
    """Perplexity and NLL gaps against the teacher and the row's PTQ start point (None for the teacher itself)."""
    def recovered(key: str) -> float | None:
        if ptq is None:
            return 1.0  # the teacher: the whole gap, whatever the preset
        span = ptq[key] - teacher[key]
        return (ptq[key] - record[key]) / span if span != 0 else None

    news = {}
    if "ppl_news" in record and "ppl_news" in teacher and (ptq is None or "ppl_news" in ptq):
        news = {"ppl_ratio_news": record["ppl_news"] / teacher["ppl_news"], "gap_recovered_news":
                recovered("ppl_news"), "gap_recovered_nats_news": recovered("nll_news")}
    return {"ppl_ratio": record["ppl"] / teacher["ppl"], "nll_gap_nats": record["nll"] - teacher["nll"],
            "gap_recovered": recovered("ppl"), "gap_recovered_nats": recovered("nll"), **news,
            "teacher_ppl": teacher["ppl"], "teacher_nll": teacher["nll"],
            "start_init": None if ptq is None else ptq["init"], "ptq_ppl": None if ptq is None else ptq["ppl"],
            "ptq_nll": None if ptq is None else ptq["nll"]}


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    return str(device)


def run_row(args: argparse.Namespace, row: Row, key: str, caches: dict[str, dict], device: torch.device,
            done: dict[str, dict]) -> dict:
    """Produce one record: run the row, then add the gaps against the teacher and PTQ rows already recorded."""
    if row.method == "teacher":
        result = run_teacher(args, caches, device)
    elif row.method in PTQ_INITS:
        result = run_ptq(args, row, caches, device)
    elif row.method in DATA_INITS:
        result = run_data_init(args, row, caches, device)
    else:
        result = run_trained(args, row, caches, device)
    record = {"key": key, "budget": args.budget_name, "preset": row.preset, "method": row.method,
              "lora_r": row.lora_r, "device": device_label(device), "eval_seq_len": args.eval_seq_len,
              "cache_bytes_per_token": None, "run_dir": None, "train_text": _train_text_label(args),
              "train_text_sha256": caches["topk"]["corpus_sha256"], **result,
              "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    teacher = record if row.preset is None else done[row_key(args, Row(None, "teacher"), caches)]
    ptq = None if row.preset is None else (
        record if row.method == start_method(args, row.preset) else
        done[row_key(args, Row(row.preset, start_method(args, row.preset)), caches)])
    record.update(gap_fields(record, teacher, ptq))
    return record


def load_results(path: Path) -> dict:
    if not path.exists():
        return {"host": {}, "records": []}
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--json {path}: not valid JSON ({e}); fix or move it") from None
    if not isinstance(results.get("records"), list):
        raise ValueError(f"--json {path}: no `records` list; pass another --json")
    return results


def add_record(path: Path, record: dict) -> dict:
    """Append one record to the results file and return its new contents. The file is read again under a lock
    first: several benchmark processes may share one --json, and each must add its rows to what the others
    wrote meanwhile, never write back the copy it read at its start (that lost rows once)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = load_results(path)
        records = [r for r in results["records"] if r["key"] != record["key"]]
        results = {"host": host_info(), "records": [*records, record]}
        atomic_write_json(path, results)
    return results


def host_info() -> dict:
    return {"machine": platform.machine(), "processor": platform.processor() or None, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _fmt(value, spec: str = ".3f") -> str:
    if value is None:
        return "–"
    if spec == "ppl":
        return f"{value:,.2f}" if value < 1000 else f"{value:,.0f}"
    if spec == "%":
        return f"{100 * value:.1f} %"
    text = format(value, spec)
    # The teacher's KL against its own 16-bit cache is ~-2e-5 (value rounding): a zero prints without a sign.
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def _lrs(record: dict, sep: str = " / ") -> str:
    """The peak learning rate of each training stage ("–" for a PTQ row); "cal." marks a calibrated LoRA start,
    "w" the latent weights' rate (weight-qat), "feat." the weight of feature distillation (--hidden-weight)."""
    return sep.join(f"{s['lr']:g}" + (" cal." if s.get("lora_init") == "calibrated" else "")
                    + (f" (w {s['weight_lr']:g})" if s.get("weight_lr") else "")
                    + (f" feat. {s['hidden_weight']:g}" if s.get("hidden_weight") else "")
                    for s in record.get("stages") or [] if s.get("lr")) or "–"


def _init_cell(record: dict) -> str:
    """The init column; a data-aware init names its calibration size (rows may differ by nothing else)."""
    calib = record.get("calib_sequences")
    return f"{record['init']} ({calib} seq.)" if record["init"] and calib else record["init"] or "–"


# Methods whose student ships as its trained base alone: the quantiser's parameters or the weights on the grid.


def shipped_bits(record: dict, records: list[dict]) -> float | None:
    """Bits per quantised weight the row's student ships at: its base's, plus an unmerged adapter's. Records from
    before these fields were kept take the base bits a record of the same preset measured, and adapter bits
    scaled from a record of these (an adapter's parameters grow linearly with its rank on one model)."""
    if record["preset"] is None:
        return FULL_PRECISION_BITS
    base = record.get("bits_per_weight") or next((r["bits_per_weight"] for r in records if r["preset"] ==
                                                  record["preset"] and r.get("bits_per_weight")), None)
    if base is None or not record.get("lora_r") or record["method"] in BASE_ONLY_METHODS:
        return base
    adapter = record.get("adapter_bits_per_weight")
    if adapter is None:
        known = next((r for r in records if r.get("adapter_bits_per_weight") and r.get("lora_r")), None)
        if known is None:
            return None
        adapter = known["adapter_bits_per_weight"] * record["lora_r"] / known["lora_r"]
    return base + adapter


def _text_cell(record: dict) -> str:
    """The training text a row saw: its folder names and the first digits of its sha256 (a regenerated text keeps
    its folder name, so the name alone does not tell two texts apart)."""
    names, digest = record.get("train_text"), record.get("train_text_sha256")
    if not names:
        return "–"
    return " + ".join(names) + (f" ({digest[:8]})" if digest else "")


def markdown_table(records: list[dict]) -> str:
    head = ("| budget | training text | preset | method | r | lr | init | bits shipped | ppl | NLL | NLL − teacher (nats) | ppl ÷ teacher | gap recovered "
            "(ppl) | gap recovered (nats) | news ppl | news ppl ÷ teacher | news gap recovered | KD KL | top-1 | tokens | "
            "wall s | device |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in records:
        lines.append(
            f"| {r['budget']} | {_text_cell(r)} | {r['preset'] or '–'} | {r['method']} | {r['lora_r'] or '–'} | {_lrs(r)} | "
            f"{_init_cell(r)} | {_fmt(shipped_bits(r, records), '.2f')} | "
            f"{_fmt(r['ppl'], 'ppl')} | {_fmt(r['nll'])} | {_fmt(r['nll_gap_nats'])} | {_fmt(r['ppl_ratio'], '.2f')} | "
            f"{_fmt(r['gap_recovered'], '%')} | {_fmt(r['gap_recovered_nats'], '%')} | "
            f"{_fmt(r.get('ppl_news'), 'ppl')} | {_fmt(r.get('ppl_ratio_news'), '.2f')} | "
            f"{_fmt(r.get('gap_recovered_news'), '%')} | {_fmt(r['kd_kl'])} | "
            f"{_fmt(r['kd_top1'])} | {r['tokens']:,} | {_fmt(r['wall_s'], '.1f')} | {r['device']} |")
    return "\n".join(lines)


def write_markdown(json_path: Path, records: list[dict]) -> Path:
    path = json_path.with_suffix(".md")
    path.write_text(f"# Recovery benchmark\n\nGenerated by `benchmarks/recovery.py` from `{json_path.name}`. "
                    "gap recovered = (ppl_PTQ − ppl) / (ppl_PTQ − ppl_teacher), PTQ = the row the student starts "
                    "from (init = the preset's own); nats: the same on NLL. Bits shipped: per quantised weight, "
                    "the base's plus an unmerged adapter's. Wall: PTQ init or training (all stages; "
                    "the shared cache build excluded).\n\n" + markdown_table(records) + "\n")
    return path


def _curve(stages: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """Training tokens, objective and next-token CE of a row's stages, one after the other."""
    tokens, loss, ce, offset = [], [], [], 0
    for stage in stages:
        per_step = stage["tokens"] // max(1, stage["steps"])
        train_records, _ = read_metrics(stage["run_dir"])
        tokens += [offset + r["step"] * per_step for r in train_records]
        loss += [r["loss"] for r in train_records]
        ce += [r["ce"] for r in train_records]
        offset += stage["tokens"]
    return tokens, loss, ce


def _label(record: dict) -> str:
    return record["method"] + (f" r{record['lora_r']}" if record["lora_r"] else "")


def plot_curves(plt, preset: str, records: list[dict], path: Path) -> Path | None:
    """The preset's training curves, or None (the file left as it is) where a record's run folder is gone
    (another machine's --work) and the file exists: redrawn, it would silently lose that record's curve."""
    curves = {}
    for r in records:
        try:
            curves[_label(r)] = _curve(r["stages"])
        except ValueError as e:
            print(f"note: no loss curve for {preset}/{_label(r)}: {e}")
    if len(curves) < len(records) and path.exists():
        print(f"note: {path} kept as it was (drawn when every run folder above was here)")
        return None
    fig, (ax_loss, ax_ce) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, (tokens, loss, ce) in curves.items():
        ax_loss.plot(tokens, loss, label=label)
        ax_ce.plot(tokens, ce, label=label)
    # The objectives differ by method (renormalised, tail, sampled, CE); the next-token CE is comparable.
    ax_loss.set(xlabel="training tokens", ylabel="training objective", title=f"{preset}: loss")
    ax_ce.set(xlabel="training tokens", ylabel="next-token CE (nats)", title=f"{preset}: CE on the training prose")
    ax_loss.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_gaps(plt, records: list[dict], path: Path) -> Path:
    rows = [r for r in records if r["preset"]]
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    labels = list(dict.fromkeys(_label(r) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    width = 0.8 / max(1, len(labels))
    for ax, key, unit in zip(axes, ("gap_recovered", "gap_recovered_nats"), ("perplexity", "NLL")):
        for i, label in enumerate(labels):
            values = {r["preset"]: r[key] for r in rows if _label(r) == label}
            ax.bar([p + i * width for p in range(len(presets))], [100 * (values.get(p) or 0.0) for p in presets],
                   width, label=label)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xticks([p + 0.4 - width / 2 for p in range(len(presets))], presets)
        ax.set(ylabel="gap recovered (%)", title=f"gap recovered, {unit}")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def text_family(names: list[str] | None) -> str:
    """The training text a row used, without a size suffix: runs/selfgen/prefix (48 k tokens), prefix-320k and
    prefix-1m are the same generator at three budgets, so their rows belong to one line."""
    return ", ".join(re.sub(r"-\d+[km]$", "", name) for name in names) if names else "default text"


EXTRAPOLATE_TOKENS = 5_000_000  # issue 6's goal budget: where each measured curve is heading


def extrapolate_ppl(points: list[tuple[int, float]], teacher: float, tokens: int = EXTRAPOLATE_TOKENS
                    ) -> float | None:
    """The ppl a series reaches at `tokens` if its gap to the teacher keeps falling as a power of the tokens
    (a straight line through log(ppl - teacher) against log(tokens), least squares over its points). None with
    fewer than three budgets, a point at or below the teacher, or a gap that does not fall: two points fit any
    line, and a flat or rising curve has no power law to follow."""
    if len(points) < 3 or any(p <= teacher for _, p in points):
        return None
    xs = [math.log(t) for t, _ in points]
    ys = [math.log(p - teacher) for _, p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope >= 0:
        return None
    return teacher + math.exp(my + slope * (math.log(tokens) - mx))


def ppl_series(records: list[dict], preset: str) -> dict[str, list[tuple[int, float]]]:
    """Held-out ppl against training tokens for each trained method of `preset`, one series per method, rank,
    learning rate(s), start and training text, sorted by tokens. Where one series has two records at the same tokens
    (a rerun), the later record is the one plotted."""
    series: dict[str, dict[int, float]] = {}
    for r in (r for r in records if r["preset"] == preset and r["tokens"]):
        lrs = _lrs(r, "+")
        label = _label(r) + (f" lr {lrs}" if lrs != "–" else "")
        label += f" from {r['start_init']} ({text_family(r.get('train_text'))})"
        series.setdefault(label, {})[r["tokens"]] = r["ppl"]
    return {label: sorted(points.items()) for label, points in series.items()}


def plot_ppl_tokens(plt, records: list[dict], path: Path) -> Path:
    """Held-out ppl against training tokens (both log), one panel per preset: each trained method (with the init
    and text it started from) is a line through its budgets; the best no-training rows are grey references and the
    teacher is black. Colours and markers both vary, so the many series stay tellable apart."""
    presets = list(dict.fromkeys(r["preset"] for r in records if r["preset"] and r["tokens"]))
    fig, axes = plt.subplots(max(1, len(presets)), 1, figsize=(12, 4.8 * max(1, len(presets))), squeeze=False)
    teacher = next((r["ppl"] for r in records if r["method"] == "teacher"), None)
    colours, markers = plt.get_cmap("tab20").colors, "osD^vPX*<>"
    for ax, preset in zip(axes[:, 0], presets):
        inits: dict[str, dict] = {}
        for r in sorted((r for r in records if r["preset"] == preset and not r["tokens"]), key=lambda r: r["ppl"]):
            inits.setdefault(r["method"], r)  # each init's best record: reruns would print over each other
        for r in list(inits.values())[:2]:  # the two best inits (a third, e.g. HQQ at w2, stretches the axis)
            ax.axhline(r["ppl"], linestyle="--", linewidth=0.8, color="grey")
            ax.annotate(f"{r['method']} {r['ppl']:.1f}", (1.0, r["ppl"]), xycoords=("axes fraction", "data"),
                        fontsize=7, va="bottom", ha="right", color="grey")
        for i, (label, points) in enumerate(ppl_series(records, preset).items()):
            ax.plot([t for t, _ in points], [p for _, p in points], label=label, color=colours[i % len(colours)],
                    marker=markers[i % len(markers)], linewidth=1.2)
            ahead = extrapolate_ppl(points, teacher) if teacher else None
            if ahead is not None and points[-1][0] < EXTRAPOLATE_TOKENS:  # dotted: a fit, not a measurement
                ax.plot([points[-1][0], EXTRAPOLATE_TOKENS], [points[-1][1], ahead], linestyle=":",
                        color=colours[i % len(colours)], linewidth=1.0)
                ax.annotate(f"{ahead:.1f} at {EXTRAPOLATE_TOKENS / 1e6:g} M (power-law fit)",
                            (EXTRAPOLATE_TOKENS, ahead), fontsize=7, va="bottom", ha="right",
                            color=colours[i % len(colours)])
        if teacher:
            ax.axhline(teacher, color="black", linewidth=0.8)
            ax.annotate(f"teacher {teacher:.2f}", (1.0, teacher), xycoords=("axes fraction", "data"), fontsize=7,
                        va="bottom", ha="right")
        ax.set(xlabel="training tokens (log)", ylabel="held-out ppl (log)", xscale="log", yscale="log", title=preset)
        # Plain numbers on the log axes (20, 30, 50, 100 k), not 2 x 10^1; only ticks led by 1, 2, 3 or 5 are
        # labelled, so a wide range (w2g64's ppl) stays legible.
        for axis, unit in ((ax.yaxis, 1), (ax.xaxis, 1000)):
            ticks = plt.FuncFormatter(lambda v, _, unit=unit: f"{v / unit:g}{' k' if unit > 1 else ''}"
                                      if f"{v:e}"[0] in "1235" else "")
            axis.set_major_formatter(ticks)
            axis.set_minor_formatter(ticks)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (bits, ppl) points no other point beats on both (fewer or equal bits and lower ppl), by bits."""
    best, out = float("inf"), []
    for bits, ppl in sorted(points):
        if ppl < best:
            best = ppl
            out.append((bits, ppl))
    return out


def plot_frontier(plt, records: list[dict], path: Path) -> Path:
    """Held-out ppl against bits per weight shipped (base + unmerged adapter), every budget: the one-shot inits
    and the trained students, each with its frontier (the best ppl at no more bits); the teacher a line."""
    fig, ax = plt.subplots(figsize=(9, 5))
    groups = {"one-shot (no training)": [r for r in records if r["preset"] and not r["tokens"]],
              "trained": [r for r in records if r["preset"] and r["tokens"]]}
    top = 0.0  # the chart ends above the frontiers: a broken round-to-nearest row (1e6) would flatten them
    for (name, rows), colour in zip(groups.items(), ("#e1812c", "#3b75af")):
        points = [(shipped_bits(r, records), r["ppl"]) for r in rows]
        points = [(b, p) for b, p in points if b is not None]
        if not points:
            continue
        ax.scatter([b for b, _ in points], [p for _, p in points], s=14, alpha=0.45, color=colour)
        edge = frontier(points)
        top = max(top, *(p for _, p in edge))
        ax.plot([b for b, _ in edge], [p for _, p in edge], marker="o", color=colour, label=f"{name}: frontier")
        for bits, ppl in edge:
            ax.annotate(f"{ppl:.2f}", (bits, ppl), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=colour)
    teacher = next((r["ppl"] for r in records if r["method"] == "teacher"), None)
    if teacher:
        ax.axhline(teacher, color="black", linewidth=0.8, label=f"teacher {teacher:.2f} ({FULL_PRECISION_BITS:g} bits)")
    ax.set(xlabel="bits per weight shipped (base + unmerged adapter)", ylabel="held-out ppl (log)", yscale="log",
           title="perplexity against the bits the model ships (rows above the frontiers' range are off the chart)")
    if top:
        ax.set_ylim(top=top * 2)
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(json_path: Path, budget: str, records: list[dict], every_budget: list[dict]) -> list[Path]:
    """Loss curves per preset and gap recovered per method for the records of `budget`; ppl against training
    tokens over every budget. The per-budget files carry the budget's name, so running one budget leaves the
    plots of the others (which RESULTS.md links to) as they were."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    stem = json_path.with_suffix("")
    paths = []
    for preset in dict.fromkeys(r["preset"] for r in records if r.get("stages")):
        trained = [r for r in records if r["preset"] == preset and r.get("stages")]
        curves = plot_curves(plt, preset, trained, Path(f"{stem}_{budget}_loss_{preset}.png"))
        paths += [curves] if curves else []
    if any(r["preset"] for r in records):
        paths.append(plot_gaps(plt, records, Path(f"{stem}_{budget}_gap.png")))
    if any(r["tokens"] for r in every_budget):
        paths.append(plot_ppl_tokens(plt, every_budget, Path(f"{stem}_ppl_tokens.png")))
    if any(r["preset"] for r in every_budget):
        paths.append(plot_frontier(plt, every_budget, Path(f"{stem}_frontier.png")))
    return paths


def main(argv: Sequence[str] | None = None) -> dict:
    """Run every row not yet in --json; returns the results ({"host", "records"})."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate(args)
        device = dev.resolve_device(args.device)
        # Resolved once: `auto` means bf16 on CUDA, and a row's key must say so (fp32 rows keep their old keys).
        args.train_precision = "bf16" if precision.autocast_dtype(device, args.precision) else "fp32"
    except ValueError as e:
        parser.error(str(e))
    json_path = Path(args.json)
    results = load_results(json_path)
    rows = plan_rows(args)
    caches = prepare_caches(args, rows)
    done = {r["key"]: r for r in results["records"]}
    for row in rows:
        key = row_key(args, row, caches)
        # Rows another process sharing --json finished meanwhile (e.g. while this one built its cache).
        done.update({r["key"]: r for r in load_results(json_path)["records"]})
        if key in done:
            # Keys name the text by its path; a record from another content of it is refused, not reused.
            # (Records from before the field have no content digest to compare.)
            if done[key].get("train_text_sha256", caches["topk"]["corpus_sha256"]) != caches["topk"]["corpus_sha256"]:
                parser.error(f"--train-text {' '.join(args.train_text)}: {row.label} in {json_path} was measured on "
                             "other content at this path; keep the new text under a new path, or pass another --json")
            print(f"{row.label}: already in {json_path} (key {key}); skipped")
            continue
        print(f"{row.label}: running")
        record = run_row(args, row, key, caches, device, done)
        done[key] = record
        results = add_record(json_path, record)
        print(f"{row.label}: ppl {record['ppl']:.3f}, gap recovered {_fmt(record['gap_recovered'], '%')}, "
              f"{record['tokens']:,} tokens, {record['wall_s']:.1f} s")
    print(markdown_table(results["records"]))
    write_markdown(json_path, results["records"])
    this_budget = [r for r in results["records"] if r["budget"] == args.budget_name]
    for path in write_plots(json_path, args.budget_name, this_budget, results["records"]):
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # library errors name the bad value and the fix: one line, no traceback
        sys.exit(f"recovery.py: error: {e}")
