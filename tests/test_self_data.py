"""`qat-lora generate-data`: a corpus sampled from the teacher, resumable shard by shard, read by build-cache."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from qat_lora.cache.reader import KDCache
from qat_lora.commands.cli import main
from qat_lora.data.config import GenerateDataConfig
from qat_lora.data.text import list_text_files
from qat_lora.data.teacher_text import corpus_prompts, generate_data

QUIET = dict(log=lambda _: None, progress=False)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model gains nothing from more; on a busy host they cost
    yield
    torch.set_num_threads(threads)


def _cfg(teacher_dir, corpus_dir, out, **kw) -> GenerateDataConfig:
    base = dict(model=str(teacher_dir), data=[str(corpus_dir)], out=str(out), prefix_tokens=8, stride=64,
                tokens=600, max_new_tokens=20, batch_size=4, shard_samples=8, device="cpu")
    return GenerateDataConfig(**{**base, **kw})


def _records_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _records(folder) -> list[dict]:
    return [json.loads(line) for p in sorted(folder.glob("part-*.jsonl")) for line in p.read_text().splitlines()]


def test_corpus_prefixes_are_continued_within_the_budget(teacher_dir, corpus_dir, tokenizer, tmp_path, capsys):
    report = generate_data(_cfg(teacher_dir, corpus_dir, tmp_path / "self"), log=lambda _: None)
    assert "generate-data: 100%" in capsys.readouterr().err  # the bar over the token budget, with its ETA
    records = _records(tmp_path / "self")
    assert report["samples"] == len(records) and report["shards"] == 4 and report["complete"]
    assert all(0 <= r["tokens"] <= 20 for r in records)
    # Sampling stops at the first batch (4 samples x <= 20 tokens) that reaches the budget.
    assert 600 <= report["generated_tokens"] == sum(r["tokens"] for r in records) < 600 + 4 * 20
    first = sum(r["tokens"] for r in _records_of(tmp_path / "self" / "part-00000.jsonl"))  # compiles, elsewhere
    assert 0 < report["first_shard_seconds"] <= report["seconds"]
    assert report["tokens_per_s_after_first_shard"] > 0 and first < report["generated_tokens"]
    corpus = (corpus_dir / "a.txt").read_text() + (corpus_dir / "b.txt").read_text()
    prompts = corpus_prompts(list_text_files([corpus_dir]), tokenizer, 8, 64, len(records))
    assert len(set(prompts)) == len(records) and all(p in corpus for p in prompts)
    assert all(r["text"].startswith(p) for r, p in zip(records, prompts))  # each sample starts with a passage
    assert any(r["text"] not in corpus for r in records)  # and goes on with the teacher's own text


def test_a_stopped_run_resumes_to_the_same_corpus(teacher_dir, corpus_dir, tmp_path):
    generate_data(_cfg(teacher_dir, corpus_dir, tmp_path / "whole"), **QUIET)
    out = tmp_path / "stopped"
    generate_data(_cfg(teacher_dir, corpus_dir, out), **QUIET)
    kept = out / "part-00000.jsonl"
    mtime = kept.stat().st_mtime_ns
    for name in ("part-00002.jsonl", "part-00003.jsonl"):
        (out / name).unlink()  # as if stopped after two shards
    (out / "part-00002.jsonl.tmp").write_text('{"text": "half a shard')
    report = generate_data(_cfg(teacher_dir, corpus_dir, out), **QUIET)
    assert kept.stat().st_mtime_ns == mtime  # finished shards are not generated again
    for name in (f"part-{i:05d}.jsonl" for i in range(4)):
        assert (out / name).read_text() == (tmp_path / "whole" / name).read_text()
    assert report["generated_tokens"] == json.loads((tmp_path / "whole" / "generate.json").read_text())[
        "generated_tokens"]


def test_short_answers_are_made_up_by_more_samples(teacher_dir, corpus_dir, tmp_path, monkeypatch):
    import qat_lora.data.teacher_text as self_data

    real = self_data._sample
    monkeypatch.setattr(self_data, "_sample", lambda *a: [ids[:3] for ids in real(*a)])  # as if EOS after 3
    report = generate_data(_cfg(teacher_dir, corpus_dir, tmp_path / "short", tokens=100), **QUIET)
    assert report["generated_tokens"] >= 100 and report["samples"] >= 34  # not 5 samples of 3 tokens
    monkeypatch.setattr(self_data, "_sample", lambda *a: [[] for _ in real(*a)])
    with pytest.raises(ValueError, match="ended at once"):
        generate_data(_cfg(teacher_dir, corpus_dir, tmp_path / "empty", tokens=100), **QUIET)


def test_a_larger_budget_continues_the_corpus(teacher_dir, corpus_dir, tmp_path):
    out = tmp_path / "self"
    small = generate_data(_cfg(teacher_dir, corpus_dir, out, tokens=300), **QUIET)
    first = {p.name: p.read_text() for p in out.glob("part-*.jsonl")}
    large = generate_data(_cfg(teacher_dir, corpus_dir, out, tokens=600), **QUIET)
    assert large["generated_tokens"] >= 600 > small["generated_tokens"] and large["shards"] > small["shards"]
    assert all((out / name).read_text() == text for name, text in first.items())  # extended, not redone
    assert json.loads((out / "generate.json").read_text())["config"]["tokens"] == 600
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)  # a copied corpus continues in its new folder
    larger = generate_data(_cfg(teacher_dir, corpus_dir, moved, tokens=900), **QUIET)
    assert larger["generated_tokens"] >= 900 and all((moved / name).read_text() == text for name, text in first.items())
    assert json.loads((moved / "generate.json").read_text())["config"]["out"] == str(moved)


def test_other_settings_in_the_same_folder_are_refused(teacher_dir, corpus_dir, tmp_path):
    generate_data(_cfg(teacher_dir, corpus_dir, tmp_path / "self", tokens=100), **QUIET)
    with pytest.raises(ValueError, match="holds a corpus generated with other settings"):
        generate_data(_cfg(teacher_dir, corpus_dir, tmp_path / "self", tokens=100, temperature=0.7), **QUIET)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="holds other files"):
        generate_data(_cfg(teacher_dir, corpus_dir, tmp_path / "other", tokens=100), **QUIET)
    assert (tmp_path / "other" / "model.safetensors").read_bytes() == b"x"


def test_build_cache_reads_the_generated_corpus(teacher_dir, corpus_dir, tmp_path):
    assert main(["generate-data", "--model", str(teacher_dir), "--data", str(corpus_dir), "--out",
                 str(tmp_path / "self"), "--prefix-tokens", "8", "--tokens", "1200", "--max-new-tokens", "24",
                 "--device", "cpu"]) == 0
    assert main(["build-cache", "--teacher", str(teacher_dir), "--data", str(tmp_path / "self"), "--out",
                 str(tmp_path / "cache"), "--seq-len", "16", "--encoding", "topk", "--top-k", "4", "--device", "cpu"]) == 0
    cache = KDCache(tmp_path / "cache")
    cached = cache.num_sequences("train") + cache.num_sequences("heldout")
    generated = json.loads((tmp_path / "self" / "generate.json").read_text())["generated_tokens"]
    assert cached * 16 >= generated  # every generated token (and its prompt) is in the cache


def test_an_unfinished_corpus_is_refused_until_it_completes(teacher_dir, corpus_dir, tmp_path, capsys):
    out = tmp_path / "self"
    generate_data(_cfg(teacher_dir, corpus_dir, out), **QUIET)
    (out / "part-00003.jsonl").unlink()  # as if stopped after three shards: its report says complete false
    report = json.loads((out / "generate.json").read_text())
    (out / "generate.json").write_text(json.dumps({**report, "complete": False}))
    cache = tmp_path / "cache"
    assert main(["build-cache", "--teacher", str(teacher_dir), "--data", str(out), "--out", str(cache),
                 "--seq-len", "16", "--encoding", "topk", "--top-k", "4", "--device", "cpu"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--data {out}" in err and "has not finished" in err and "rerun" in err
    assert not cache.exists()
    shards = sorted(out.glob("part-*.jsonl"))
    assert list_text_files(shards) == shards  # the finished shards, named one by one, still read
    generate_data(_cfg(teacher_dir, corpus_dir, out), **QUIET)  # completes it
    assert len(list_text_files([out])) == 4


def test_chat_prompts_become_message_records(teacher_dir, corpus_dir, tokenizer, tmp_path):
    chat_teacher = tmp_path / "chat-teacher"
    shutil.copytree(teacher_dir, chat_teacher)
    tokenizer = type(tokenizer).from_pretrained(teacher_dir)
    tokenizer.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    tokenizer.save_pretrained(chat_teacher)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("tell of the king\n\nthe river at night\n")
    report = generate_data(GenerateDataConfig(model=str(chat_teacher), prompts=str(prompts), out=str(tmp_path / "o"),
                                              tokens=80, max_new_tokens=10, batch_size=2, device="cpu"), **QUIET)
    records = _records(tmp_path / "o")
    assert report["chat"] and len(records) >= 8 and report["generated_tokens"] >= 80
    assert [r["messages"][0]["content"] for r in records[:2]] == ["tell of the king", "the river at night"]
    assert all(r["messages"][1]["role"] == "assistant" for r in records)
    assert main(["build-cache", "--teacher", str(chat_teacher), "--data", str(tmp_path / "o"), "--chat", "--out",
                 str(tmp_path / "cache"), "--seq-len", "16", "--encoding", "topk", "--top-k", "4", "--holdout-fraction", "0.2",
                 "--device", "cpu"]) == 0


def test_unconditional_samples_start_from_the_bos_token_alone(teacher_dir, corpus_dir, tokenizer, tmp_path,
                                                               monkeypatch):
    import qat_lora.data.teacher_text as self_data

    bos_teacher = tmp_path / "bos-teacher"
    shutil.copytree(teacher_dir, bos_teacher)
    tokenizer = type(tokenizer).from_pretrained(teacher_dir)
    tokenizer.bos_token = "<|endoftext|>"
    tokenizer.save_pretrained(bos_teacher)
    seen = []
    real = self_data._sample
    monkeypatch.setattr(self_data, "_sample", lambda m, t, ids, *a: seen.extend(ids) or real(m, t, ids, *a))
    cfg = GenerateDataConfig(model=str(bos_teacher), unconditional=True, out=str(tmp_path / "o"), tokens=120,
                             max_new_tokens=12, batch_size=4, shard_samples=8, device="cpu")
    report = generate_data(cfg, **QUIET)
    records = _records(tmp_path / "o")
    assert seen and all(ids == [tokenizer.bos_token_id] for ids in seen)  # no prompt but BOS
    assert report["prompts"] == 1 and not report["chat"] and "corpus_sha256" not in report
    assert report["generated_tokens"] >= 120 and len({r["text"] for r in records}) == len(records)  # own seeds
    assert report["config"]["unconditional"]
    # A rerun continues it; the same folder with a corpus's prompts is another corpus, refused.
    assert generate_data(cfg, **QUIET)["generated_tokens"] == report["generated_tokens"]
    with pytest.raises(ValueError, match="other settings"):
        other = {**cfg.__dict__, "unconditional": False, "data": [str(corpus_dir)]}
        generate_data(GenerateDataConfig(**other), **QUIET)
    assert main(["build-cache", "--teacher", str(bos_teacher), "--data", str(tmp_path / "o"), "--out",
                 str(tmp_path / "cache"), "--seq-len", "16", "--encoding", "topk", "--top-k", "4",
                 "--holdout-fraction", "0.2", "--device", "cpu"]) == 0


@pytest.mark.parametrize("flags, message", [
    ([], "pass exactly one of --data"),
    (["--data", "CORPUS", "--prompts", "p.txt"], "pass exactly one of --data"),
    (["--data", "CORPUS", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--data", "CORPUS", "--shard-samples", "1001"], "--shard-samples 1001: at most 1000"),
    (["--data", "CORPUS", "--batch-size", "256"], "--batch-size 256: larger than --shard-samples 64"),
    (["--data", "CORPUS", "--temperature", "nan"], "--temperature nan: must be positive"),
    (["--prompts", "EMPTY"], "no prompt in it"),
    (["--prompts", "MISSING"], "no such file"),
    (["--data", "CORPUS", "--out", "FILE"], "is a file; pass a folder"),
    (["--unconditional", "--data", "CORPUS"], "--unconditional samples from the BOS token alone"),
    (["--unconditional", "--prefix-tokens", "8"], "--prefix-tokens"),
    (["--unconditional"], "has no BOS token to start from"),  # the test tokenizer has none
])
def test_bad_flags_are_one_line_errors(flags, message, teacher_dir, corpus_dir, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "file").write_text("x")
    subs = {"CORPUS": str(corpus_dir), "EMPTY": str(tmp_path / "empty.txt"), "MISSING": str(tmp_path / "nope.txt"),
            "FILE": str(tmp_path / "file")}
    argv = ["generate-data", "--model", str(teacher_dir), "--out", str(tmp_path / "o"),
            *[subs.get(f, f) for f in flags]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "o").exists()


def test_resume_reads_shards_whose_text_holds_unicode_line_separators(teacher_dir, corpus_dir, tmp_path):
    out = tmp_path / "self"
    first = generate_data(_cfg(teacher_dir, corpus_dir, out, tokens=300), **QUIET)
    shard = out / "part-00000.jsonl"
    records = [json.loads(line) for line in shard.read_text().split("\n") if line]
    records[0]["text"] += "\u2028and\x85on"  # generated text may hold them; splitlines() would break the record
    shard.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n", encoding="utf-8")
    assert generate_data(_cfg(teacher_dir, corpus_dir, out, tokens=300), **QUIET)["generated_tokens"] == \
        first["generated_tokens"]
    shard.write_text('{"text": "cut', encoding="utf-8")
    with pytest.raises(ValueError, match="part-00000.jsonl: not a generate-data shard"):
        generate_data(_cfg(teacher_dir, corpus_dir, out, tokens=300), **QUIET)


GENERATE_DATA_ON_XLA = """
import json, sys
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from qat_lora.data.config import GenerateDataConfig
from qat_lora.data.teacher_text import generate_data
from qat_lora.runtime import xla

