"""The KD cache: encodings round-trip, builds are deterministic, resumable and rank-shardable, and
damage is detected (DESIGN §2; docs/cache-format.md)."""
from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from qat_lora.cache.reader import KDCache, inspect_cache, verify_cache
from qat_lora.cache.builder import build_cache
from qat_lora.cache.merge import merge_manifests
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.commands.cli import main
from qat_lora.cache.encodings import (DELTA_STEP, SampledEncoding, TopKEncoding, blocked_count_at_most, encode_rows,
                                pack_bits, unpack_bits)

V, L = 300, 16


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(2, L, V, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("bits", [1, 5, 9, 16, 18])
def test_bit_packing_round_trips(bits):
    values = np.random.default_rng(bits).integers(0, 2**bits, size=1001)
    packed = pack_bits(values, bits)
    assert len(packed) == -(-1001 * bits // 8)
    assert np.array_equal(unpack_bits(packed, bits, 1001), values)


@pytest.mark.parametrize("value_bits", [32, 16, 8])
def test_topk_round_trip_ids_exact_and_probabilities_within_bound(value_bits):
    encoding = TopKEncoding(top_k=12, value_bits=value_bits)
    logits = _logits(value_bits)
    values, ids = torch.log_softmax(logits, -1).topk(12, -1)
    for b, row in enumerate(encode_rows(encoding, logits, V, [0, 1])):
        decoded = encoding.decode(row, L, V)
        assert torch.equal(decoded["topk_ids"], ids[b])
        error = (decoded["topk_logprobs"] - values[b]).abs()
        bound = 1e-6 if value_bits == 32 else DELTA_STEP[value_bits] / 2 + 1e-5
        in_range = (values[b][:, :1] - values[b]) < (255 if value_bits == 8 else 65535) * DELTA_STEP.get(value_bits, 1)
        assert error[in_range].max() <= bound
        # Documented bound on probabilities: each within a factor exp(step/2) of the teacher's.
        if value_bits != 32:
            ratio = (decoded["topk_logprobs"] - values[b])[in_range].exp()
            assert ratio.max() <= np.exp(bound) and ratio.min() >= np.exp(-bound)


def test_sampled_round_trip_counts_and_ids_exact():
    encoding = SampledEncoding(num_samples=20)
    logits = _logits(3)
    selected = encoding.select(logits, [11, 12])
    for sel, row in zip(selected, [encoding.pack_row(s, V) for s in selected]):
        decoded = encoding.decode(row, L, V)
        assert torch.allclose(decoded["sample_weights"].sum(-1), torch.ones(L))
        for t in range(L):
            unique, counts = np.unique(sel["draws"][t], return_counts=True)
            got = {int(i): round(float(w) * 20) for i, w in zip(decoded["sample_ids"][t], decoded["sample_weights"][t]) if w > 0}
            assert got == dict(zip(unique.tolist(), counts.tolist()))
    # Same seed, same draws, whatever else shares the batch.
    again = encoding.select(torch.cat([logits[1:], logits[:1]]), [12, 11])
    assert np.array_equal(again[0]["draws"], selected[1]["draws"])



@pytest.mark.parametrize("vocab", [1, 2, 7, 300, 1031])
def test_blocked_inverse_cdf_equals_searchsorted(vocab):
    # XLA's inverse CDF (no searchsorted there) against searchsorted's right-side index, with zero-probability
    # tokens (flat CDF steps), targets exactly on a CDF value, and vocabularies that do not fill the last block.
    gen = torch.Generator().manual_seed(vocab)
    probs = torch.rand(3, 5, vocab, generator=gen) ** 6 * (torch.rand(vocab, generator=gen) > 0.3)
    probs[..., 0] += 1e-3
    cdf = (probs / probs.sum(-1, keepdim=True)).cumsum(-1)
    targets = torch.rand(3, 5, 40, generator=gen) * cdf[..., -1:]
    targets[..., 0] = cdf[..., vocab // 2]
    targets[..., 1] = 0.0
    targets[..., 2] = cdf[..., -1]
    assert torch.equal(blocked_count_at_most(cdf, targets), torch.searchsorted(cdf, targets, right=True))


def test_sampled_draws_follow_the_teacher_distribution():
    # 64 x 400 draws from one known distribution: each token's frequency within 4.5 binomial standard deviations
    # of its probability, and a token of probability 0 never drawn.
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5, -3.0]).expand(1, 400, 7)
    draws = SampledEncoding(num_samples=64).select(logits, [3])[0]["draws"]
    probs, n = torch.softmax(logits[0, 0], -1).numpy(), draws.size
    freq = np.bincount(draws.reshape(-1), minlength=7) / n
    assert freq[4] == 0
    assert (np.abs(freq - probs) <= 4.5 * np.sqrt(probs * (1 - probs) / n) + 1e-12).all(), (freq, probs)

def _config(teacher_dir, corpus_dir, out, **overrides) -> CacheBuildConfig:
    args = dict(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(out), seq_len=16, encoding="topk", top_k=8, value_bits=16,
                max_tokens=6_000, batch_size=4, holdout_fraction=0.1, shard_sequences=16, device="cpu")
    return CacheBuildConfig(**{**args, **overrides})


def _shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, teacher_dir, corpus_dir) -> Path:
    out = tmp_path_factory.mktemp("reference")
    build_cache(_config(teacher_dir, corpus_dir, out), log=lambda _: None)
    return out


