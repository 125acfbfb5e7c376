"""GGUF export and llama.cpp's grids (issue 18): q8_0 / q4_0 / q4_1 presets, bit-exact blocks, transformers
loads the file, CLI refusals, the float zero domain and llama.cpp's own init."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")  # the `gguf` extra; the dev install has it

from qat_lora.commands.cli import main  # noqa: E402
from qat_lora.export.exporter import load_packed, save_packed  # noqa: E402
from qat_lora.export.gguf.writer import GGUF_FILE, pack_blocks, save_gguf  # noqa: E402
from qat_lora.data.models import load_causal_lm  # noqa: E402
from qat_lora.quant.fake_quant import FakeQuantLinear, QuantConfig, get_preset, quantize_  # noqa: E402
from qat_lora.quant.quantizer import quantizer_for  # noqa: E402
from qat_lora.quant.inits import snap_fp16  # noqa: E402

GGML_PRESETS = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


def _layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)}


def _trained_student(teacher_dir, preset, **kwargs):
    """A student whose quantiser moved off its init, as QAT leaves it (fp32 values between fp16 ones,
    fractional offsets): the export must store what the forward uses, not the raw parameters."""
    student = quantize_(load_causal_lm(teacher_dir, **kwargs), preset).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in _layers(student).values():
            for name, p in layer.quant_parameters().items():
                if name == "zero" and layer.cfg.zero_domain == "none":
                    continue  # no zero point: it stays 0 by construction
                p.add_(torch.randn_like(p) * 0.05 * p.abs().mean())
    return student


def _unpermute(x: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (as transformers' GGUF loader undoes it)."""
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


@pytest.mark.parametrize("preset", GGML_PRESETS)
def test_gguf_dequantizer_gives_the_students_wq_exactly(preset, teacher_dir, tokenizer, tmp_path):
    student = _trained_student(teacher_dir, preset)
    report = save_gguf(student, tmp_path, tokenizer)
    assert report["types"] == {GGML_PRESETS[preset]: 14} and report["exact_layers"] == 14
    reader = gguf.GGUFReader(str(tmp_path / GGUF_FILE))
    tensors = {t.name: t for t in reader.tensors}
    config = student.config
    for name, layer in _layers(student).items():
        block, _, proj = name.rpartition(".")
        key = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[proj]
        tensor = tensors[f"blk.{name.split('.')[2]}.{key}.weight"]
        assert tensor.tensor_type == getattr(gguf.GGMLQuantizationType, GGML_PRESETS[preset]), name
        deq = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(layer.out_features, layer.in_features)
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(proj)
        deq = _unpermute(deq, heads) if heads else deq
        assert torch.equal(torch.from_numpy(np.ascontiguousarray(deq)).float(), layer.quantized_weight().float()), name
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    fields = reader.fields
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "llama"
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "gpt2"
    assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == "gpt-2"
    assert int(fields["llama.attention.head_count_kv"].parts[-1][0]) == config.num_key_value_heads
    assert not bool(fields["tokenizer.ggml.add_bos_token"].parts[-1][0])  # as the HF tokenizer: no BOS added
    assert len(fields["tokenizer.ggml.tokens"].data) == config.vocab_size


