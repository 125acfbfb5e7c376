"""Fake-quantised linears, the preset table and quantize_ (DESIGN §4)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from qat_lora.models import load_causal_lm
from qat_lora.quant import (PRESETS, FakeQuantLinear, QuantConfig, fake_quantize, get_preset, quantize_,
                            quantizer_parameters)


def _reference_fake_quant(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> torch.Tensor:
    """Straightforward float64 RTN quantise-dequantise, one group at a time."""
    out = torch.empty_like(w, dtype=torch.float64)
    for r in range(w.shape[0]):
        for g in range(0, w.shape[1], group):
            x = w[r, g:g + group].double()
            if symmetric:
                qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
                s, z = x.abs().max() / ((qmax - qmin) / 2), 0.0
            else:
                qmin, qmax = 0, 2**bits - 1
                lo, hi = min(x.min(), 0.0), max(x.max(), 0.0)
                s = (hi - lo) / qmax
                z = float(torch.round(-lo / s).clamp(qmin, qmax))
            out[r, g:g + group] = s * (torch.clamp(torch.round(x / s) + z, qmin, qmax) - z)
    return out


@pytest.mark.parametrize("bits,group,symmetric", [(2, 8, False), (3, 16, False), (4, 32, True), (8, 32, False)])
def test_fake_quant_matches_reference_and_stays_on_grid(bits, group, symmetric):
    torch.manual_seed(0)
    linear = nn.Linear(32, 6)
    layer = FakeQuantLinear.from_linear(linear, QuantConfig(bits=bits, group_size=group, symmetric=symmetric))
    wq = layer.quantized_weight()
    torch.testing.assert_close(wq.double(), _reference_fake_quant(linear.weight.detach(), bits, group, symmetric),
                               atol=1e-6, rtol=1e-5)
    codes = torch.round(linear.weight.detach().reshape(6, -1, group) / layer.scale.unsqueeze(-1)) + layer.zero.unsqueeze(-1)
    levels = (wq.reshape(6, -1, group) / layer.scale.unsqueeze(-1) + layer.zero.unsqueeze(-1)).round()
    assert levels.min() >= layer.cfg.qmin and levels.max() <= layer.cfg.qmax
    assert len(torch.unique(levels)) <= 2**bits
    assert codes.shape == levels.shape


def test_forward_uses_quantised_weight_and_keeps_latent():
    torch.manual_seed(1)
    linear = nn.Linear(64, 8)
    latent = linear.weight.detach().clone()
    layer = FakeQuantLinear.from_linear(linear, PRESETS["w3g32"])
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ layer.quantized_weight().T + linear.bias)
    assert torch.equal(layer.weight.detach(), latent) and layer.weight is linear.weight


def test_scales_and_zeros_receive_correct_gradients():
    # LSQ: d/ds of s * (clamp(round(w/s) + z) - z) with round's STE. Compare with autograd on the
    # explicit formula in float64, and check the gradient is non-zero.
    torch.manual_seed(2)
    w = torch.randn(4, 16, dtype=torch.float64)
    scale = (w.abs().reshape(4, 2, 8).amax(-1) / 3).requires_grad_()
    zero = torch.full((4, 2), 4.0, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(4, 16, dtype=torch.float64)
    (fake_quantize(w, scale, zero, 0, 7) * upstream).sum().backward()
    s = scale.detach().unsqueeze(-1)
    wg = w.reshape(4, 2, 8)
    q = torch.round(wg / s) + 4.0
    inside = ((q >= 0) & (q <= 7)).double()
    qc = q.clamp(0, 7)
    # Inside the range: d/ds = round(w/s) - w/s; clamped: qc - z. Zero: inside 0, clamped -s... times upstream.
    d_scale = torch.where(inside.bool(), torch.round(wg / s) - wg / s, qc - 4.0)
    expected_scale = (d_scale * upstream.reshape(4, 2, 8)).sum(-1)
    expected_zero = ((inside - 1.0) * s * upstream.reshape(4, 2, 8)).sum(-1)
    torch.testing.assert_close(scale.grad, expected_scale)
    torch.testing.assert_close(zero.grad, expected_zero)
    assert scale.grad.abs().sum() > 0


def test_group_size_that_does_not_divide_names_the_layer(teacher_dir):
    model = load_causal_lm(teacher_dir)
    with pytest.raises(ValueError, match=r"does not divide in_features=64 of layer model\.layers\.0\.self_attn\.q_proj"):
        quantize_(model, QuantConfig(bits=4, group_size=48))


@pytest.mark.parametrize("arch_fixture", ["teacher_dir", "qwen3_dir"])
def test_quantize_replaces_linears_but_not_lm_head_or_embeddings(arch_fixture, request):
    model = load_causal_lm(request.getfixturevalue(arch_fixture))
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    quantize_(model, "w4g32")
    assert all(isinstance(model.get_submodule(n), FakeQuantLinear) for n in linears)
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert len(quantizer_parameters(model)) == 2 * len(linears)
    assert not any(p.requires_grad for p in quantizer_parameters(model))


def test_unknown_preset_lists_choices():
    with pytest.raises(ValueError, match="unknown quantisation preset 'w5g7'.*w3g64"):
        get_preset("w5g7")


def test_cached_weight_follows_parameter_updates():
    layer = FakeQuantLinear.from_linear(nn.Linear(32, 4), PRESETS["w4g32"])
    before = layer.quantized_weight().clone()
    with torch.no_grad():
        layer.scale.mul_(2.0)
    assert not torch.equal(before, layer.quantized_weight())
