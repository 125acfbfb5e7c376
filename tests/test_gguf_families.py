"""`--format gguf` for every family (issue 28, item 3): Llama, Mistral, Qwen2, Qwen3, Gemma 3 and Phi-3 as llama.cpp's
converter writes them, and a Llama with Llama 3.1's rope scaling (`llama3`). On tiny random models of each: the
`<arch>.*` keys, every quantised tensor dequantised by gguf equal to the student's Wq bit for bit (in llama.cpp's
row order), Gemma's norms stored as 1 + w, the llama3 rope's `rope_freqs.weight` equal to the factors transformers
divides its frequencies by, the tokenizer (byte-level BPE, or SentencePiece pieces / scores / types for the Gemma-
and Llama-style vocabularies), transformers loading the file back with the student's logits, and the unmerged
LoRA adapter GGUF. Where llama.cpp's Python binding is importable (benchmarks/build_llama_cpp.sh), llama.cpp itself
loads each file with its adapter, tokenizes as the HF tokenizer does and gives the student's next-token distribution."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")  # the `gguf` extra; the dev install has it

from conftest import make_tokenizer, synthetic_text  # noqa: E402
from qat_lora.export.gguf.arch import GGUF_ARCHITECTURES, gguf_architecture, tensor_naming  # noqa: E402
from qat_lora.export.gguf.writer import GGUF_FILE, save_gguf  # noqa: E402
from qat_lora.export.gguf.lora import ADAPTER_FILE, save_gguf_lora  # noqa: E402
from qat_lora.train.lora import add_recovery_lora_  # noqa: E402
from qat_lora.data.models import load_causal_lm  # noqa: E402
from qat_lora.quant.fake_quant import FakeQuantLinear, quantize_  # noqa: E402
from qat_lora.quant.inits import snap_fp16  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "llama3")
MODEL_TYPES = {"llama3": "llama"}  # a variant: its transformers model_type
# Llama 3.1's rope scaling with a 64-token original context, so that a 16-wide head has all three kinds of
# frequency: kept (wavelength < 64 / 4), divided by the factor (> 64 / 1), and blended in between
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 64}
TOKENIZERS = {"llama": "bpe", "mistral": "llama-spm", "qwen2": "qwen2", "qwen3": "qwen2", "gemma3_text": "gemma-spm",
              "phi3": "llama-spm", "llama3": "bpe"}
TEXT = "The king 123 sees a   river.\n\nNew  4567 garden"


def _spm_tokenizer(text: str, style: str):
    """A SentencePiece-style fast tokenizer as transformers builds Gemma's / Llama's: BPE with byte fallback over
    "▁"-spelled pieces; specials, then the 256 <0xXX> byte pieces, then the trained pieces in merge order, and
    merges listing every split of a piece into two pieces, best piece first (as SentencePiece-derived merges)."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import GemmaTokenizer, LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trained.train_from_iterator([text], trainers.BpeTrainer(vocab_size=260, show_progress=False))
    pieces = sorted(trained.get_vocab().items(), key=lambda kv: kv[1])
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] if style == "gemma" else ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in pieces])}
    merges = generate_merges({p: i for p, i in vocab.items() if i >= len(specials) + 256})
    if style == "gemma":
        return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    return LlamaTokenizer(vocab=vocab, merges=merges, pad_token="<unk>", add_bos_token=True)


@pytest.fixture(scope="module")
def tokenizers_by_style():
    text = synthetic_text(120, seed=1)
    return {"bpe": make_tokenizer(text), "qwen2": make_tokenizer(text, split="qwen2"),
            "gemma-spm": _spm_tokenizer(text, "gemma"), "llama-spm": _spm_tokenizer(text, "llama")}


def _config(family: str, tokenizer):
    from transformers import AutoConfig

    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.25,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=family in ("gemma3_text", "qwen3"))
    # Qwen3: head_dim 128 as every released one (transformers' GGUF reader assumes it, llama.cpp reads the key)
    extra = {"qwen3": dict(head_dim=128), "mistral": dict(sliding_window=None),
             # every layer local (llama.cpp's default pattern on 2 layers) with a window shorter than the input
             "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                 layer_types=["sliding_attention", "sliding_attention"]),
             "phi3": dict(original_max_position_embeddings=128),
             "llama3": dict(rope_scaling=dict(LLAMA3_ROPE))}.get(family, {})  # a copy: transformers adds to it
    return AutoConfig.for_model(MODEL_TYPES.get(family, family), **common, **extra)


