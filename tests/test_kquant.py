"""llama.cpp's K-quants (issue 18): q2_k / q3_k / q4_k / q6_k train on the grid gguf's dequantiser reads, export
bit-exactly, fall back per tensor on rows that are not a multiple of 256, and carry a teacher GGUF's metadata."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")  # the `gguf` extra; the dev install has it

from qat_lora.quant import kquant  # noqa: E402
from qat_lora.commands.cli import main  # noqa: E402
from qat_lora.export.gguf.writer import GGUF_FILE, save_gguf  # noqa: E402
from qat_lora.export.gguf.kquant import pack_kquant  # noqa: E402
from qat_lora.data.models import load_causal_lm  # noqa: E402
from qat_lora.quant.fake_quant import FakeQuantLinear, QuantConfig, get_preset, quantize_  # noqa: E402
from qat_lora.quant.config import KQUANT_TYPES  # noqa: E402
from qat_lora.quant.inits import snap_fp16  # noqa: E402

KQUANTS = {"q2_k": "Q2_K", "q3_k": "Q3_K", "q4_k": "Q4_K", "q6_k": "Q6_K"}
PROJ = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
        "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _model_dir(path, tokenizer, hidden: int, intermediate: int):
    """A 2-layer Llama of the given widths (head_dim 64) saved as a transformers folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=2, num_attention_heads=hidden // 64, num_key_value_heads=1,
                         max_position_embeddings=64, initializer_range=0.1, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory, tokenizer):
    """Every row a multiple of 256: all seven linears per block are K-quants."""
    return _model_dir(tmp_path_factory.mktemp("wide"), tokenizer, 256, 512)


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory, tokenizer):
    """As SmolLM2 (hidden 576, intermediate 1536): hidden rows fall back, down_proj's 256 do not."""
    return _model_dir(tmp_path_factory.mktemp("mixed"), tokenizer, 64, 256)


def _layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)}


def _trained(model_dir, preset, **kwargs):
    """A student whose quantiser moved off its init as QAT leaves it: fp32 d between fp16 values, fractional
    sub-block latents (some pushed out of their integer range)."""
    student = quantize_(load_causal_lm(model_dir, **kwargs), preset).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in _layers(student).values():
            for name, p in layer.quant_parameters().items():
                if name != "zero" or layer.cfg.zero_domain != "none":
                    p.add_(torch.randn_like(p) * 0.3 * (p.abs().mean() + 1e-3))
    return student


