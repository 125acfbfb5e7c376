"""Shared fixtures: tiny models built from a config and a tokenizer trained on the spot. No downloads."""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch


def pytest_configure(config) -> None:
    """The suite never reads or writes the user's caches: the asset folder and the persistent XLA compile cache
    (`--xla-cache-dir auto`) of every command a test runs, in process or not, lie in one fresh folder per run, so
    a graph compiled by an earlier run cannot change this run's compile counts."""
    import os
    import tempfile

    config.qat_lora_cache_home = os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="qat-lora-tests-cache-")
    os.environ.pop("QAT_LORA_HOME", None)


def pytest_unconfigure(config) -> None:
    import shutil

    shutil.rmtree(getattr(config, "qat_lora_cache_home", ""), ignore_errors=True)

def recorded_figures() -> set[str]:
    """Every number in docs/results/**/*.json, as written with 1 to 4 decimals: what a figure the docs quote must be
    (tests/test_docs.py for README, tests/test_results_trace.py for docs/RESULTS.md)."""
    import json

    values: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            values.update(f"{node:.{digits}f}" for digits in range(1, 5))

    for path in (Path(__file__).resolve().parents[1] / "docs" / "results").rglob("*.json"):
        walk(json.loads(path.read_text()))
    return values


def load_benchmark(script: str, name: str | None = None):
    """benchmarks/<script>.py as a module. benchmarks/ is scripts, not a package: the file itself is loaded (no
    sys.path change leaks into other tests), registered before it runs, as dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(name or script, Path(__file__).resolve().parents[1] / "benchmarks"
                                                  / f"{script}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WORDS = ("the a of to and in is was for on that with as by at from his her it an be this which or are "
         "king queen river city music war light stone house garden ship star night morning letter "
         "speaks runs sees builds writes sings holds keeps finds brings old new great small red green "
         "quiet bright early late under over near far").split()


def synthetic_text(num_docs: int, seed: int = 0) -> str:
    """Deterministic English-like documents separated by blank lines."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_docs):
        sentences = []
        for _ in range(rng.randint(2, 6)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    return "\n\n".join(docs) + "\n"


def make_tokenizer(text: str, split: str = "gpt-2"):
    """A byte-level BPE of ~300 tokens; `split` "gpt-2" (GPT-2's regex) or "qwen2" (Qwen2's regex, then byte-level
    without one, as Qwen2/Qwen3's tokenizer.json)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split == "qwen2":
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def make_model_dir(path: Path, tokenizer, arch: str = "llama", seed: int = 0, init_std: float = 0.08,
                   head_dim: int = 16, tie_word_embeddings: bool = False) -> Path:
    """Save a 2-layer random model (Llama, Qwen2 with q/k/v biases, or Qwen3 with `head_dim`) and its tokenizer as a
    transformers folder (`tie_word_embeddings`: the head is the embedding, as in SmolLM2's GGUF)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=init_std, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_word_embeddings)
    config = {"qwen3": lambda: Qwen3Config(head_dim=head_dim, **common), "qwen2": lambda: Qwen2Config(**common),
              "llama": lambda: LlamaConfig(**common)}[arch]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.txt").write_text(synthetic_text(120, seed=1))
    (root / "b.txt").write_text(synthetic_text(120, seed=2))
    return root


@pytest.fixture(scope="session")
def tokenizer(corpus_dir):
    return make_tokenizer((corpus_dir / "a.txt").read_text() + (corpus_dir / "b.txt").read_text())


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory, tokenizer) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("teacher"), tokenizer, "llama", seed=0, init_std=0.25)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory, tokenizer) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("qwen3"), tokenizer, "qwen3", seed=1, init_std=0.25)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory, teacher_dir, corpus_dir) -> Path:
    """A top-8 fp32 KD cache of the tiny teacher (L = 32, ~6 k tokens, 10 % of documents held out)."""
    from qat_lora.cache.builder import build_cache
    from qat_lora.cache.config import CacheBuildConfig

    out = tmp_path_factory.mktemp("cache")
    build_cache(CacheBuildConfig(teacher=str(teacher_dir), data=[str(corpus_dir)], out=str(out), seq_len=32,
                                 encoding="topk", top_k=8, value_bits=32, max_tokens=6_000, batch_size=8, holdout_fraction=0.1,
                                 device="cpu"), log=lambda _: None)
    return out


def save_random_adapter(model_dir: Path, quant: str, path: Path, r: int = 4, alpha: float = 8.0, seed: int = 0):
    """A recovery adapter over the `quant` student of `model_dir` whose B is random (stands in for a trained one,
    whose B is non-zero), saved as PEFT files in `path`; returns the adapted student."""
    from qat_lora.train.config import StudentSpec
    from qat_lora.train.lora import add_recovery_lora_
    from qat_lora.train.student import build_student

    adapted = add_recovery_lora_(build_student(StudentSpec(str(model_dir), quant)), r=r, alpha=alpha)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
    adapted.save_pretrained(str(path))
    return adapted
