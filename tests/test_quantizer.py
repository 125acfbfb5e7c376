"""The quantiser objects (quant/quantizer/): one grid per scheme, asked by every module instead of a branch on
the scheme's name; their pieces (forward, codes, decoding, GPTQ's column rounding, storage cost) agree."""
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from qat_lora.export.gguf.writer import BLOCK_BITS, EXACT_PRESETS
from qat_lora.quant.config import PRESETS, QuantConfig
from qat_lora.quant.fake_quant import FakeQuantLinear
from qat_lora.quant.quantizer import (IntQuantizer, KQuantizer, LutQuantizer, OffsetQuantizer, quantizer_for)

PACKAGE = Path(__file__).resolve().parents[1] / "qat_lora"


def _layer(cfg: QuantConfig, in_features: int = 512, out_features: int = 24, seed: int = 0) -> FakeQuantLinear:
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return FakeQuantLinear.from_linear(linear, cfg)


def test_no_module_branches_on_the_scheme_name_outside_the_quantizer():
    branch = re.compile(r"""scheme\s*(==|!=|\bin\b|\bnot in\b)|(==|!=)\s*["'](lut|kquant)["']""")
    offenders = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
                 for path in PACKAGE.rglob("*.py") if path.parent.name != "quantizer"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line)]
    assert offenders == []


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_gets_its_grid(name):
    cfg = PRESETS[name]
    expected = {"int": IntQuantizer, "lut": LutQuantizer, "kquant": KQuantizer}[cfg.scheme]
    expected = OffsetQuantizer if cfg.zero_domain == "float" else expected
    assert type(quantizer_for(cfg)) is expected and type(_layer(cfg).quantizer) is expected


