"""fp8 group scales (QuantConfig.scale_bits 8): E4M3 under one power-of-two exponent per layer, on every path
(forward, codes, GPTQ, the packed file) the same values."""
from __future__ import annotations

import pytest
import torch

from qat_lora.quant import inits
from qat_lora.quant.config import PRESETS, QuantConfig, quant_config_dict
from qat_lora.quant.fake_quant import FakeQuantLinear
from qat_lora.quant.gptq_solve import gptq_quantize
from qat_lora.quant.quantizer import quantizer_for

FP8 = QuantConfig(bits=3, group_size=32, init="mse", scale_bits=8)


def _layer(cfg: QuantConfig = FP8, out_features: int = 16, in_features: int = 128, seed: int = 0) -> FakeQuantLinear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():  # rows of very different size, so the scales span decades
        linear.weight.mul_(torch.logspace(-2, 1, out_features).unsqueeze(1))
    return FakeQuantLinear.from_linear(linear, cfg)


def _on_grid(scale: torch.Tensor) -> bool:
    exponent = inits.fp8_exponent(scale)
    return torch.equal((scale / torch.exp2(exponent)).to(torch.float8_e4m3fn).float() * torch.exp2(exponent), scale)


def test_the_rounding_is_an_e4m3_cast():
    scale = torch.exp(torch.randn(64, 40, generator=torch.Generator().manual_seed(0)) * 1.5 - 4)
    exponent = inits.fp8_exponent(scale)
    cast = (scale / torch.exp2(exponent)).to(torch.float8_e4m3fn).float() * torch.exp2(exponent)
    nearest = inits.fp8_scale(scale, exponent)
    assert torch.equal(nearest, cast.clamp(min=inits.SCALE_FLOOR))
    up = inits.fp8_scale(scale, exponent, up=True)
    assert (up >= scale).all() and _on_grid(up) and (up / scale).max() <= 1.25  # one grid step at most
    assert torch.equal(inits.fp8_scale(nearest, inits.fp8_exponent(nearest)), nearest)  # idempotent
    assert torch.equal(nearest.half().float(), nearest)  # fp16-exact: the fp16 paths store it unchanged


def test_forward_codes_and_stored_scales_agree_and_the_scales_train():
    layer = _layer()
    params = {k: p.detach() for k, p in layer.quant_parameters().items()}
    assert _on_grid(params["scale"])  # the init lands on the grid (rounded up: the group's range stays covered)
    stored = layer.stored_quant_parameters()
    wq = layer.quantized_weight().detach()
    q = layer.quantizer
    assert torch.equal(q.dequantize(q.codes(layer.weight.detach(), params), stored), wq)
    # a training step moves the latent scales off the grid; the forward, the codes and the stored values follow
    layer.scale.requires_grad_(True)
    (layer.quantized_weight() * torch.randn_like(wq)).sum().backward()
    assert layer.scale.grad is not None and layer.scale.grad.abs().sum() > 0
    with torch.no_grad():
        layer.scale.mul_(1.0 + 0.03 * torch.randn_like(layer.scale))
    params = {k: p.detach() for k, p in layer.quant_parameters().items()}
    stored = q.stored_parameters(params)
    assert _on_grid(stored["scale"]) and not torch.equal(stored["scale"], params["scale"])
    wq = q.fake_quantize(layer.weight.detach(), params)
    assert torch.equal(q.dequantize(q.codes(layer.weight.detach(), params), stored), wq)
    assert torch.equal(q.fake_quantize(layer.weight.detach(), stored), wq)


def test_gptq_lands_on_the_forwards_grid():
    layer = _layer()
    x = torch.randn(256, layer.in_features, generator=torch.Generator().manual_seed(1))
    x[:, :8] *= 20  # a few strong input channels: the compensation moves later columns a lot
    hessian = 2 * x.T @ x / x.shape[0]
    for act_order in (False, True):
        result = gptq_quantize(layer.weight.detach(), hessian, FP8, 32, act_order=act_order)
        assert _on_grid(result["scale"])
        params = {"scale": result["scale"], "zero": result["zero"]}
        assert torch.equal(layer.quantizer.fake_quantize(result["weight"], params), result["weight"])
        # and it beats rounding the layer to its own init's grid on the layer's outputs
        error = ((result["weight"] - layer.weight.detach()) @ x.T).pow(2).mean()
        assert error < ((layer.quantized_weight().detach() - layer.weight.detach()) @ x.T).pow(2).mean()


def test_storage_bits_count_eight_bit_scales_and_one_exponent():
    assert quantizer_for(FP8).storage_bits(8, 128) == 8 * 128 * 3 + (8 + 3) * (8 * 4) + 8
    bits = {name: quantizer_for(PRESETS[name]).storage_bits(576, 576) / 576**2 for name in ("w3g32-v8", "w2g32-v8")}
    assert bits["w3g32-v8"] < 3.35 and bits["w2g32-v8"] < 2.32  # at about the bits of groups of 64 in fp16


def test_configs_that_cannot_hold_fp8_scales_are_refused():
    for bad in (dict(scheme="lut"), dict(zero_domain="float"), dict(group_size=None), dict(scale_rank=1)):
        with pytest.raises(ValueError, match="scale_bits"):
            QuantConfig(bits=3, scale_bits=8, **bad)
    with pytest.raises(ValueError, match="scale_bits=4"):
        QuantConfig(scale_bits=4)
    assert "scale_bits" not in quant_config_dict(PRESETS["w3g64"])  # the default: digests of old configs unchanged
    assert quant_config_dict(FP8)["scale_bits"] == 8
    assert "fp8" in quantizer_for(FP8).compressed_tensors_reason()
    assert quantizer_for(QuantConfig(bits=4, group_size=32, scale_bits=8)).gguf_type is None  # Q4_1 stores fp16 d
