"""Every model family the toolkit claims, end to end on a tiny random model of that family (issue 28, item 2):
build-cache -> quantize --init gptq -> 2 training steps -> eval -> every export format the family
supports, each loaded back with its own runtime and giving the student's logits.

The tiny configs keep what makes each family different: Qwen2's q/k/v biases, Qwen3's and Gemma 3's q/k norms,
Gemma 3's tied, sqrt(hidden)-scaled embeddings and its sliding/global layer mix (a window shorter than the
sequences), Mistral's sliding window, Phi-3's fused qkv_proj / gate_up_proj linears.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import make_tokenizer, synthetic_text
from qat_lora.commands.cli import main
from qat_lora.train.config import StudentSpec
from qat_lora.data.models import FAMILIES, family_of
from qat_lora.train.student import load_student

QUANT = "w4g32"  # int4 asymmetric, 32 a group: written by every format (GGUF as Q4_1)
SEQ_LEN = 32
WINDOW = 8  # sliding-window layers see 8 positions: shorter than the sequences, so the window matters


def _config(family: str, tokenizer, tied: bool):
    import transformers

    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.2, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tied)
    return {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        # head_dim 128, as every released Qwen3: transformers' GGUF loader ignores qwen3.attention.key_length
        "qwen3": lambda: transformers.Qwen3Config(head_dim=128, **common),
        # Gemma 3 270M's shape where a GGUF cannot say otherwise (llama.cpp and transformers' GGUF loader assume
        # head_dim = query_pre_attn_scalar = 256 and five sliding layers per global one); six layers, so both kinds,
        # one head (GPTQ's time grows with o_proj's 256 inputs per head).
        "gemma3": lambda: transformers.Gemma3TextConfig(
            head_dim=256, query_pre_attn_scalar=256, sliding_window=WINDOW,
            **{**common, "num_hidden_layers": 6, "num_attention_heads": 1, "num_key_value_heads": 1}),
        "mistral": lambda: transformers.MistralConfig(head_dim=16, sliding_window=WINDOW, **common),
        "phi3": lambda: transformers.Phi3Config(**common),
    }[family]()


# Gemma 3 and Qwen2 tie the head to the embeddings (as Gemma 3 and small Qwen2 checkpoints do); the others not.
TIED = {"llama": False, "qwen2": True, "qwen3": False, "gemma3": True, "mistral": False, "phi3": False}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-corpus")
    (root / "a.txt").write_text(synthetic_text(60, seed=5))
    return root


@pytest.fixture(scope="module")
def family_tokenizer(corpus):
    tokenizer = make_tokenizer((corpus / "a.txt").read_text())
    tokenizer.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    return tokenizer


def _model_dir(path, family: str, tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, tokenizer, TIED[family]))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _student_logits(model_dir, quantizer, adapter, ids) -> torch.Tensor:
    student = load_student(StudentSpec(str(model_dir), QUANT, quantizer), adapter, attn_implementation="eager")
    with torch.no_grad():
        return student(input_ids=ids).logits


def _dense_logits(folder, adapter, ids, **kwargs) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_end_to_end(family, corpus, family_tokenizer, tmp_path, capsys):
    from transformers import CompressedTensorsConfig

    from qat_lora.cache.builder import build_cache
    from qat_lora.cache.config import CacheBuildConfig
    from qat_lora.export.exporter import load_packed
    from qat_lora.export.gguf.writer import GGUF_ARCHITECTURES

    model_dir = _model_dir(tmp_path / "model", family, family_tokenizer)
    assert family_of(model_dir) == family
    cache = tmp_path / "cache"
    build_cache(CacheBuildConfig(teacher=str(model_dir), data=[str(corpus)], out=str(cache), seq_len=SEQ_LEN,
                                 encoding="topk", top_k=8, value_bits=32, max_tokens=1_200, batch_size=8, holdout_fraction=0.2,
                                 device="cpu"), log=lambda _: None)
    init = tmp_path / "init"
    assert main(["quantize", "--model", str(model_dir), "--quant", QUANT, "--init", "gptq", "--cache", str(cache),
                 "--calib-sequences", "8", "--out", str(init)]) == 0
    quantizer = str(init / "quantizer.safetensors")
    run = tmp_path / "run"
    assert main(["train", "--model", str(model_dir), "--cache", str(cache), "--quant", QUANT, "--quantizer", quantizer,
                 "--out", str(run), "--max-steps", "2", "--batch-size", "2", "--lr", "1e-2", "--warmup-steps", "0",
                 "--loss-chunk-size", "16", "--device", "cpu"]) == 0
    adapter = str(run / "adapter")
    assert main(["eval", "--model", str(model_dir), "--quant", QUANT, "--quantizer", quantizer, "--adapter", adapter,
                 "--cache", str(cache), "--text", str(corpus), "--seq-len", str(SEQ_LEN), "--max-tokens", "256",
                 "--device", "cpu", "--json-out", str(tmp_path / "eval.json")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert math.isfinite(result["ppl"]) and result["ppl"] > 1, result
    capsys.readouterr()

    ids = torch.randint(0, len(family_tokenizer), (2, 20), generator=torch.Generator().manual_seed(1))
    expected = _student_logits(model_dir, quantizer, adapter, ids)
    flags = ["--model", str(model_dir), "--quant", QUANT, "--quantizer", quantizer, "--adapter", adapter]
    out = tmp_path / "export"
    assert main(["export", *flags, "--format", "both", "--out", str(out)]) == 0
    torch.testing.assert_close(_dense_logits(out / "dense", out / "adapter", ids), expected, rtol=1e-5, atol=1e-5)
    from peft import PeftModel

    packed = PeftModel.from_pretrained(load_packed(out / "packed"), str(out / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(packed(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)

    ct = tmp_path / "ct"
    assert main(["export", *flags, "--format", "compressed-tensors", "--out", str(ct)]) == 0
    ct_logits = _dense_logits(ct / "compressed-tensors", ct / "adapter", ids,
                              quantization_config=CompressedTensorsConfig(run_compressed=False))
    torch.testing.assert_close(ct_logits, expected, rtol=1e-5, atol=1e-5)

    # Generation through the family's KV cache (hybrid sliding/global for Gemma 3; prompt + reply longer than the
    # window), greedy: the same tokens as greedy decoding by full forwards without a cache.
    from qat_lora.commands.config import GenerateConfig
    from qat_lora.commands.generate import generate, load_generator

    cfg = GenerateConfig(model=str(model_dir), quant=QUANT, quantizer=quantizer, adapter=adapter,
                         prompt="the king sees the old city", max_new_tokens=8, device="cpu")
    streamed: list[str] = []
    new = generate(cfg, streamed.append)
    model, tokenizer = load_generator(cfg)
    seq = tokenizer.apply_chat_template([{"role": "user", "content": cfg.prompt}], add_generation_prompt=True,
                                        return_dict=True, return_tensors="pt")["input_ids"]
    assert seq.shape[1] > WINDOW
    with torch.no_grad():
        for _ in range(len(new)):
            seq = torch.cat([seq, model(input_ids=seq).logits[:, -1:].argmax(-1)], 1)
    assert new == seq[0, -len(new):].tolist() and len(new) == 8
    assert "".join(streamed).strip() == tokenizer.decode(new, skip_special_tokens=True).strip()

    # GGUF: written for the families of GGUF_ARCHITECTURES (another module's list, read here), and then only for
    # configs llama.cpp can run; anything else is refused in one line naming the formats that work.
    g = tmp_path / "g"
    code = main(["export", "--model", str(model_dir), "--quant", QUANT, "--quantizer", quantizer, "--format", "gguf",
                 "--out", str(g)])
    if code != 0 or _config(family, family_tokenizer, TIED[family]).model_type not in GGUF_ARCHITECTURES:
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "packed, dense or compressed-tensors" in err[0], (code, err)
        return
    from qat_lora.quant.fake_quant import FakeQuantLinear
    from qat_lora.quant.inits import snap_fp16

    student = load_student(StudentSpec(str(model_dir), QUANT, quantizer), attn_implementation="eager")
    quantised = {id(m.weight) for m in student.modules() if isinstance(m, FakeQuantLinear)}
    with torch.no_grad():
        for p in student.parameters():
            if p.ndim == 2 and id(p) not in quantised:
                p.copy_(snap_fp16(p))  # embeddings (and an untied head) are stored F16, as llama.cpp's converter does
        base = student(input_ids=ids).logits
    loaded = _dense_logits(g / "gguf", None, ids, gguf_file="model.gguf")
    # The Q4_1 offsets d * (z - qmin) are rounded to fp16 (export.json's max_rel_error ~4e-4): rounding only.
    torch.testing.assert_close(loaded, base, rtol=0, atol=5e-2)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_by_layer_equals_the_whole_forward(family, family_tokenizer, tmp_path):
    # What GPTQ and block-wise reconstruction rely on: the captured inputs, run through the layers one at a time,
    # give the model's own hidden states, with each layer's own mask and rotary table (Gemma 3's sliding layers a
    # banded mask and local frequencies, its global layer the causal mask and global ones; the window is shorter
    # than the sequences, so a layer given another's kwargs would differ).
    from qat_lora.quant import blocks
    from qat_lora.data.models import load_causal_lm

    model = load_causal_lm(_model_dir(tmp_path / "m", family, family_tokenizer), attn_implementation="eager")
    batches = [torch.randint(0, len(family_tokenizer), (2, 24), generator=torch.Generator().manual_seed(i))
               for i in range(2)]
    inputs = blocks.capture_block_inputs(model, batches)
    layers = blocks.decoder_layers(model)
    assert len(inputs.layer_kwargs()) == len(layers)
    for layer in layers:
        inputs = inputs.with_hidden(blocks.run_block(layer, inputs))
    with torch.no_grad():
        expected = [model(input_ids=batch, output_hidden_states=True).hidden_states[-1] for batch in batches]
        for hidden, want in zip(inputs.hidden, expected):
            torch.testing.assert_close(model.model.norm(hidden), want, rtol=1e-5, atol=1e-5)
    # Block-wise reconstruction's own path (the teacher's targets t_{i+1} = block_i(t_i)): kwargs per layer and
    # batch size, the sequences regrouped into batches of 2.
    from qat_lora.quant.blockwise import _embed, _run

    hidden, kwargs = _embed(model, torch.cat(batches), 2)
    for index, layer in enumerate(layers):
        hidden = _run(layer, hidden, kwargs[index], 2)
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(hidden), torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_the_chunked_loss_applies_a_final_logit_softcap(family_tokenizer, cache_dir):
    # Gemma 2 caps its logits (c * tanh(logits / c)) after lm_head, inside transformers' forward: the chunked loss,
    # which runs lm_head itself, must give the full logits' loss and gradients (Gemma 3 has no cap; a tiny Gemma 3
    # with one set exercises the same path).
    from transformers import AutoModelForCausalLM

    from qat_lora.cache.reader import KDCache
    from qat_lora.train.loss import KDLossConfig, forward_loss

    config = _config("gemma3", family_tokenizer, tied=True)
    # A cap of 2 binds (the uncapped logits reach ~5); 512 entries cover the cache's token ids.
    config.final_logit_softcapping, config.vocab_size = 2.0, 512
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    batch = next(iter(KDCache(cache_dir).batches("train", 2, shuffle=False)))
    cfg = KDLossConfig(alpha=0.5)
    results = []
    for chunk in (0, 16):
        model.zero_grad()
        out = forward_loss(model, batch, cfg, chunk)
        out["loss"].backward()
        results.append((out, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (plain, plain_grads), (chunked, chunked_grads) = results
    with torch.no_grad():
        assert model(input_ids=batch["input_ids"]).logits.abs().max() < 2.0  # the cap really bounds them
    for key in ("loss", "soft_ce", "kl", "ce"):  # top-1: evaluation's, not a training step's
        torch.testing.assert_close(chunked[key], plain[key], rtol=1e-5, atol=1e-6)
    for a, b in zip(chunked_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_models_that_need_a_bos_get_it_at_the_start_of_every_cached_and_evaluated_sequence(corpus, tmp_path):
    # Gemma (like Llama 3 and Mistral) is trained only on sequences that open with BOS: without it Gemma 3 270M's
    # Wikipedia perplexity is 33.5 instead of 11.4. The cache and the perplexity windows open with it; tokenizers
    # that add no BOS (SmolLM2, Qwen) keep their rows as they were.
    from tokenizers.processors import TemplateProcessing

    from qat_lora.data import text as data
    from qat_lora.cache.reader import KDCache
    from qat_lora.cache.builder import build_cache
    from qat_lora.cache.config import CacheBuildConfig
    from qat_lora.data.models import sequence_prefix

    plain = make_tokenizer((corpus / "a.txt").read_text())
    assert sequence_prefix(plain) == []
    with_bos = make_tokenizer((corpus / "a.txt").read_text())
    with_bos.add_special_tokens({"bos_token": "<bos>"})
    bos = with_bos.bos_token_id
    with_bos._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    assert with_bos("the king").input_ids[0] == bos and sequence_prefix(with_bos) == [bos]

    ids, mask = data.pack(list(range(10, 17)), 4, pad_id=0, prefix=[bos])
    assert ids.tolist() == [[bos, 10, 11, 12], [bos, 13, 14, 15], [bos, 16, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert [r.tolist() for r in data.pack(list(range(10, 17)), 4)[0]] == [[10, 11, 12, 13], [14, 15, 16, 0]]

    model_dir = _model_dir(tmp_path / "m", "gemma3", with_bos)
    build_cache(CacheBuildConfig(teacher=str(model_dir), data=[str(corpus)], out=str(tmp_path / "c"), seq_len=16,
                                 encoding="topk", top_k=4, value_bits=32, max_tokens=300, batch_size=8, holdout_fraction=0.2,
                                 device="cpu"), log=lambda _: None)
    cache = KDCache(tmp_path / "c")
    rows = next(iter(cache.batches("train", 4, shuffle=False)))["input_ids"]
    assert (rows[:, 0] == bos).all() and not (rows[:, 1:] == bos).any()