@pytest.mark.slow
def test_builds_are_deterministic_and_verify_clean(reference, teacher_dir, corpus_dir, tmp_path):
    build_cache(_config(teacher_dir, corpus_dir, tmp_path / "again"), log=lambda _: None)
    assert _shard_bytes(reference) == _shard_bytes(tmp_path / "again") and len(_shard_bytes(reference)) > 4
    assert verify_cache(reference) == []
    info = inspect_cache(reference)
    assert info["bytes_per_token"] > 0 and info["encoding"]["value_bits"] == 16


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("encoding", ["topk", "sampled"])
def test_two_ranks_together_equal_one_rank(teacher_dir, corpus_dir, tmp_path, encoding):
    one = tmp_path / "one"
    build_cache(_config(teacher_dir, corpus_dir, one, encoding=encoding), log=lambda _: None)
    two = tmp_path / "two"
    for rank in (0, 1):
        path = build_cache(_config(teacher_dir, corpus_dir, two, encoding=encoding, rank=rank, world_size=2),
                           log=lambda _: None)
        assert path.name == f"manifest-r{rank:03d}.json"
    merge_manifests(two, log=lambda _: None)
    a, b = KDCache(one), KDCache(two)
    for split in ("train", "heldout"):
        assert a.num_sequences(split) == b.num_sequences(split) > 0
        for i in range(a.num_sequences(split)):
            x, y = a.sequence(i, split), b.sequence(i, split)
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), (split, i)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_merge_refuses_a_missing_rank(teacher_dir, corpus_dir, tmp_path):
    build_cache(_config(teacher_dir, corpus_dir, tmp_path, rank=1, world_size=2), log=lambda _: None)
    with pytest.raises(ValueError, match=r"ranks \[1\] finished, the build has 2"):
        merge_manifests(tmp_path, log=lambda _: None)
    with pytest.raises(ValueError, match="run `qat-lora cache merge`"):
        KDCache(tmp_path)


def _done_shards(progress: Path) -> int:
    try:
        return sum(len(v) for v in json.loads(progress.read_text())["shards"].values())
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_then_resume_gives_byte_identical_shards(reference, teacher_dir, corpus_dir, tmp_path):
    """Kill the builder at random moments (several trials), resume each time; the result must equal an
    uninterrupted build byte for byte."""
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "qat_lora", "build-cache", "--teacher", str(teacher_dir), "--data",
           str(corpus_dir), "--out", str(out), "--seq-len", "16", "--encoding", "topk", "--top-k", "8", "--value-bits", "16",
           "--max-tokens", "6000", "--batch-size", "4", "--holdout-fraction", "0.1", "--shard-sequences", "16",
           "--device", "cpu"]
    progress = out / "progress-r000.json"
    shards = len(list(reference.glob("*.safetensors")))
    rng, interrupted = random.Random(7), 0
    for trial in range(3):
        proc = subprocess.Popen(cmd + (["--resume"] if trial else []), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        target = rng.randint(1 + trial * shards // 3, (trial + 1) * shards // 3 - 1)
        while proc.poll() is None and _done_shards(progress) < target:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.05))  # between shards or in the middle of one
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            interrupted += not (out / "manifest.json").exists()
    assert subprocess.run(cmd + ["--resume"], capture_output=True).returncode == 0
    assert interrupted >= 2  # most trials really died mid-build
    assert _shard_bytes(out) == _shard_bytes(reference)
    assert not list(out.glob("*.tmp")) and not list(out.glob(".tmp*"))