def test_transformers_loads_the_gguf_with_the_students_logits(teacher_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    student = _trained_student(teacher_dir, "q4_1", attn_implementation="eager")
    save_gguf(student, tmp_path, tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=GGUF_FILE, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    ids = torch.randint(0, student.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, full = loaded(input_ids=ids).logits, student(input_ids=ids).logits
        torch.testing.assert_close(got, full, atol=0.05, rtol=0.01)  # embeddings and head are stored F16
        for p in (student.model.embed_tokens.weight, student.lm_head.weight):
            p.copy_(snap_fp16(p))  # with those rounded as the file stores them, every logit is the same
        assert torch.equal(got, student(input_ids=ids).logits)
    text = "The king 123 sees <|endoftext|> a   river.\n\nNew  4567"
    assert AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=GGUF_FILE)(text)["input_ids"] == \
        tokenizer(text)["input_ids"]


@pytest.mark.parametrize("preset,qtype,max_error", [("w4g32", "Q4_1", 1e-3), ("w3g64", "Q8_0", 0.02),
                                                    ("lut2g32", "Q8_0", 0.02)])
def test_other_presets_are_requantised_and_the_error_reported(preset, qtype, max_error, teacher_dir, tokenizer,
                                                             tmp_path):
    report = save_gguf(_trained_student(teacher_dir, preset), tmp_path, tokenizer)
    assert report["types"] == {qtype: 14} and report["exact_layers"] == 0
    errors = [v["rel_error"] for v in report["layers"].values()]
    assert all(0 < e < max_error for e in errors), errors


def test_cli_writes_the_gguf_and_reports_every_layer(teacher_dir, tmp_path):
    out = tmp_path / "x"
    assert main(["export", "--model", str(teacher_dir), "--quant", "q4_0", "--format", "gguf", "--out", str(out)]) == 0
    report = json.loads((out / "export.json").read_text())["gguf"]
    assert report["exact_layers"] == 14 and report["file_type"] == "MOSTLY_Q4_0" and report["bits_per_weight"] == 4.5
    assert all(v["rel_error"] == 0.0 for v in report["layers"].values())
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "gguf"]
    assert sorted(p.name for p in (out / "gguf").iterdir()) == [GGUF_FILE]  # no temporary left


@pytest.fixture(scope="module")
def qwen_tokenizer(corpus_dir):
    from conftest import make_tokenizer
    return make_tokenizer((corpus_dir / "a.txt").read_text(), split="qwen2")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_family_gguf_follows_llama_cpps_converter(arch, qwen_tokenizer, tmp_path):
    # Qwen2 / Qwen3 as convert_hf_to_gguf writes them: `<arch>.*` keys, the "qwen2" pre-tokenizer, q/k rows NOT
    # permuted (NEOX rope), q/k/v biases (Qwen2) and q/k norms (Qwen3) under llama.cpp's names; transformers loads
    # the file with the student's logits and tokenizes as the original.
    from conftest import make_model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # head_dim 128 (4 heads over a width of 64): transformers' GGUF loader ignores qwen3.attention.key_length and
    # takes Qwen3Config's default of 128, as every released Qwen3 has; llama.cpp reads the key.
    model_dir = make_model_dir(tmp_path / "m", qwen_tokenizer, arch, seed=3, init_std=0.25, head_dim=128)
    student = _trained_student(model_dir, "q4_0", attn_implementation="eager")
    report = save_gguf(student, tmp_path / "g", qwen_tokenizer)
    assert report["exact_layers"] == 14
    reader = gguf.GGUFReader(str(tmp_path / "g" / GGUF_FILE))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.architecture"] == arch and fields["tokenizer.ggml.pre"] == "qwen2"
    assert fields[f"{arch}.block_count"] == 2 and fields[f"{arch}.attention.head_count_kv"] == 2
    assert not any(k.startswith("llama.") for k in fields)
    assert fields.get(f"{arch}.attention.key_length") == (128 if arch == "qwen3" else None)  # Qwen3 states it
    tensors = {t.name: t for t in reader.tensors}
    q = student.model.layers[0].self_attn.q_proj
    t = tensors["blk.0.attn_q.weight"]
    deq = gguf.quants.dequantize(t.data, t.tensor_type).reshape(q.out_features, q.in_features)
    assert torch.equal(torch.from_numpy(np.ascontiguousarray(deq)), q.quantized_weight().float())  # rows as-is
    attn = student.model.layers[1].self_attn
    extra = ("blk.1.attn_k.bias", attn.k_proj.bias) if arch == "qwen2" else ("blk.1.attn_k_norm.weight",
                                                                              attn.k_norm.weight)
    assert tensors[extra[0]].tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(np.array(tensors[extra[0]].data), extra[1].detach().numpy())

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "g"), gguf_file=GGUF_FILE, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    assert loaded.config.model_type == arch
    ids = torch.randint(0, student.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in (student.model.embed_tokens.weight, student.lm_head.weight):
            p.copy_(snap_fp16(p))  # stored F16, as llama.cpp's converter does
        torch.testing.assert_close(loaded(input_ids=ids).logits, student(input_ids=ids).logits, rtol=0, atol=1e-5)
    text = "The king 123 sees <|endoftext|> a   river.\n\nNew  4567"
    assert AutoTokenizer.from_pretrained(str(tmp_path / "g"), gguf_file=GGUF_FILE)(text)["input_ids"] == \
        qwen_tokenizer(text)["input_ids"]


def _model_dir(path, tokenizer, model):
    """A tiny GPT-NeoX (a family with no llama.cpp layout here) or a Phi-3 with long-context rope scaling."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, Phi3Config
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id)
    config = GPTNeoXConfig(**common) if model == "gpt_neox" else Phi3Config(
        num_key_value_heads=2, original_max_position_embeddings=128, **common,
        rope_scaling={"rope_type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8})
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("model,match", [
    ("gpt_neox", "model_type 'gpt_neox' is not written yet (only llama, mistral, qwen2, qwen3, gemma3_text, phi3); "
                 "use --format packed, dense or compressed-tensors"),
    ("phi3", "rope_type 'longrope' (rope scaling) is not written for phi3"),
])
def test_cli_refuses_bad_gguf_combinations_in_one_line(model, match, tokenizer, tmp_path, capsys):
    model_dir = _model_dir(tmp_path / model, tokenizer, model)
    capsys.readouterr()  # save_pretrained's progress bar
    code = main(["export", "--model", str(model_dir), "--quant", "q8_0", "--format", "gguf",
                 "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and match in err, err
    assert not (tmp_path / "x").exists()  # refused before anything was written


@pytest.mark.parametrize("preset", GGML_PRESETS)
def test_ggml_init_is_llama_cpps_reference_quantiser(preset):
    # gguf's Python quantisers are bit-exact ports of ggml-quants.c: same fp16 d (and m), and on that grid our
    # round-to-nearest is never further from the weight than llama.cpp's (which rounds with fp32 d, m).
    weight = torch.randn(8, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    layer = FakeQuantLinear.from_linear(nn.Linear(128, 8, bias=False), get_preset(preset))
    with torch.no_grad():
        layer.weight.copy_(weight)
    layer.init_quantizer_()
    qtype = getattr(gguf.GGMLQuantizationType, GGML_PRESETS[preset])
    reference = gguf.quants.quantize(weight.numpy(), qtype).reshape(8, 4, -1)  # [rows, blocks, bytes]
    d = reference[..., :2].copy().view(np.float16).squeeze(-1).astype(np.float32)
    assert np.array_equal(layer.scale.detach().numpy(), d)
    if preset == "q4_1":
        m = reference[..., 2:4].copy().view(np.float16).squeeze(-1).astype(np.float32)
        assert np.array_equal(layer.zero.detach().numpy(), m)
    ours = (layer.quantized_weight() - weight).abs()
    theirs = (torch.from_numpy(gguf.quants.dequantize(reference.reshape(8, -1), qtype)) - weight).abs()
    assert bool((ours <= theirs + 1e-9).all())


def test_pack_blocks_matches_ggufs_own_quantiser_layout():
    # Blocks gguf's quantiser wrote, unpacked with its dequantiser, then packed again by ours: the same bytes.
    w = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    for name in GGML_PRESETS.values():
        qtype = getattr(gguf.GGMLQuantizationType, name)
        ref = gguf.quants.quantize(w, qtype)
        blocks = ref.reshape(4, 2, -1)
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32) if name == "Q4_1" else None
        deq = gguf.quants.dequantize(ref, qtype).reshape(4, 2, 32)
        codes = np.rint((deq - (m if m is not None else 0)) / d) + (8 if name == "Q4_0" else 0)
        assert np.array_equal(pack_blocks(codes.reshape(4, 64).astype(np.int16), d, name, m), ref), name


def test_float_zero_domain_gradients_and_none_zero_stays_zero():
    # Wq = s * clamp(round((w - m)/s)) + m: inside the range d/dm = 0 (the rounding passes straight through),
    # outside 1; d/ds = round(v) - v inside, the clamped code outside.
    torch.manual_seed(3)
    w = torch.randn(4, 16, dtype=torch.float64)
    scale = snap_fp16(w.abs().reshape(4, 2, 8).amax(-1) / 5).requires_grad_()  # fp16: the grid's own precision
    offset = torch.full((4, 2), -0.3, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(4, 16, dtype=torch.float64)
    grid = quantizer_for(QuantConfig(bits=3, group_size=8, zero_domain="float"))
    (grid.fake_quantize(w, {"scale": scale, "zero": offset}) * upstream).sum().backward()
    s, m = scale.detach().unsqueeze(-1), snap_fp16(offset.detach()).unsqueeze(-1)
    v = (w.reshape(4, 2, 8) - m) / s
    inside = ((torch.round(v) >= 0) & (torch.round(v) <= 7)).double()
    d_scale = torch.where(inside.bool(), torch.round(v) - v, torch.round(v).clamp(0, 7))
    up = upstream.reshape(4, 2, 8)
    torch.testing.assert_close(scale.grad, (d_scale * up).sum(-1))
    torch.testing.assert_close(offset.grad, ((1 - inside) * up).sum(-1))
    layer = FakeQuantLinear.from_linear(nn.Linear(64, 4), get_preset("q4_0"))
    start = layer.scale.detach().clone()
    layer.scale.requires_grad_(True), layer.zero.requires_grad_(True)
    opt = torch.optim.AdamW([layer.scale, layer.zero], lr=0.1, weight_decay=0.1)
    for _ in range(3):
        layer(torch.randn(2, 64)).pow(2).sum().backward()
        assert layer.zero.grad is not None and not layer.zero.grad.any()  # defined (reducers see it), exactly 0
        opt.step(), opt.zero_grad()
    assert not layer.zero.any() and not torch.equal(layer.scale.detach(), start)  # the scales did train


@pytest.mark.parametrize("preset", ["q4_1", "w3g64f"])
def test_float_offsets_survive_the_packed_export(preset, teacher_dir, tmp_path):
    student = _trained_student(teacher_dir, preset)
    save_packed(student, tmp_path, get_preset(preset))
    for name, layer in _layers(load_packed(tmp_path)).items():
        assert torch.equal(layer.quantized_weight(), student.get_submodule(name).quantized_weight()), name


@pytest.mark.parametrize("kwargs,match", [
    (dict(zero_domain="none"), "'none' needs scheme='int' and symmetric=True"),
    (dict(zero_domain="float", symmetric=True), "'float' scheme='int' and symmetric=False"),
    (dict(zero_domain="float", scheme="lut"), "zero_domain='float'"),
    (dict(init="ggml"), "ggml needs zero_domain float or none"),
    (dict(zero_domain="half"), "zero_domain='half'"),
])
def test_zero_domain_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


@pytest.mark.parametrize("preset", GGML_PRESETS)
def test_gptq_lands_on_the_llama_cpp_grid_and_beats_its_rtn(preset):
    from qat_lora.quant.gptq_solve import gptq_quantize

    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 128, generator=g) * 0.05
    x = torch.randn(256, 128, generator=g) @ (torch.randn(128, 128, generator=g) / 128**0.5)
    cfg = get_preset(preset)
    result = gptq_quantize(w, 2.0 * x.T @ x / 256, cfg, 32)
    layer = FakeQuantLinear.from_linear(nn.Linear(128, 16, bias=False), cfg)
    with torch.no_grad():
        layer.weight.copy_(result["weight"])
        layer.scale.copy_(result["scale"]), layer.zero.copy_(result["zero"])
    assert torch.equal(layer.quantized_weight(), result["weight"])  # a fake-quant state: training continues from it
    rtn = FakeQuantLinear.from_linear(nn.Linear(128, 16, bias=False), cfg)
    with torch.no_grad():
        rtn.weight.copy_(w)
    rtn.init_quantizer_()
    assert (x @ (result["weight"] - w).T).norm() < (x @ (rtn.quantized_weight() - w).T).norm()
