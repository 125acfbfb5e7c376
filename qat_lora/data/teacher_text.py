"""`qat-lora generate-data`: a training corpus sampled from the teacher itself, for when there is no corpus or
its domain differs from the one the student will serve.

    qat-lora generate-data --model T --data corpus/ --tokens 100000 --out data/self
    qat-lora generate-data --model T --prompts prompts.txt --out data/self      # one prompt per line
    qat-lora generate-data --model T --unconditional --out data/self            # no corpus: from BOS alone
    qat-lora build-cache --teacher T --data data/self --out caches/self

Each sample is a prompt (the first --prefix-tokens tokens of a corpus passage, or a line of --prompts, wrapped in
the chat template when the tokenizer has one; with --unconditional the BOS token alone) continued by the teacher at
--temperature (1.0 = the teacher's own distribution, which is what distillation matches). The output is jsonl shards
of {"text"} records (prompt + continuation; chat prompts as {"messages"}, read by build-cache --chat) plus
generate.json (settings first, then the totals). Each shard has its own seeds and is written under a temp name, then
renamed: a rerun after a stop skips the finished shards and produces the same files as an uninterrupted run (on the
same device). A larger --tokens on the same folder continues the corpus (the earlier run's last shard stays as the
budget cut it). generate.json records the fingerprints of the inputs (the --data / --prompts files, the teacher's
weights and config), as build-cache's progress does: a rerun after either changed is refused, never a corpus of two
sources; --overwrite starts the corpus again.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from qat_lora.data import text as data

from qat_lora.runtime import device as dev, precision

from qat_lora.data import identities, models
from qat_lora.runtime.options import field_defaults
from qat_lora.data.config import GenerateDataConfig
from qat_lora.runtime.files import (FolderLock, atomic_write_json, atomic_write_text, check_out_apart_from_inputs,
                                    owned_by, owner_stamp, read_record)

REPORT_FILE = data.GENERATED_REPORT
SHARD = "part-{index:05d}.jsonl"


def corpus_prompts(files: list[Path], tokenizer, prefix_tokens: int, stride: int, limit: int,
                   decoding: data.TextDecoding = data.TextDecoding()) -> list[str]:
    """The first `prefix_tokens` tokens of every `stride`-token passage, as text, until `limit` prompts: the
    files are read interleaved by tokens, as build-cache reads them, so a small budget still samples each file."""
    prompts: list[str] = []
    for _, ids in data.tokenized_documents(files, tokenizer, decoding=decoding):
        for start in range(0, max(1, len(ids) - prefix_tokens), stride):
            piece = ids[start:start + prefix_tokens]
            if len(piece) == prefix_tokens:
                prompts.append(tokenizer.decode(piece))
            if len(prompts) == limit:
                return prompts
    return prompts


def file_prompts(path: Path, decoding: data.TextDecoding = data.TextDecoding()) -> list[str]:
    """Non-empty lines of a prompts file.

    Raises:
        ValueError: the file is missing or holds no prompt.
    """
    if not path.is_file():
        raise ValueError(f"--prompts {path}: no such file; pass a text file with one prompt per line")
    prompts = [line.strip() for line in decoding.lines(path) if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompt in it; write one prompt per line")
    return prompts


def _prompts(cfg: GenerateDataConfig, tokenizer, samples: int) -> tuple[list[str], bool]:
    """(prompts, chat): the prompts cycle when the budget needs more samples than there are prompts."""
    if cfg.unconditional:  # one empty prompt: _encode gives the BOS token alone
        if tokenizer.bos_token_id is None:
            raise ValueError(f"--unconditional: the tokenizer of --model {cfg.model} has no BOS token to start "
                             "from; pass --data or --prompts")
        return [""], False
    if cfg.prompts:
        return file_prompts(Path(cfg.prompts), cfg.text_decoding()), not cfg.raw_prompts and tokenizer.chat_template is not None
    prompts = corpus_prompts(data.list_text_files(cfg.data), tokenizer, cfg.prefix_tokens, cfg.stride, samples,
                             cfg.text_decoding())
    if not prompts:
        raise ValueError(f"--data: no passage of {cfg.prefix_tokens} tokens; lower --prefix-tokens")
    return prompts, False


def _encode(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    if chat:  # the template writes its own special tokens
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in prompts]
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


@torch.no_grad()
def _sample(model, tokenizer, prompt_ids: list[list[int]], cfg: GenerateDataConfig, device: torch.device,
            seed: int) -> list[list[int]]:
    """One batch of continuations (token ids, EOS and padding removed); left-padded prompts, seeded sampling."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompt_ids)
    fixed = dev.fixed_shape_decoding(device)
    if fixed:  # a few cache sizes for the whole corpus, each compiled once (runtime/device.py)
        width = -(-width // dev.PROMPT_BUCKET) * dev.PROMPT_BUCKET
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    dev.seed_everything(seed)  # generate() samples from the device's global generator
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=cfg.temperature,
                         top_p=cfg.top_p, top_k=0, max_new_tokens=cfg.max_new_tokens, pad_token_id=pad,
                         **({"cache_implementation": "static"} if fixed else {}))
    continuations = []
    for row in out[:, width:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[:row.index(tokenizer.eos_token_id)]
        continuations.append(row)
    return continuations


def _sample_shard(cfg: GenerateDataConfig, model, tokenizer, prompts: list[str], chat: bool, device: torch.device,
                  index: int, budget: int, bar: tqdm) -> tuple[list[str], list[int]]:
    """Shard `index`'s jsonl lines and generated tokens per sample; it stops at the first batch that meets the
    remaining `budget` (the last shard is then a prefix of a full one). `bar` counts each batch's tokens."""
    first = index * cfg.shard_samples
    shard_prompts = [prompts[i % len(prompts)] for i in range(first, first + cfg.shard_samples)]
    lines, counts = [], []
    for b in range(0, len(shard_prompts), cfg.batch_size):
        if sum(counts) >= budget:
            break
        chunk = shard_prompts[b:b + cfg.batch_size]
        # Batch seeds: one per (shard, batch); shard_samples <= 1000 (config) keeps them distinct.
        for prompt, ids in zip(chunk, _sample(model, tokenizer, _encode(tokenizer, chunk, chat), cfg, device,
                                              cfg.seed + 1000 * index + b)):
            record = _record(prompt, tokenizer.decode(ids, skip_special_tokens=True), chat)
            lines.append(json.dumps({**record, "tokens": len(ids)}, ensure_ascii=False))
            counts.append(len(ids))
            bar.update(min(len(ids), bar.total - bar.n))  # the budget's last batch overshoots it
    return lines, counts


def _record(prompt: str, continuation: str, chat: bool) -> dict:
    if chat:
        return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": continuation}]}
    return {"text": prompt + continuation}


def _shard_tokens(path: Path) -> list[int]:
    """Generated tokens per sample of a finished shard. Records are split on "\n" only: the text may hold
    U+2028 or U+0085, which str.splitlines would also split on.

    Raises:
        ValueError: a line that is not a record (the file was changed by hand): names the file.
    """
    try:
        return [json.loads(line)["tokens"] for line in path.read_text(encoding="utf-8").split("\n") if line]
    except (ValueError, KeyError) as e:
        raise ValueError(f"{path}: not a generate-data shard ({e}); delete it to generate it again") from None


# Every name generate-data writes in its folder: the report, the shards, and their temp files.
_OWN_FILE = re.compile(r"(generate\.json|part-\d{5}\.jsonl)(\.tmp)?")


def _check_out_path(out: Path, cfg: GenerateDataConfig) -> None:
    """--out a folder apart from every input: checked before its lock is taken (which creates it)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; pass a folder")
    check_out_apart_from_inputs(out, {"--model": cfg.model, "--data": cfg.data, "--prompts": cfg.prompts})


def _check_out(out: Path, cfg: GenerateDataConfig) -> dict | None:
    """Refuse a folder holding anything generate-data did not write, or a corpus generated with other settings
    (never mix two corpora, never write among a user's files); returns the earlier corpus's report, which a rerun
    continues (None: a new corpus, or --overwrite)."""
    foreign = sorted(p.name for p in out.iterdir() if not (_OWN_FILE.fullmatch(p.name) and p.is_file())) \
        if out.exists() else []
    if foreign:
        raise ValueError(f"--out {out}: holds other files ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}"
                         "); pass an empty or new folder")
    report = out / REPORT_FILE
    if not report.exists():
        if cfg.overwrite and any(out.glob("part-*.jsonl")):  # shards no report of ours accounts for
            raise ValueError(f"--out {out}: holds part-*.jsonl files but no {REPORT_FILE}, so nothing proves them "
                             "generate-data's; pass an empty or new folder")
        return None
    # Reports from before the stamp existed are recognised by their keys.
    if not owned_by(report, "generate-data", legacy_keys=("config", "complete")) or \
            not isinstance(read_record(report).get("config"), dict):
        raise ValueError(f"--out {out}: holds a {REPORT_FILE} that generate-data did not write; pass an empty or new "
                         "folder")
    if cfg.overwrite:  # replaced once the inputs have loaded (_replace_corpus)
        return None
    # The budget may grow: shard i does not depend on it, so a larger --tokens continues the corpus. Nor does the
    # folder's own path: a copied or moved corpus continues where it is.
    saved = {**field_defaults(GenerateDataConfig), **read_record(report)["config"]}  # older reports lack later flags
    if {**saved, "tokens": cfg.tokens, "out": cfg.out, "overwrite": cfg.overwrite} != asdict(cfg):
        raise ValueError(f"--out {out}: holds a corpus generated with other settings; use another folder or "
                         "--overwrite")
    return read_record(report)


def _corpus_fingerprint(cfg: GenerateDataConfig) -> str:
    """data.corpus_fingerprint of the prompts' source: the --data files, or the --prompts file."""
    return data.corpus_fingerprint(data.list_text_files(cfg.data) if cfg.data else [Path(cfg.prompts)])


def _check_same_inputs(saved: dict | None, inputs: dict, cfg: GenerateDataConfig, out: Path) -> None:
    """Refuse to continue a corpus whose --data / --prompts or teacher changed since it was started: its new
    shards would continue another source's. Reports from before the fingerprints were kept: nothing to compare.

    Raises:
        ValueError: one line naming the flag, and the ways out (restore it, or --overwrite).
    """
    source = f"--data {' '.join(cfg.data)}" if cfg.data else f"--prompts {cfg.prompts}"
    for key, what in (("corpus_sha256", f"{source}: the text"), ("teacher", f"--model {cfg.model}: the teacher "
                                                                           "(its weights or config)")):
        if key in inputs and (saved or {}).get(key, inputs[key]) != inputs[key]:
            raise ValueError(f"{what} changed since the corpus in {out} was started ({REPORT_FILE} records "
                             "another); restore it, or pass --overwrite to generate the corpus again")


def _replace_corpus(out: Path) -> None:
    """--overwrite: remove the earlier corpus (only the names generate-data writes; _check_out vetted the folder)."""
    for path in out.iterdir() if out.exists() else []:
        if _OWN_FILE.fullmatch(path.name) and path.is_file():
            path.unlink()


def generate_data(cfg: GenerateDataConfig, log: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Write the corpus (resuming a stopped run) and return its report (also `out/generate.json`); `progress`: a
    bar over the token budget on stderr.

    Raises:
        ValueError: an --out that is a file, lies in or holds an input, holds other files or another corpus, or
            that another command is writing now (FolderLock).
    """
    out = Path(cfg.out)
    _check_out_path(out, cfg)
    with FolderLock(out, "--out"):  # a second generate-data into this folder fails at once instead of mixing
        saved = _check_out(out, cfg)
        return _generate(cfg, out, saved, log, progress)


def _generate(cfg: GenerateDataConfig, out: Path, saved: dict | None, log: Callable[[str], None],
              progress: bool) -> dict:
    tokenizer = models.load_tokenizer(cfg.model)
    # Corpus prompts for a few times the samples a full-length budget needs; an early EOS (short answers)
    # needs more samples, and the prompts then cycle with fresh seeds.
    prompts, chat = _prompts(cfg, tokenizer, 4 * -(-cfg.tokens // cfg.max_new_tokens))
    inputs = {} if cfg.unconditional else {"corpus_sha256": _corpus_fingerprint(cfg)}
    _check_same_inputs(saved, inputs, cfg, out)  # the text first: a changed corpus fails before the model loads
    model = models.load_causal_lm(cfg.model)
    identity = identities.model_fingerprint(model, cfg.model)  # of the weights as stored, as build-cache records it
    inputs["teacher"] = {k: identity[k] for k in ("weights_sha256", "config_sha256")}
    _check_same_inputs(saved, inputs, cfg, out)
    device = dev.resolve_device(cfg.device)
    # bf16 weights on an accelerator (half the memory and bandwidth per decoded token); fp32 on the CPU
    dtype = precision.autocast_dtype(device, cfg.precision) or torch.float32
    dev.move_model_(model.to(dtype), device).eval()
    if cfg.overwrite:  # the inputs have loaded: only now is the earlier corpus removed
        _replace_corpus(out)
    out.mkdir(parents=True, exist_ok=True)
    # The settings and inputs first, so a rerun with others is refused, not mixed.
    atomic_write_json(out / REPORT_FILE, {**owner_stamp("generate-data"), "config": asdict(cfg), **inputs,
                                          "complete": False})
    # Shards of shard_samples samples until the token budget is met: shard i's prompts (samples i*n ..) and
    # seeds depend only on i, so a rerun skips the finished shards and continues exactly where it stopped.
    started, tokens, samples, index = time.perf_counter(), 0, 0, 0
    first_shard: tuple[float, int] | None = None  # (end time, tokens) of the first shard sampled: compiles included
    with tqdm(total=cfg.tokens, unit="tok", unit_scale=True, desc="generate-data", disable=not progress) as bar:
        while tokens < cfg.tokens:
            path = out / SHARD.format(index=index)
            if path.exists():  # written before a stop: counted, not sampled again
                done = _shard_tokens(path)
                tokens, samples, index = tokens + sum(done), samples + len(done), index + 1
                bar.update(min(sum(done), bar.total - bar.n))
                continue
            bar.set_postfix_str(path.name)
            lines, counts = _sample_shard(cfg, model, tokenizer, prompts, chat, device, index, cfg.tokens - tokens,
                                          bar)
            tokens += sum(counts)
            if not any(counts):
                raise ValueError(f"--model {cfg.model}: every sample of {path.name} ended at once (EOS first); use "
                                 "other prompts, --raw-prompts or a higher --temperature")
            atomic_write_text(path, "\n".join(lines) + "\n")  # a full disk: no half shard, one line naming it
            samples, index = samples + len(lines), index + 1
            first_shard = first_shard or (time.perf_counter(), tokens)
    report = {**owner_stamp("generate-data"), "config": asdict(cfg), **inputs, "complete": True, "prompts": len(prompts),
              "chat": chat, "samples": samples, "shards": index, "generated_tokens": tokens,
              "seconds": round(time.perf_counter() - started, 3)}
    if first_shard is not None:  # the rate once the decode step is compiled: the first shard's time set apart
        report["first_shard_seconds"] = round(first_shard[0] - started, 3)  # ms: a tiny model's shard is under 0.05 s
        after_s, after_tokens = time.perf_counter() - first_shard[0], tokens - first_shard[1]
        report["tokens_per_s_after_first_shard"] = round(after_tokens / after_s, 1) if after_tokens else None
    atomic_write_json(out / REPORT_FILE, report)
    log(f"{tokens:,} generated tokens in {samples} samples: {out} (build a cache with --data {out}"
        + (" --chat)" if chat else ")"))
    return report