@pytest.mark.parametrize("name", PRESETS)
def test_codes_decode_to_the_forward_and_gptq_rounds_columns_as_the_forward(name):
    layer = _layer(PRESETS[name])
    q, params = layer.quantizer, {k: p.detach() for k, p in layer.quant_parameters().items()}
    wq = layer.quantized_weight().detach()
    assert torch.equal(q.dequantize(q.codes(layer.weight.detach(), params), params), wq)
    # GPTQ's column rounding, given the layer's own grid, is the forward's rounding column by column
    grid = q.column_grid(params, layer.out_features, layer.in_features, torch.device("cpu"))
    for key, value in grid.parameters().items():
        value.copy_(q.stored_parameters(params)[key].expand_as(value))
    cols = torch.stack([grid.quantize(layer.weight.detach()[:, j], j // layer.group_size)
                        for j in range(layer.in_features)], 1)
    assert torch.equal(cols, wq)


@pytest.mark.parametrize("name", EXACT_PRESETS)
def test_storage_bits_are_what_the_llama_cpp_type_stores(name):
    cfg = PRESETS[name]
    q = quantizer_for(cfg.for_width(512), cfg.group_size)
    stored = BLOCK_BITS.get(q.gguf_type) or cfg.kquant.bits_per_weight
    assert q.gguf_exact and q.storage_bits(24, 512) / (24 * 512) == stored


def test_storage_bits_count_codes_integer_zeros_and_fp16_tensors():
    # an fp16 scale and a 4-bit zero (one code of the grid) per group; an fp16 offset; Q4_0 stores no zero
    assert quantizer_for(PRESETS["w4g64"]).storage_bits(8, 128) == 8 * 128 * 4 + (16 + 4) * (8 * 2)
    assert quantizer_for(PRESETS["w4g64f"]).storage_bits(8, 128) == 8 * 128 * 4 + (16 + 16) * (8 * 2)
    assert quantizer_for(PRESETS["q4_0"], 32).storage_bits(8, 128) == 8 * 128 * 4 + 16 * (8 * 4)
    lut = quantizer_for(PRESETS["lut3g64"])
    assert lut.storage_bits(8, 128) == 8 * 128 * 3 + 16 * (8 * 2 + 8)  # scales + one 8-entry codebook
    low_rank = quantizer_for(QuantConfig(bits=3, group_size=64, scale_rank=2))
    assert low_rank.storage_bits(8, 128) == 8 * 128 * 3 + 16 * (8 * 2 + 2 * 8 + 2 * 128) + 3 * 8 * 2  # 3-bit zeros


def test_grid_names_and_export_capabilities():
    assert quantizer_for(PRESETS["w3g64"]).name == "int3-g64"
    assert quantizer_for(QuantConfig(bits=3, scheme="lut", codebook="group", init="mse")).name == "lut3-g64-group"
    assert quantizer_for(PRESETS["q4_0"]).gguf_type == "Q4_0" and quantizer_for(PRESETS["w4g32"]).gguf_type == "Q4_1"
    assert not quantizer_for(PRESETS["w4g32"]).gguf_exact  # Q4_1 from its codes: the offset d * (z - qmin) rounds
    assert quantizer_for(PRESETS["w3g64"]).gguf_type is None
    assert quantizer_for(PRESETS["w4g64"]).compressed_tensors_reason() is None
    assert "offset" in quantizer_for(PRESETS["q4_1"]).compressed_tensors_reason()
    assert "codebook" in quantizer_for(PRESETS["lut3g64"]).compressed_tensors_reason()
    assert not quantizer_for(PRESETS["q4_k"]).clip_search and quantizer_for(PRESETS["w3g64"]).clip_search
    assert not quantizer_for(PRESETS["q4_1"]).clip_search  # llama.cpp's own min/max init stays
    assert all(quantizer_for(PRESETS[n]).reconstructable for n in ("w3g64", "w2g32", "lut3g64"))
    assert not any(quantizer_for(PRESETS[n]).reconstructable for n in ("q4_0", "q8_0", "q4_1", "q2_k", "q4_k"))


@pytest.mark.parametrize("name", ["lut3g64", "q4_k"])
def test_gptq_on_a_fixed_grid_needs_the_layers_parameters(name):
    from qat_lora.quant.gptq_solve import gptq_quantize

    with pytest.raises(ValueError, match="params=layer.quant_parameters"):
        gptq_quantize(torch.randn(8, 256), torch.eye(256), PRESETS[name], PRESETS[name].group_size)


def test_float_offsets_start_on_the_integer_grid_and_move_continuously():
    # w3g64f: the integer grid's clipping search, its zero stored as the fp16 offset m = s * (qmin - z)
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    searched = {}
    for zero_domain in ("int", "float"):
        linear = nn.Linear(256, 32, bias=False)
        linear.weight.data.copy_(w)
        searched[zero_domain] = FakeQuantLinear.from_linear(linear, QuantConfig(bits=3, zero_domain=zero_domain,
                                                                                init="mse"))
    int_layer, float_layer = searched["int"], searched["float"]
    assert type(float_layer.quantizer) is OffsetQuantizer
    assert torch.equal(int_layer.scale, float_layer.scale)
    assert (int_layer.codes() == float_layer.codes()).float().mean() > 0.99  # only fp16(m) near a rounding tie
    err = {k: (m.quantized_weight() - w).norm() / w.norm() for k, m in searched.items()}
    assert err["float"] <= err["int"] * 1.01
    # a nudge of a tenth of a step: the rounded integer zero ignores it, the offset follows it
    for layer, nudge in ((int_layer, 0.1), (float_layer, 0.1 * float_layer.scale)):
        before = layer.quantized_weight().clone()
        with torch.no_grad():
            layer.zero.add_(-nudge if layer is float_layer else 0.1)
        moved = (layer.quantized_weight() - before).abs().max()
        assert (moved > 0) == (layer is float_layer)


def test_gptq_on_float_offsets_lands_on_the_grid_as_well_as_on_integer_zeros():
    from qat_lora.quant.gptq_solve import gptq_quantize

    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 256, generator=g) * 0.05
    x = torch.randn(512, 256, generator=g) @ (torch.randn(256, 256, generator=g) / 16)
    h = 2.0 * x.T @ x / 512
    errors = {}
    for name in ("w3g64", "w3g64f"):
        cfg = replace(PRESETS[name], init="mse")
        result = gptq_quantize(w, h, cfg, 64)
        layer = _layer(cfg, 256)
        with torch.no_grad():
            for key, value in result.items():
                getattr(layer, key).copy_(value)
        assert torch.equal(layer.quantized_weight(), result["weight"])  # on the grid: training continues from it
        delta = w - result["weight"]
        errors[name] = float(((delta @ h) * delta).sum())
    assert errors["w3g64f"] <= errors["w3g64"] * 1.02