def _family(family: str):
    return GGUF_ARCHITECTURES[MODEL_TYPES.get(family, family)]


def _student(family: str, tokenizer, path, preset: str = "q4_0"):
    """A saved random model of the family, quantised, its quantiser moved off the init (as training leaves it)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(family, tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    student = quantize_(load_causal_lm(path, attn_implementation="eager"), preset).eval()
    with torch.no_grad():
        for layer in student.modules():
            if isinstance(layer, FakeQuantLinear):
                layer.scale.mul_(1 + 0.05 * torch.randn_like(layer.scale))
            if type(layer).__name__.endswith("RMSNorm"):
                layer.weight.add_(0.1 * torch.randn_like(layer.weight))  # norms that are not all 0 or 1
    return student


@pytest.fixture(scope="module")
def exported(tokenizers_by_style, tmp_path_factory):
    """{family: (student, tokenizer, folder with model.gguf)} written once per module."""
    out = {}
    for family in FAMILIES:
        tokenizer = tokenizers_by_style[TOKENIZERS[family]]
        root = tmp_path_factory.mktemp(family)
        student = _student(family, tokenizer, root / "hf")
        report = save_gguf(student, root / "gguf", tokenizer)
        out[family] = (student, tokenizer, root, report)
    return out


def _fields(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}, \
        {t.name: t for t in reader.tensors}


def _unpermute(x: np.ndarray, n_head: int) -> np.ndarray:
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


EXPECTED_KEYS = {  # beyond the common sizes: what each converter class adds
    "llama": {"llama.vocab_size": None, "llama.rope.dimension_count": 16, "llama.attention.key_length": 16},
    "llama3": {"llama.vocab_size": None, "llama.rope.dimension_count": 16, "llama.rope.freq_base": 1e4},
    "mistral": {"llama.vocab_size": None, "llama.rope.dimension_count": 16},
    "qwen2": {"qwen2.rope.freq_base": None},
    "qwen3": {"qwen3.attention.key_length": 128, "qwen3.attention.value_length": 128},
    "gemma3_text": {"gemma3.attention.key_length": 16, "gemma3.attention.sliding_window": 4,
                    "gemma3.rope.freq_base": 1e6, "gemma3.rope.freq_base_swa": 1e4},
    "phi3": {"phi3.rope.dimension_count": 16, "phi3.rope.scaling.original_context_length": 128,
             "phi3.attention.sliding_window": 0},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_gguf_metadata_and_bit_exact_tensors(family, exported):
    student, tokenizer, root, report = exported[family]
    config = student.config
    arch = _family(family).arch
    fields, tensors = _fields(root / "gguf" / GGUF_FILE)
    assert fields["general.architecture"] == arch
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "context_length"):
        assert f"{arch}.{key}" in fields, key
    assert fields[f"{arch}.attention.head_count_kv"] == 2 and fields[f"{arch}.block_count"] == 2
    for key, value in EXPECTED_KEYS[family].items():
        assert key in fields, key
        assert value is None or fields[key] == pytest.approx(value), key
    assert "gemma3.attention.sliding_window_pattern" not in fields  # the default pattern: left to llama.cpp
    # every quantised linear: gguf's dequantiser returns Wq bit for bit, in llama.cpp's row order
    gguf_name, _ = tensor_naming(config)
    layers = {n: m for n, m in student.named_modules() if isinstance(m, FakeQuantLinear)}
    assert report["exact_layers"] == len(layers) == (8 if family == "phi3" else 14)  # phi3: qkv, gate_up fused
    permute = _family(family).permute_qk
    for name, layer in layers.items():
        t = tensors[gguf_name(f"{name}.weight")]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0, name
        deq = gguf.quants.dequantize(t.data, t.tensor_type).reshape(layer.out_features, layer.in_features)
        heads = {"q_proj": 4, "k_proj": 2}.get(name.rsplit(".", 1)[-1]) if permute else None
        deq = _unpermute(deq, heads) if heads else deq
        assert torch.equal(torch.from_numpy(np.ascontiguousarray(deq)), layer.quantized_weight().float()), name
    # full-precision tensors: Gemma's norms as 1 + w, the rest as they are; a tied head is not written
    state = {k: v for k, v in student.state_dict().items() if k.endswith("norm.weight")}
    assert state
    for key, value in state.items():
        stored = np.array(tensors[gguf_name(key)].data)
        shift = 1.0 if family == "gemma3_text" else 0.0
        assert np.array_equal(stored, value.numpy() + np.float32(shift)), key
    assert ("output.weight" in tensors) == (not config.tie_word_embeddings)
    assert ("rope_freqs.weight" in tensors) == (family == "llama3")  # written only for a llama3 rope


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_sentencepiece_vocab_pieces_scores_and_types(family, exported):
    student, tokenizer, root, _ = exported[family]
    fields, _ = _fields(root / "gguf" / GGUF_FILE)
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.pre"] == "default"
    tokens, scores, types = (fields[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    vocab = tokenizer.get_vocab()
    assert len(tokens) == student.config.vocab_size == len(vocab)
    assert tokens == [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    T = gguf.TokenType
    assert all(types[vocab[f"<0x{b:02X}>"]] == T.BYTE for b in range(256))
    assert types[tokenizer.bos_token_id] == types[tokenizer.eos_token_id] == T.CONTROL
    pieces = [i for i, t in enumerate(types) if t == T.NORMAL and len(tokens[i]) > 1]
    # merge results score in merge order (here: id order), so llama.cpp merges what HF's BPE merges first
    assert len(pieces) > 50 and all(scores[a] > scores[b] for a, b in zip(pieces, pieces[1:]))
    assert fields["tokenizer.ggml.add_space_prefix"] == (family != "gemma3_text")  # Gemma prepends no space
    assert fields["tokenizer.ggml.bos_token_id"] == tokenizer.bos_token_id
    assert bool(fields["tokenizer.ggml.add_bos_token"])


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reads_each_family_back_with_the_students_logits(family, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    student, tokenizer, root, _ = exported[family]
    # transformers' GGUF reader takes Gemma 3's query_pre_attn_scalar as 256 (every released size's head_dim);
    # llama.cpp scales by 1/sqrt(head_dim) from the file, so the tiny model's 16 is passed here
    extra = {"query_pre_attn_scalar": 16} if family == "gemma3_text" else {}
    loaded = AutoModelForCausalLM.from_pretrained(str(root / "gguf"), gguf_file=GGUF_FILE, dtype=torch.float32,
                                                  attn_implementation="eager", **extra).eval()
    if family == "llama3":
        # transformers' GGUF reader ignores rope_freqs.weight (the plain rope, ~5 logits off); divide its frequencies
        # by the file's factors as llama.cpp does
        assert loaded.config.rope_parameters["rope_type"] == "default"
        factors = torch.from_numpy(np.array(_fields(root / "gguf" / GGUF_FILE)[1]["rope_freqs.weight"].data))
        loaded.model.rotary_emb.inv_freq = loaded.model.rotary_emb.inv_freq / factors
    ids = torch.randint(5, student.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in {student.get_input_embeddings().weight, student.get_output_embeddings().weight}:
            p.copy_(snap_fp16(p))  # stored F16, as llama.cpp's converter does
        torch.testing.assert_close(loaded(input_ids=ids).logits, student(input_ids=ids).logits, rtol=0, atol=1e-4)
    if TOKENIZERS[family] in ("bpe", "qwen2"):  # transformers rebuilds SentencePiece merges its own way
        assert AutoTokenizer.from_pretrained(str(root / "gguf"), gguf_file=GGUF_FILE)(TEXT)["input_ids"] == \
            tokenizer(TEXT)["input_ids"]


def _adapted(student):
    peft = add_recovery_lora_(student, r=4, alpha=8.0).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, p in peft.named_parameters():
            if "lora_B" in name:  # a trained B is non-zero: the adapter changes every logit
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return peft


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapter_gguf_per_family(family, tokenizers_by_style, tmp_path):
    tokenizer = tokenizers_by_style[TOKENIZERS[family]]
    peft = _adapted(_student(family, tokenizer, tmp_path / "hf"))
    info = save_gguf_lora(peft, tmp_path / "gguf")
    fields, tensors = _fields(tmp_path / "gguf" / ADAPTER_FILE)
    assert fields["general.architecture"] == _family(family).arch and fields["adapter.type"] == "lora"
    gguf_name, permuted = tensor_naming(peft.get_base_model().config)
    wrapped = {n.removeprefix("base_model.model."): m for n, m in peft.named_modules()
               if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    assert info["tensors"] == len(tensors) == 2 * len(wrapped)
    for prefix, module in wrapped.items():
        name, key = gguf_name(f"{prefix}.weight"), f"{prefix}.weight"
        a, b = np.array(tensors[f"{name}.lora_a"].data), np.array(tensors[f"{name}.lora_b"].data)
        applied = permuted(key, module.base_layer.quantized_weight().detach().numpy()) + (8.0 / 4) * b @ a
        expected = module.base_layer.quantized_weight() + module.get_delta_weight("default")
        np.testing.assert_allclose(applied, permuted(key, expected.detach().numpy()), rtol=0, atol=1e-6)


@pytest.mark.parametrize("config,match", [
    (dict(model_type="gpt_neox"), "model_type 'gpt_neox' is not written yet"),
    (dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=32), "query_pre_attn_scalar 32 != head_dim"),
    (dict(model_type="qwen2", rope_parameters={**LLAMA3_ROPE, "rope_theta": 1e6}), "rope_type 'llama3'"),
    (dict(model_type="gemma3_text", head_dim=16, rope_parameters={**LLAMA3_ROPE, "rope_theta": 1e6}),
     "rope_type 'llama3'"),
    (dict(model_type="llama", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}),
     "rope_type 'yarn'"),
    (dict(model_type="llama", rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}),
     "rope_type 'llama3' needs factor, low_freq_factor < high_freq_factor"),
    (dict(model_type="phi3", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_type 'longrope'"),
    (dict(model_type="qwen2", use_sliding_window=True), "sliding-window attention"),
    (dict(model_type="mistral", sliding_window=4096, max_position_embeddings=32768), "sliding_window 4096 < context"),
    (dict(model_type="phi3", sliding_window=2047, max_position_embeddings=4096), "runs phi3 without a window"),
])
def test_settings_llama_cpp_would_compute_differently_are_refused(config, match):
    from types import SimpleNamespace
    with pytest.raises(ValueError, match=match) as err:
        gguf_architecture(SimpleNamespace(num_attention_heads=4, hidden_size=64, **config))
    assert "--format packed, dense or compressed-tensors" in str(err.value) and "\n" not in str(err.value)


def test_llama3_rope_factors_are_what_transformers_divides_its_frequencies_by(exported):
    # llama.cpp runs a llama3 rope as the plain rope with each frequency divided by rope_freqs.weight[i] (and no
    # rope scaling keys, which would scale it again): those factors must be transformers' own, base / llama3 freq
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    student, _, root, _ = exported["llama3"]
    fields, tensors = _fields(root / "gguf" / GGUF_FILE)
    stored = tensors["rope_freqs.weight"]
    assert stored.tensor_type == gguf.GGMLQuantizationType.F32 and stored.n_elements == 16 // 2  # head_dim / 2
    config = student.config
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    assert torch.equal(theirs, student.model.rotary_emb.inv_freq)  # the model's own frequencies
    base = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    expected = (base / theirs.double()).numpy()
    np.testing.assert_allclose(np.array(stored.data, dtype=np.float64), expected, rtol=1e-6, atol=0)
    factors = np.array(stored.data)
    # kept, blended and divided frequencies, so every branch of the formula is covered
    assert factors[0] == 1.0 and 1.0 < factors[1] < 32.0 and factors[-1] == 32.0
    assert not any(k.startswith("llama.rope.scaling") for k in fields)


def test_llama3_rope_of_a_released_llama_32():
    # Llama 3.2 1B's config.json (its head 64 wide, base, scaling), as `qat-lora export` checks it before building
    # the student and as transformers reads it: 32 factors, equal to transformers' to float32 precision
    from types import SimpleNamespace
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from qat_lora.export.gguf.arch import generated_tensors

    raw = dict(model_type="llama", hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               max_position_embeddings=131072, rope_theta=5e5,
               rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 8192})
    assert gguf_architecture(SimpleNamespace(**raw)).arch == "llama"
    config = LlamaConfig(**raw)
    factors = generated_tensors(config)["rope_freqs.weight"]
    np.testing.assert_array_equal(generated_tensors(SimpleNamespace(**raw))["rope_freqs.weight"], factors)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    base = 1.0 / (5e5 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    assert factors.dtype == np.float32 and factors.shape == (32,)
    np.testing.assert_allclose(factors, (base / theirs.double()).numpy(), rtol=1e-6, atol=0)
    assert generated_tensors(LlamaConfig(hidden_size=64, num_attention_heads=4)) == {}  # the plain rope: nothing


def test_gemma3_layer_pattern_and_linear_rope_scaling_keys():
    # A layer mix other than llama.cpp's default (5 local, 1 global) is written per layer; linear rope scaling of the
    # global layers (Gemma 3 4B and up: factor 8) as the converter writes it, the local layers' base beside it.
    from transformers import Gemma3TextConfig
    config = Gemma3TextConfig(num_hidden_layers=3, hidden_size=64, head_dim=16, query_pre_attn_scalar=16,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    writer = gguf.GGUFWriter(None, "gemma3")
    gguf_architecture(config).keys(writer, config)
    values = {k: v.value for shard in writer.kv_data for k, v in shard.items()}
    assert values["gemma3.attention.sliding_window_pattern"] == [True, False, True]
    assert values["gemma3.rope.scaling.type"] == "linear" and values["gemma3.rope.scaling.factor"] == 8.0
    assert values["gemma3.rope.freq_base"] == 1e6 and values["gemma3.rope.freq_base_swa"] == 1e4


@pytest.fixture
def llama_cpp(monkeypatch):
    """llama.cpp's Python binding (benchmarks/build_llama_cpp.sh), loading weights without the AMX / repacked
    buffers: their kernels crash on this file's 32-row matrices (the plain CPU kernels run them)."""
    binding = pytest.importorskip("llama_cpp", reason="llama.cpp's binding: bash benchmarks/build_llama_cpp.sh")
    default = binding.llama_cpp.llama_model_default_params

    def plain_buffers():
        params = default()
        params.use_extra_bufts = False
        return params

    monkeypatch.setattr(binding.llama_cpp, "llama_model_default_params", plain_buffers)
    return binding


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_runs_each_family_with_its_adapter(family, exported, llama_cpp, tmp_path):
    student, tokenizer, root, _ = exported[family]
    peft = _adapted(_student(family, tokenizer, tmp_path / "hf"))
    save_gguf_lora(peft, tmp_path)
    llm = llama_cpp.Llama(model_path=str(root / "gguf" / GGUF_FILE), n_ctx=64, logits_all=True, n_threads=2,
                          verbose=False, lora_path=str(tmp_path / ADAPTER_FILE))
    assert llm.tokenize(TEXT.encode(), add_bos=False) == tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    ids = torch.randint(5, student.config.vocab_size, (16,), generator=torch.Generator().manual_seed(2))
    llm.eval(ids.tolist())
    theirs = torch.from_numpy(np.asarray(llm.scores[:16], dtype=np.float32)).log_softmax(-1)
    with torch.no_grad():
        ours = peft(input_ids=ids[None]).logits[0].float().log_softmax(-1)
    # llama.cpp multiplies by 8-bit activations and F16 embeddings: close, not equal (KL ~1e-3 a position); a wrong
    # row order, norm, window or adapter name moves every position by ~0.1 to 1
    kl = (ours.exp() * (ours - theirs)).sum(-1)
    assert float(kl.mean()) < 0.01 and float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()) >= 0.8, kl