@pytest.mark.slow
def test_resume_clears_what_a_kill_mid_save_leaves(reference, teacher_dir, corpus_dir, tmp_path):
    # A SIGKILL inside save_file leaves safetensors' own temp file (`.tmpXXXXXX`, safetensors >= 0.8) or ours
    # (`name.tmp`); the resumed build removes both and still equals an uninterrupted one. A user's file stays refused.
    out = tmp_path / "killed"
    out.mkdir()
    (out / ".tmpQx81Lz").write_bytes(b"half a shard")
    (out / "train-r000-00001.safetensors.tmp").write_bytes(b"half a shard")
    build_cache(_config(teacher_dir, corpus_dir, out, resume=True), log=lambda _: None)
    assert _shard_bytes(out) == _shard_bytes(reference) and not list(out.glob(".tmp*")) + list(out.glob("*.tmp"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / ".tmp_notes").write_text("not a build's")
    with pytest.raises(ValueError, match=r"holds files a cache build did not write \(\.tmp_notes\)"):
        build_cache(_config(teacher_dir, corpus_dir, tmp_path / "mine", resume=True), log=lambda _: None)


def test_resume_refuses_different_arguments(reference, teacher_dir, corpus_dir, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    for f in reference.glob("progress-r000.json"):
        (out / f.name).write_text(f.read_text())
    with pytest.raises(ValueError, match="built with other arguments"):
        build_cache(_config(teacher_dir, corpus_dir, out, top_k=4, resume=True), log=lambda _: None)


@pytest.mark.slow
def test_resume_of_a_finished_build_is_a_successful_no_op(reference, teacher_dir, corpus_dir, tmp_path):
    # A preemption loop reruns `build-cache --resume` after the build completed: exit 0, nothing rewritten.
    out = tmp_path / "done"
    build_cache(_config(teacher_dir, corpus_dir, out), log=lambda _: None)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    messages = []
    assert build_cache(_config(teacher_dir, corpus_dir, out, resume=True), log=messages.append) == out / "manifest.json"
    assert "already complete" in messages[0]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(ValueError, match="a cache already exists"):  # other arguments: not the same build
        build_cache(_config(teacher_dir, corpus_dir, out, top_k=4, resume=True), log=lambda _: None)


def _damaged_copy(reference: Path, tmp_path: Path) -> tuple[Path, Path]:
    copy = tmp_path / "damaged"
    copy.mkdir()
    for f in reference.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy, sorted(copy.glob("train-*.safetensors"))[1]


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_damage_is_reported_in_one_line_naming_the_file(reference, tmp_path, capsys, damage):
    copy, shard = _damaged_copy(reference, tmp_path)
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    else:
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest["splits"]["train"]["sequences"] += 3
        (copy / "manifest.json").write_text(json.dumps(manifest))
    assert main(["cache", "verify", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and (shard.name in err[0] or "manifest.json" in err[0]), err


@pytest.mark.multiprocess
def test_training_batches_are_fixed_shape_and_rank_disjoint(reference):
    cache = KDCache(reference)
    seen = []
    for rank in (0, 1):
        batches = list(cache.batches("train", 3, seed=5, epoch=2, rank=rank, world_size=2))
        assert all(b["input_ids"].shape == (3, 16) and b["topk_ids"].shape == (3, 16, 8) for b in batches)
        seen.append({tuple(r.tolist()) for b in batches for r in b["input_ids"]})
    assert seen[0].isdisjoint(seen[1])
    padded = list(cache.batches("heldout", 4, shuffle=False, drop_last=False))
    assert sum(int(b["attention_mask"].sum()) for b in padded) == cache.manifest["splits"]["heldout"]["tokens"]


def test_jsonl_and_chat_inputs(teacher_dir, tmp_path, tokenizer):
    records = [{"text": "the king speaks to the river."}, {"text": "a quiet garden under the stars."}] * 30
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    build_cache(_config(teacher_dir, tmp_path / "d.jsonl", tmp_path / "jsonl"), log=lambda _: None)
    assert KDCache(tmp_path / "jsonl").num_sequences("train") > 0
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected a record with a 'text' string"):
        build_cache(_config(teacher_dir, tmp_path / "bad.jsonl", tmp_path / "bad"), log=lambda _: None)
    with pytest.raises(ValueError, match="--chat: the teacher's tokenizer has no chat template"):
        build_cache(_config(teacher_dir, tmp_path / "d.jsonl", tmp_path / "chat", chat=True), log=lambda _: None)


def test_training_refuses_mismatched_vocab_tokenizer_or_context(reference, tokenizer):
    cache = KDCache(reference)
    cache.check_compatible(tokenizer, cache.vocab_size, 128)  # the matching student passes
    with pytest.raises(ValueError, match="built for vocab size"):
        cache.check_compatible(tokenizer, cache.vocab_size + 1, 128)
    with pytest.raises(ValueError, match="exceed the student's context"):
        cache.check_compatible(tokenizer, cache.vocab_size, 8)
    changed = copy.deepcopy(tokenizer)  # one more token: a different vocabulary, a different hash
    changed.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="different tokenizer"):
        cache.check_compatible(changed, cache.vocab_size, 128)


def test_preloaded_and_memory_mapped_reads_agree(reference):
    mapped, loaded = KDCache(reference), KDCache(reference, preload=True)
    for i in (0, 5, mapped.num_sequences("train") - 1):
        a, b = mapped.sequence(i), loaded.sequence(i)
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_trainer_and_eval_read_a_sampled_cache(teacher_dir, corpus_dir, tmp_path):
    from qat_lora.commands.config import EvalConfig
    from qat_lora.train.config import TrainConfig
    from qat_lora.commands.evaluate import evaluate
    from qat_lora.train.trainer import train

    cache = tmp_path / "sampled"
    build_cache(_config(teacher_dir, corpus_dir, cache, encoding="sampled", num_samples=16), log=lambda _: None)
    summary = train(TrainConfig(model=str(teacher_dir), cache=str(cache), quant="w2g32", out=str(tmp_path / "run"),
                                max_steps=4, batch_size=4, log_steps=2, device="cpu"), log=lambda _: None)
    result = evaluate(EvalConfig(model=str(teacher_dir), quant="w2g32", adapter=summary["adapter"], cache=str(cache),
                                 device="cpu"), log=lambda _: None)
    assert np.isfinite(result["kd_soft_ce"]) and 0 <= result["kd_top1"] <= 1 and result["kd_tokens"] > 0
    # The draws are of the T = 1 distribution: another temperature is refused before anything loads or is written.
    with pytest.raises(ValueError, match=r"--temperature 2.0: --cache .* holds sampled targets"):
        train(TrainConfig(model=str(teacher_dir), cache=str(cache), quant="w2g32", out=str(tmp_path / "hot"),
                          temperature=2.0, device="cpu"), log=lambda _: None)
    assert not (tmp_path / "hot").exists()


def test_chat_records_are_rendered_with_the_chat_template(teacher_dir, tmp_path):
    chat_teacher = tmp_path / "chat-teacher"
    chat_teacher.mkdir()
    for f in teacher_dir.iterdir():
        (chat_teacher / f.name).symlink_to(f)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (chat_teacher / name).unlink(missing_ok=True)
    tok.save_pretrained(chat_teacher)
    messages = [{"role": "user", "content": "the king speaks"}, {"role": "assistant", "content": "the queen sings"}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": messages}) for _ in range(40)))
    build_cache(_config(chat_teacher, tmp_path / "chat.jsonl", tmp_path / "c", chat=True, holdout_fraction=0.0),
                log=lambda _: None)
    first = KDCache(tmp_path / "c").sequence(0)
    text = tok.decode(first["input_ids"][first["attention_mask"].bool()])
    rendered = "user: the king speaks\nassistant: the queen sings\n"
    assert text.startswith("user: the king speaks\nas") and (rendered * 2).startswith(text), repr(text)


def test_saved_datasets_are_read(teacher_dir, tmp_path):
    datasets = pytest.importorskip("datasets") if not os.environ.get("CI") else __import__("datasets")
    records = {"text": ["the king speaks to the river.", "a quiet garden under the stars."] * 30}
    datasets.Dataset.from_dict(records).save_to_disk(str(tmp_path / "ds"))
    build_cache(_config(teacher_dir, tmp_path / "ds", tmp_path / "c"), log=lambda _: None)
    cache = KDCache(tmp_path / "c")
    assert cache.manifest["splits"]["train"]["tokens"] + cache.manifest["splits"]["heldout"]["tokens"] > 100


def test_teacher_dtype_and_matmul_precision_flags(reference, teacher_dir, corpus_dir, tmp_path):
    import hashlib
    import json
    import shutil
    from dataclasses import asdict

    from qat_lora.cache.reader import MANIFEST

    with pytest.raises(ValueError, match="--dtype 'fp16': choose fp32 or bf16"):
        _config(teacher_dir, corpus_dir, tmp_path, dtype="fp16")
    with pytest.raises(ValueError, match="--matmul-precision 'medium'"):
        _config(teacher_dir, corpus_dir, tmp_path, matmul_precision="medium")
    # At their defaults the new fields leave the resume fingerprint as it was before they existed.
    cfg = _config(teacher_dir, corpus_dir, tmp_path)
    before = {k: v for k, v in asdict(cfg).items()
              if k not in ("resume", "overwrite", "device", "parallel", "dtype", "matmul_precision",
                           "text_encoding", "text_errors", "xla_cache_dir")}
    before["num_samples"] = 50  # what a top-K build carried before sampled N = 64 became the default
    assert cfg.fingerprint() == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
    assert _config(teacher_dir, corpus_dir, tmp_path, dtype="bf16").fingerprint() != cfg.fingerprint()
    # Recorded in the manifest; a manifest from before they were recorded reads as fp32 at the default precision.
    assert inspect_cache(reference)["teacher_dtype"] == "fp32"
    old = tmp_path / "old"
    shutil.copytree(reference, old)
    manifest = json.loads((old / MANIFEST).read_text())
    del manifest["teacher_dtype"], manifest["matmul_precision"]
    (old / MANIFEST).write_text(json.dumps(manifest))
    assert verify_cache(old) == []
    assert {k: inspect_cache(old)[k] for k in ("teacher_dtype", "matmul_precision")} == \
        {"teacher_dtype": "fp32", "matmul_precision": "default"}
    # A bf16 teacher at the highest precision: targets close to the fp32 ones; the setting is restored after.
    precision = torch.get_float32_matmul_precision()
    build_cache(_config(teacher_dir, corpus_dir, tmp_path / "bf16", dtype="bf16", matmul_precision="highest",
                        max_tokens=600), log=lambda _: None)
    assert torch.get_float32_matmul_precision() == precision
    bf16 = KDCache(tmp_path / "bf16")
    assert bf16.manifest["teacher_dtype"] == "bf16" and bf16.manifest["matmul_precision"] == "highest"
    a, b = next(bf16.batches("train", 2, shuffle=False)), next(KDCache(reference).batches("train", 2, shuffle=False))
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert (a["topk_logprobs"][..., 0] - b["topk_logprobs"][..., 0]).abs().max() < 0.2


@pytest.mark.slow
def test_a_topk_build_from_before_the_sampled_default_resumes(reference, teacher_dir, corpus_dir, tmp_path):
    # `reference` is a top-K build; the same command line now means sampled N = 64. Interrupted before the
    # manifest, it is refused with the flag that continues it, and with that flag it finishes as it began.
    out = tmp_path / "old"
    build_cache(_config(teacher_dir, corpus_dir, out), log=lambda _: None)
    (out / "manifest.json").unlink()  # every shard written, the build stopped before its manifest
    args = {k: v for k, v in _config(teacher_dir, corpus_dir, out).__dict__.items() if k != "encoding"}
    with pytest.raises(ValueError, match="began under an earlier default: add --encoding topk"):
        build_cache(CacheBuildConfig(**{**args, "resume": True}), log=lambda _: None)
    # --num-samples means nothing to a top-K build: its old default (50) and the new one (64) resume alike.
    assert CacheBuildConfig(**{**args, "encoding": "topk", "num_samples": 50}).fingerprint() == \
        CacheBuildConfig(**{**args, "encoding": "topk"}).fingerprint()
    build_cache(CacheBuildConfig(**{**args, "encoding": "topk", "resume": True}), log=lambda _: None)
    assert _shard_bytes(out) == _shard_bytes(reference)
    assert KDCache(out).manifest["encoding"]["name"] == "topk"
