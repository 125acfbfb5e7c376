"""Cache build/read, CLI errors, and short training runs on tiny models (CPU)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from qat_lora.cache.reader import KDCache, batch_order
from qat_lora.cache.builder import build_cache
from qat_lora.commands.config import EvalConfig
from qat_lora.train.config import TrainConfig
from qat_lora.cache.config import CacheBuildConfig
from qat_lora.commands.cli import main
from qat_lora.data.text import pack
from qat_lora.commands.evaluate import evaluate
from qat_lora.data.models import load_causal_lm
from qat_lora.train.trainer import train


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, teacher_dir, corpus_dir):
    out = tmp_path_factory.mktemp("cache")
    build_cache(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(out), seq_len=32,
                                 encoding="topk", top_k=8, value_bits=32, max_tokens=12_000, batch_size=8, holdout_fraction=0.1,
                                 shard_sequences=64, device="cpu"), log=lambda _: None)
    return out


@pytest.mark.slow
def test_cache_round_trip_matches_teacher(cache_dir, teacher_dir):
    cache = KDCache(cache_dir)
    manifest = cache.manifest
    assert manifest["encoding"] == {"name": "topk", "top_k": 8, "value_bits": 32}
    assert manifest["splits"]["train"]["sequences"] > 64 and len(manifest["splits"]["train"]["shards"]) > 1
    assert manifest["splits"]["heldout"]["tokens"] > 0
    # ids decode exactly and log-probs equal a fresh teacher forward on the stored inputs.
    teacher = load_causal_lm(teacher_dir)
    rows = [cache.sequence(i) for i in (0, 1, 70)]
    ids = torch.stack([r["input_ids"] for r in rows])
    with torch.no_grad():
        values, top = torch.log_softmax(teacher(input_ids=ids).logits.float(), -1).topk(8, -1)
    assert torch.equal(torch.stack([r["topk_ids"] for r in rows]), top)
    torch.testing.assert_close(torch.stack([r["topk_logprobs"] for r in rows]), values, atol=1e-5, rtol=1e-5)
    for shard in manifest["splits"]["train"]["shards"]:
        raw = load_file(str(cache_dir / shard["file"]))
        assert raw["topk_ids_packed"].dtype == np.uint8 and raw["input_ids"].shape[1] == 32
        assert (cache_dir / shard["file"]).stat().st_size == shard["bytes"]
    assert not list(cache_dir.glob("*.tmp"))


def test_pack_pads_only_the_last_row():
    ids, mask = pack(list(range(10)), 4)
    assert ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]
    assert mask.sum() == 10 and mask[-1].tolist() == [1, 1, 0, 0]


@pytest.mark.multiprocess
def test_batch_order_is_a_pure_function_and_ranks_are_disjoint():
    a = batch_order(50, seed=3, epoch=1, rank=0, world_size=2)
    b = batch_order(50, seed=3, epoch=1, rank=1, world_size=2)
    assert torch.equal(a, batch_order(50, seed=3, epoch=1, rank=0, world_size=2))
    assert set(a.tolist()).isdisjoint(b.tolist()) and len(a) + len(b) == 50
    assert not torch.equal(a, batch_order(50, seed=3, epoch=2, rank=0, world_size=2))


@pytest.mark.slow
def test_thirty_steps_lower_heldout_kd_loss(cache_dir, teacher_dir, tmp_path):
    before = evaluate(EvalConfig(model=str(teacher_dir), quant="w2g32", cache=str(cache_dir), device="cpu"),
                      log=lambda _: None)
    summary = train(TrainConfig(model=str(teacher_dir), cache=str(cache_dir), quant="w2g32", out=str(tmp_path / "run"),
                                max_steps=30, batch_size=4, lr=3e-3, lora_r=8, warmup_steps=3, log_steps=10,
                                device="cpu"), log=lambda _: None)
    after = evaluate(EvalConfig(model=str(teacher_dir), quant="w2g32", adapter=summary["adapter"], cache=str(cache_dir),
                                device="cpu"), log=lambda _: None)
    assert after["kd_kl"] < before["kd_kl"] - 0.01, (before, after)
    assert before["bits_per_weight"] == after["bits_per_weight"] == pytest.approx(2 + (16 + 2) / 32)
    assert before["adapter_bits_per_weight"] == 0 < after["adapter_bits_per_weight"]  # rank 8 beside the base
    adapter = tmp_path / "run" / "adapter"
    assert (adapter / "adapter_model.safetensors").exists()
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == "LORA"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30] and all(np.isfinite(r["loss"]) for r in records)


def _cli_error(args, capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("qat-lora ") and err.endswith(errors[0]), err
    return errors[0]


def test_bad_input_gives_one_line_errors(tmp_path, teacher_dir, corpus_dir, cache_dir, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("\n\n  \n")
    build = ["build-cache", "--out", str(tmp_path / "c"), "--device", "cpu"]
    assert "no such model folder" in _cli_error(build + ["--teacher", str(tmp_path / "nope"), "--data", str(corpus_dir)], capsys)
    assert "empty corpus" in _cli_error(build + ["--teacher", str(teacher_dir), "--data", str(empty),
                                                  "--seq-len", "32"], capsys)
    assert "--seq-len 4096" in _cli_error(build + ["--teacher", str(teacher_dir), "--data", str(corpus_dir),
                                                   "--seq-len", "4096"], capsys)
    assert "no such file or folder" in _cli_error(build + ["--teacher", str(teacher_dir), "--data", str(tmp_path / "x")], capsys)
    assert "w9g9" in _cli_error(["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--quant", "w9g9"], capsys)
    assert "no manifest.json" in _cli_error(["train", "--model", str(teacher_dir), "--cache", str(tmp_path),
                                             "--out", str(tmp_path / "r")], capsys)
    assert "--device cuda" in _cli_error(["train", "--model", str(teacher_dir), "--cache", str(cache_dir),
                                          "--out", str(tmp_path / "r"), "--device", "cuda"], capsys) \
        if not torch.cuda.is_available() else True
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_training_refuses_a_cache_from_another_tokenizer(tmp_path, cache_dir, qwen3_dir, teacher_dir):
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    for f in cache_dir.iterdir():
        (other / f.name).symlink_to(f)
    (other / "manifest.json").unlink()
    (other / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_sha256": "0" * 64}))
    with pytest.raises(ValueError, match="different tokenizer"):
        train(TrainConfig(model=str(teacher_dir), cache=str(other), out=str(tmp_path / "r"), quant="w2g32",
                          device="cpu", max_steps=1))