model, corpus, out = sys.argv[1:4]
report = {}
# one batch of 8 new tokens; one of 16 (a new cache size); three of 16 (the same shapes again)
for tag, new_tokens, budget in (("8x1", 8, 20), ("16x1", 16, 40), ("16x3", 16, 150)):
    met.clear_all()
    cfg = GenerateDataConfig(model=model, data=[corpus], out=f"{out}/{tag}", prefix_tokens=8, stride=64,
                             tokens=budget, max_new_tokens=new_tokens, batch_size=4, shard_samples=12,
                             device="xla", precision="bf16")
    done = generate_data(cfg, log=lambda _: None, progress=False)
    xm.wait_device_ops()
    report[tag] = {"tokens": done["generated_tokens"], "samples": done["samples"], **xla.compile_metrics()}
print(json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.xla
def test_generate_data_on_xla_compiles_per_cache_size_not_per_token_or_batch(teacher_dir, corpus_dir, tmp_path):
    # A static KV cache and prompts padded to a bucket: every decode step and every batch of one cache size has the
    # same shapes. Twice the new tokens (a new cache size, compiled afresh) compile about as many graphs as before,
    # not one more per token; three more batches of that size compile almost nothing, only executing more.
    from helpers_xla import on_xla, require_torch_xla

    require_torch_xla()
    report = on_xla(GENERATE_DATA_ON_XLA, str(teacher_dir), str(corpus_dir), str(tmp_path), timeout=550)
    one, longer, more = report["8x1"], report["16x1"], report["16x3"]
    assert more["samples"] > longer["samples"] and more["tokens"] > longer["tokens"] > one["tokens"] > 0, report
    assert one["graphs_compiled"] > 0 and abs(longer["graphs_compiled"] - one["graphs_compiled"]) <= 4, report
    assert more["graphs_compiled"] <= 4 and more["graph_executions"] > longer["graph_executions"], report


@pytest.mark.parametrize("precision, dtype", [("auto", torch.float32), ("bf16", torch.bfloat16)])
def test_precision_sets_the_teachers_weights_and_is_recorded(precision, dtype, teacher_dir, corpus_dir, tmp_path,
                                                             monkeypatch):
    import qat_lora.data.teacher_text as teacher_text

    seen, sample = [], teacher_text._sample
    monkeypatch.setattr(teacher_text, "_sample", lambda model, *a, **k: seen.append(
        next(model.parameters()).dtype) or sample(model, *a, **k))
    report = generate_data(_cfg(teacher_dir, corpus_dir, tmp_path / "out", tokens=40, precision=precision), **QUIET)
    assert set(seen) == {dtype} and report["generated_tokens"] >= 40  # auto on the CPU: fp32
    assert json.loads((tmp_path / "out" / "generate.json").read_text())["config"]["precision"] == precision