def _unpermute(x: np.ndarray, n_head: int) -> np.ndarray:
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _assert_file_holds_wq(path, student):
    """gguf's own dequantiser, on every quantised tensor of the file, gives the student's Wq bit for bit."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    config, types = student.config, {}
    for name, layer in _layers(student).items():
        proj = name.rpartition(".")[2]
        tensor = tensors[f"blk.{name.split('.')[2]}.{PROJ[proj]}.weight"]
        deq = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(layer.out_features, layer.in_features)
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(proj)
        deq = _unpermute(deq, heads) if heads else deq
        assert torch.equal(torch.from_numpy(np.ascontiguousarray(deq)), layer.quantized_weight().float()), name
        types[name] = tensor.tensor_type.name
    return types


@pytest.mark.slow
@pytest.mark.parametrize("preset", KQUANTS)
def test_gguf_dequantizer_gives_the_kquant_students_wq_exactly(preset, wide_dir, tokenizer, tmp_path):
    student = _trained(wide_dir, preset)
    report = save_gguf(student, tmp_path, tokenizer)
    qtype = KQUANTS[preset]
    assert report["types"] == {qtype: 14} and report["exact_layers"] == 14
    assert report["bits_per_weight"] == KQUANT_TYPES[get_preset(preset).bits].bits_per_weight
    assert set(_assert_file_holds_wq(tmp_path / GGUF_FILE, student).values()) == {qtype}


@pytest.mark.parametrize("preset,fallback", [("q2_k", "q4_0"), ("q3_k", "q4_0"), ("q4_k", "q4_1"), ("q6_k", "q8_0")])
def test_rows_not_a_multiple_of_256_train_and_export_on_the_fallback_grid(preset, fallback, mixed_dir, tokenizer,
                                                                         tmp_path):
    student = _trained(mixed_dir, preset)
    configs = {n: m.cfg for n, m in _layers(student).items()}
    assert all(c.scheme == "kquant" for n, c in configs.items() if n.endswith("down_proj"))
    assert all(replace(c, include=("*",), exclude=get_preset(fallback).exclude) == get_preset(fallback)
               for n, c in configs.items() if not n.endswith("down_proj"))
    report = save_gguf(student, tmp_path, tokenizer)
    assert report["types"] == {KQUANTS[preset]: 2, fallback.upper(): 12} and report["exact_layers"] == 14
    types = _assert_file_holds_wq(tmp_path / GGUF_FILE, student)
    assert {t for n, t in types.items() if n.endswith("down_proj")} == {KQUANTS[preset]}


@pytest.mark.slow
def test_transformers_loads_every_kquant_gguf_with_the_students_logits(wide_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, len(tokenizer), (2, 10), generator=torch.Generator().manual_seed(0))
    for preset in KQUANTS:
        student = _trained(wide_dir, preset, attn_implementation="eager")
        save_gguf(student, tmp_path / preset, tokenizer)
        loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / preset), gguf_file=GGUF_FILE,
                                                      dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            for p in (student.model.embed_tokens.weight, student.lm_head.weight):
                p.copy_(snap_fp16(p))  # the file stores these two F16: with that rounding, every logit is equal
            assert torch.equal(loaded(input_ids=ids).logits, student(input_ids=ids).logits), preset


def _lsq_reference(w, d, sc, dmin, m, qmax):
    """float64 LSQ gradients of Wq = s * clamp(round((w + m')/s), 0, qmax) - m', s = d * sc, m' = dmin * m, in
    one 256-weight super-block of 8 sub-blocks: inside the range dWq/ds = round(v) - v and dWq/dm' = 0,
    outside dWq/ds = the clamped code and dWq/dm' = -1."""
    s, mm = (d * sc).reshape(8, 1), (dmin * m).reshape(8, 1)
    v = (w.reshape(8, 32) + mm) / s
    q = torch.round(v)
    inside = (q >= 0) & (q <= qmax)
    return torch.where(inside, q - v, q.clamp(0, qmax)), torch.where(inside, 0.0, -1.0).double()


def test_kquant_ste_gradients_reach_the_super_and_sub_block_scales_and_mins():
    cfg = get_preset("q4_k")
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1, 256, generator=g, dtype=torch.float64) * 0.05
    params = kquant.init_parameters(w.float(), cfg)
    leaves = {k: v.double().requires_grad_() for k, v in params.items()}
    leaves["sub_scale"].data += 0.3 * torch.randn(1, 8, generator=g, dtype=torch.float64)  # off-integer latents
    upstream = torch.randn(1, 256, generator=g, dtype=torch.float64)
    (kquant.fake_quantize_kquant(w, cfg, **leaves) * upstream).sum().backward()
    stored = {k: v.detach() for k, v in kquant.stored_parameters(cfg, **leaves).items()}
    d_s, d_m = _lsq_reference(w, stored["d"], stored["sc"], stored["dmin"], stored["m"], 15)
    up = upstream.reshape(8, 32)
    grad_s, grad_m = (d_s * up).sum(-1), (d_m * up).sum(-1)  # dL/ds, dL/dm' per sub-block
    torch.testing.assert_close(leaves["sub_scale"].grad[0], grad_s * stored["d"][0])
    torch.testing.assert_close(leaves["super_scale"].grad[0, 0], (grad_s * stored["sc"][0]).sum())
    torch.testing.assert_close(leaves["sub_min"].grad[0], grad_m * stored["dmin"][0])
    torch.testing.assert_close(leaves["super_min"].grad[0, 0], (grad_m * stored["m"][0]).sum())


@pytest.mark.parametrize("preset", KQUANTS)
def test_llama_cpp_init_beats_round_to_nearest_and_lands_on_the_stored_grid(preset):
    # gguf-py has no K-quant quantiser to compare with: the reference is min/max RTN on the same two levels.
    g = torch.Generator().manual_seed(6)
    w = torch.randn(32, 512, generator=g) * torch.linspace(0.01, 0.1, 512)  # columns of different scales
    cfg, kt = get_preset(preset), KQUANT_TYPES[get_preset(preset).bits]
    w[0, :kt.sub_block] = 0.0  # an all-zero sub-block stays finite and exact
    errors = {}
    for init in ("rtn", "ggml"):
        layer = FakeQuantLinear.from_linear(nn.Linear(512, 32, bias=False), replace(cfg, init=init))
        with torch.no_grad():
            layer.weight.copy_(w)
        layer.init_quantizer_()
        wq = layer.quantized_weight()
        assert torch.isfinite(wq).all() and not wq[0, :kt.sub_block].any()
        errors[init] = (wq - w).square().mean().item()
    for name, p in layer.quant_parameters().items():
        if name.startswith("sub_"):
            lo, hi = kt.scale_range if name == "sub_scale" else (0, kt.min_max)
            assert torch.equal(p, torch.round(p)) and p.min() >= lo and p.max() <= hi, name
        else:
            assert torch.equal(p, snap_fp16(p)), name
    assert errors["ggml"] < 0.99 * errors["rtn"], errors  # measured 0.83 / 0.97 / 0.84 / 0.89 (docs/DESIGN.md §4)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q6_K"])
def test_pack_kquant_covers_every_field_value(qtype):
    # Random integers over each field's whole range, packed, read back by gguf: w = d * sc * q - dmin * m.
    kt = next(k for k in KQUANT_TYPES.values() if k.ggml_type == qtype)
    cfg = next(get_preset(p) for p, t in KQUANTS.items() if t == qtype)
    rng = np.random.default_rng(7)
    rows, cols = 3, 512
    q = rng.integers(cfg.qmin, cfg.qmax + 1, (rows, cols))
    sc = rng.integers(kt.scale_range[0], kt.scale_range[1] + 1, (rows, cols // kt.sub_block))
    m = rng.integers(0, kt.min_max + 1, sc.shape) if kt.min_max else None
    d = rng.standard_normal((rows, cols // 256)).astype(np.float16).astype(np.float32)
    dmin = np.abs(d[::-1].copy()) if kt.min_max else None
    deq = gguf.quants.dequantize(pack_kquant(qtype, q, d, sc, dmin, m), getattr(gguf.GGMLQuantizationType, qtype))
    s = np.repeat(d, 256 // kt.sub_block, 1) * sc
    expected = s.reshape(rows, -1, 1) * q.reshape(rows, s.shape[1], -1)
    if kt.min_max:
        expected = expected - (np.repeat(dmin, 256 // kt.sub_block, 1) * m).reshape(rows, -1, 1)
    np.testing.assert_array_equal(deq, expected.reshape(rows, cols).astype(np.float32))


def test_a_teacher_ggufs_metadata_carry_over_and_the_quantisation_keys_are_ours(wide_dir, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    # The teacher GGUF: written by this exporter with a chat template and a name the student's tokenizer lacks.
    teacher_tok = AutoTokenizer.from_pretrained(str(wide_dir))
    teacher_tok.chat_template = "{% for m in messages %}<|endoftext|>{{ m['content'] }}{% endfor %}"
    save_gguf(quantize_(load_causal_lm(wide_dir), "q8_0"), tmp_path / "teacher", teacher_tok, name="Teacher-7")
    teacher_file = tmp_path / "teacher" / "teacher.gguf"
    (tmp_path / "teacher" / GGUF_FILE).rename(teacher_file)
    student = quantize_(load_causal_lm(teacher_file), "q4_k")
    save_gguf(student, tmp_path / "student", tokenizer, name="ignored", teacher_gguf=teacher_file)
    fields = {k: f for k, f in gguf.GGUFReader(str(teacher_file)).fields.items() if not k.startswith("GGUF.")}
    out = {k: f for k, f in gguf.GGUFReader(str(tmp_path / "student" / GGUF_FILE)).fields.items()
           if not k.startswith("GGUF.")}
    assert out.keys() == fields.keys()
    for key in fields:
        if key != "general.file_type":
            assert out[key].contents() == fields[key].contents(), key
    assert out["general.name"].contents() == "Teacher-7" and "tokenizer.chat_template" in out
    assert out["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_S
    assert fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    _assert_file_holds_wq(tmp_path / "student" / GGUF_FILE, student)


def test_a_teacher_gguf_of_another_model_is_refused(wide_dir, mixed_dir, tokenizer, tmp_path):
    save_gguf(quantize_(load_causal_lm(wide_dir), "q8_0"), tmp_path / "teacher", tokenizer)
    other = quantize_(load_causal_lm(mixed_dir), "q4_k")
    other.config.num_hidden_layers = 3  # a model the teacher's metadata do not describe
    with pytest.raises(ValueError, match="not the llama model of 3 blocks"):
        save_gguf(other, tmp_path / "x", tokenizer, teacher_gguf=tmp_path / "teacher" / GGUF_FILE)
    assert not (tmp_path / "x" / GGUF_FILE).exists()


@pytest.mark.parametrize("kwargs,match", [
    (dict(scheme="kquant", bits=4, group_size=64), "llama.cpp's Q4_K: it needs group_size=32"),
    (dict(scheme="kquant", bits=8, group_size=32), "scheme kquant: 2, 3, 4 or 6"),
    (dict(scheme="kquant", bits=3, group_size=16), "symmetric=True"),
    (dict(scheme="kquant", bits=6, group_size=16, symmetric=True, init="mse"), "init rtn or ggml"),
    (dict(bits=6), "use 2, 3, 4 or 8"),
])
def test_kquant_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


def test_presets_command_lists_the_kquants_with_their_bits_per_weight(capsys):
    assert main(["presets"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    for preset, bpw in (("q2_k", "2.625"), ("q3_k", "3.4375"), ("q4_k", "4.5"), ("q6_k", "6.5625")):
        assert f"llama.cpp {KQUANTS[preset]}" in lines[preset] and f"{bpw} bits/weight" in lines[preset]


@pytest.mark.parametrize("preset", KQUANTS)
def test_gptq_chooses_codes_on_the_fixed_kquant_grid_and_beats_its_rounding(preset):
    from qat_lora.quant.gptq_solve import gptq_quantize

    g = torch.Generator().manual_seed(8)
    w = torch.randn(16, 256, generator=g) * 0.05
    x = torch.randn(512, 256, generator=g) @ (torch.randn(256, 256, generator=g) / 256**0.5)
    layer = FakeQuantLinear.from_linear(nn.Linear(256, 16, bias=False), get_preset(preset))
    with torch.no_grad():
        layer.weight.copy_(w)
    layer.init_quantizer_()
    rounded = layer.quantized_weight().detach().clone()
    result = gptq_quantize(w, 2.0 * x.T @ x / 512, layer.cfg, layer.group_size, params=layer.quant_parameters())
    with torch.no_grad():
        layer.weight.copy_(result["weight"])
    assert torch.equal(layer.quantized_weight(), result["weight"])  # on the grid: training and export continue
    assert (x @ (result["weight"] - w).T).norm() < 0.9 * (x @ (rounded - w).T).norm()


def test_kquant_students_survive_the_packed_export(mixed_dir, tmp_path):
    from qat_lora.export.exporter import load_packed, save_packed

    student = _trained(mixed_dir, "q4_k")
    save_packed(student, tmp_path, get_preset("q4_k"))
    for name, layer in _layers(load_packed(tmp_path)).items():
        assert layer.cfg == student.get_submodule(name).cfg, name  # the fallback grid per tensor included
        assert torch.equal(layer.quantized_weight(), student.get_submodule(name).quantized_weight()), name


def test_blockwise_reconstruction_refuses_kquants_in_one_line(wide_dir):
    from qat_lora.quant.blockwise import reconstruct_blocks_

    student = quantize_(load_causal_lm(wide_dir), "q4_k")
    with pytest.raises(ValueError, match="q2_k, q3_k, q4_k, q6_k.*--blockwise-steps 0"):
        reconstruct_blocks_(student, load_causal_lm(wide_dir), [torch.zeros(1, 4, dtype=torch.long)], steps=1,
                            lr_weights=1e-4, lr_quant=1e-4, batch_size=1, log=lambda _: None)


@pytest.mark.slow
def test_qat_then_cli_export_from_a_gguf_teacher_is_exact(wide_dir, corpus_dir, tokenizer, tmp_path):
    # The path a user takes: teacher .gguf -> KD cache -> QAT of the q4_k quantiser -> `qat-lora export --format gguf`.
    import json

    from qat_lora.cache.builder import build_cache
    from qat_lora.train.config import TrainConfig
    from qat_lora.cache.config import CacheBuildConfig
    from qat_lora.train.trainer import train

    teacher_tok = type(tokenizer).from_pretrained(str(wide_dir))
    teacher_tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    save_gguf(quantize_(load_causal_lm(wide_dir), "q8_0"), tmp_path / "t", teacher_tok, name="Teacher-Q8")
    teacher = tmp_path / "t" / GGUF_FILE
    build_cache(CacheBuildConfig(teacher=str(teacher), data=[str(corpus_dir)], out=str(tmp_path / "cache"), seq_len=32,
                                 encoding="topk", top_k=8, value_bits=32, max_tokens=2_000, batch_size=8, device="cpu"),
                log=lambda _: None)
    train(TrainConfig(model=str(teacher), cache=str(tmp_path / "cache"), quant="q4_k", preset="qat",
                      out=str(tmp_path / "run"), max_steps=3, batch_size=2, warmup_steps=1, lr=1e-2),
          log=lambda _: None)
    quantizer = tmp_path / "run" / "quantizer.safetensors"
    out = tmp_path / "export"
    assert main(["export", "--model", str(teacher), "--quant", "q4_k", "--quantizer", str(quantizer), "--format",
                 "gguf", "--out", str(out)]) == 0
    report = json.loads((out / "export.json").read_text())["gguf"]
    assert report["types"] == {"Q4_K": 14} and report["exact_layers"] == 14 and report["file_type"] == "MOSTLY_Q4_K_S"
    fields = gguf.GGUFReader(str(out / "gguf" / GGUF_FILE)).fields
    assert fields["general.name"].contents() == "Teacher-Q8" and "tokenizer.chat_template" in fields
    from qat_lora.train.config import StudentSpec
    from qat_lora.train.student import load_student

    student = load_student(StudentSpec(str(teacher), "q4_k", str(quantizer)))
    init = quantize_(load_causal_lm(teacher), "q4_k")
    assert any(not torch.equal(m.quantized_weight(), init.get_submodule(n).quantized_weight())
               for n, m in _layers(student).items())  # QAT moved the grid, and the file holds the moved one
    _assert_file_holds_wq(out / "gguf" / GGUF_FILE, student)


@pytest.mark.slow
def test_gptq_over_a_kquant_student_lowers_every_layers_error_and_exports_exactly(wide_dir, tokenizer, tmp_path):
    from qat_lora.quant.gptq import gptq_

    student = quantize_(load_causal_lm(wide_dir), "q3_k")
    batches = [torch.randint(0, len(tokenizer), (4, 64), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    report = gptq_(student, batches, log=lambda _: None)
    assert all(v["gptq_err"] < v["init_err"] for v in report["layers"].values()), report["layers"]
    assert save_gguf(student, tmp_path, tokenizer)["exact_layers"] == 14
    _assert_file_holds_wq(tmp_path / GGUF_FILE, student)
