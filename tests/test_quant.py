"""Fake-quantised linears, the preset table and quantize_ (DESIGN §4)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from qat_lora.data.models import load_causal_lm
from qat_lora.quant.fake_quant import (PRESETS, FakeQuantLinear, QuantConfig, get_preset, latent_weights, quantize_,
                            quantized_weights_once_per_step, quantizer_parameters)
from qat_lora.quant.quantizer import effective_scale, quantizer_for


def _reference_fake_quant(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> torch.Tensor:
    """Straightforward float64 RTN quantise-dequantise, one group at a time, scales rounded to fp16."""
    out = torch.empty_like(w, dtype=torch.float64)
    for r in range(w.shape[0]):
        for g in range(0, w.shape[1], group):
            x = w[r, g:g + group].double()
            if symmetric:
                qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
                s, z = (x.abs().max() / ((qmax - qmin) / 2)).half().double(), 0.0
            else:
                qmin, qmax = 0, 2**bits - 1
                lo, hi = min(x.min(), 0.0), max(x.max(), 0.0)
                s = ((hi - lo) / qmax).half().double()
                z = float(torch.round(-lo / s).clamp(qmin, qmax))
            out[r, g:g + group] = s * (torch.clamp(torch.round(x / s) + z, qmin, qmax) - z)
    return out


@pytest.mark.parametrize("bits,group,symmetric", [(2, 8, False), (3, 16, False), (4, 32, True), (8, 32, False)])
def test_fake_quant_matches_reference_and_stays_on_grid(bits, group, symmetric):
    torch.manual_seed(0)
    linear = nn.Linear(32, 6)
    cfg = QuantConfig(bits=bits, group_size=group, symmetric=symmetric, init="rtn")
    layer = FakeQuantLinear.from_linear(linear, cfg)
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
    scale = quant_init.snap_fp16(w.abs().reshape(4, 2, 8).amax(-1) / 3).requires_grad_()  # fp16: the grid's own precision
    zero = torch.full((4, 2), 4.0, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(4, 16, dtype=torch.float64)
    grid = quantizer_for(QuantConfig(bits=3, group_size=8))
    (grid.fake_quantize(w, {"scale": scale, "zero": zero}) * upstream).sum().backward()
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


# --- issue 4: schemes, initialisation, gradients, what trains ------------------------------------------------

from qat_lora.quant import inits as quant_init  # noqa: E402
from qat_lora.quant.calibration import activation_importance  # noqa: E402
from qat_lora.quant.fake_quant import quant_config_dict, quant_config_from_dict  # noqa: E402

SCHEME_CASES = {
    "int-asym": QuantConfig(bits=3, group_size=8, init="mse"),
    "int-sym": QuantConfig(bits=4, group_size=8, symmetric=True),
    "int-pc-rtn": QuantConfig(bits=2, group_size=None, init="rtn"),
    "lut-tensor": QuantConfig(bits=2, group_size=8, scheme="lut"),
    "lut-group": QuantConfig(bits=3, group_size=8, scheme="lut", codebook="group"),
    "lut-uniform": QuantConfig(bits=2, group_size=8, scheme="lut", init="rtn"),
    "int-lowrank": QuantConfig(bits=2, group_size=8, scale_rank=2),
    "lut-lowrank": QuantConfig(bits=2, group_size=8, scheme="lut", scale_rank=2),
}


def _layer(cfg: QuantConfig, seed: int = 0, in_features: int = 16, out_features: int = 4) -> FakeQuantLinear:
    torch.manual_seed(seed)
    layer = FakeQuantLinear.from_linear(nn.Linear(in_features, out_features), cfg)
    if cfg.scale_rank:  # B = 0 at init; make it non-zero so A's gradient is exercised too
        with torch.no_grad():
            layer.scale_b.copy_(quant_init.snap_fp16(torch.randn_like(layer.scale_b) * 0.1))
    return layer


@pytest.mark.parametrize("case", SCHEME_CASES)
def test_codes_in_range_and_dequantize_equals_fake_quant_exactly(case):
    cfg = SCHEME_CASES[case]
    layer = _layer(cfg)
    codes = layer.codes()
    assert codes.dtype == torch.uint8 and codes.shape == layer.weight.shape
    assert int(codes.max()) < 2**cfg.bits
    parts = {k: p.detach().half() for k, p in layer.quant_parameters().items()}  # what the export stores
    assert torch.equal(quantizer_for(cfg, layer.group_size).dequantize(codes, parts), layer.quantized_weight())
    if not cfg.scale_rank:  # low-rank scales vary per element, so only the codes are on a 2^b grid
        assert len(torch.unique(layer.quantized_weight().reshape(4, -1, layer.group_size)[0, 0])) <= 2**cfg.bits


@pytest.mark.parametrize("kwargs,match", [
    (dict(scheme="fp4"), "scheme='fp4'"), (dict(init="gptq"), "init='gptq'"),
    (dict(scheme="lut", symmetric=True), "drop symmetric"), (dict(scale_rank=-1), "scale_rank=-1"),
    (dict(codebook="row"), "codebook='row'"), (dict(overrides=(("*.mlp.*", {"bits": 2}),)), "overrides entry"),
    (dict(bits=5), "bits=5"),
])
def test_config_errors_name_the_field_and_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


def test_config_dict_round_trips_with_overrides():
    cfg = QuantConfig(bits=3, include=("*.self_attn.*", "*.mlp.*"),
                      overrides=(("*.mlp.*", QuantConfig(bits=2, scheme="lut", group_size=32)),))
    assert quant_config_from_dict(quant_config_dict(cfg)) == cfg
    assert cfg.for_module("model.layers.0.mlp.up_proj").scheme == "lut"
    assert cfg.for_module("model.layers.0.self_attn.q_proj") is cfg
    assert cfg.for_module("lm_head") is None and cfg.for_module("model.other") is None


@pytest.mark.parametrize("arch_fixture", ["teacher_dir", "qwen3_dir"])
def test_include_exclude_and_overrides_on_real_architectures(arch_fixture, request):
    model = load_causal_lm(request.getfixturevalue(arch_fixture))
    cfg = QuantConfig(bits=3, group_size=32, include=("*.self_attn.*", "*.mlp.*"), exclude=("*.o_proj", "lm_head"),
                      overrides=(("*.mlp.*", QuantConfig(bits=2, group_size=32, scheme="lut")),))
    quantize_(model, cfg)
    layer = model.model.layers[1]
    assert layer.self_attn.q_proj.cfg.scheme == "int" and layer.self_attn.q_proj.cfg.bits == 3
    assert layer.mlp.down_proj.cfg.scheme == "lut" and layer.mlp.down_proj.codebook.shape == (1, 1, 4)
    assert type(layer.self_attn.o_proj) is nn.Linear and type(model.lm_head) is nn.Linear
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.parametrize("bits,symmetric", [(2, False), (3, False), (4, True)])
def test_mse_clipping_never_worse_than_rtn_and_better_overall(bits, symmetric):
    torch.manual_seed(3)
    w = torch.randn(32, 128) * torch.rand(32, 1)  # heavy-ish tails across rows
    err = {}
    for init in ("rtn", "mse"):
        cfg = QuantConfig(bits=bits, group_size=32, symmetric=symmetric, init=init)
        layer = FakeQuantLinear.from_linear(nn.Linear(128, 32), cfg)
        with torch.no_grad():
            layer.weight.copy_(w)
        layer.init_quantizer_()
        err[init] = ((layer.quantized_weight() - w) ** 2).reshape(32, 4, 32).sum(-1)
    assert (err["mse"] <= err["rtn"] + 1e-7).all()
    assert err["mse"].sum() < 0.95 * err["rtn"].sum()


def test_kmeans_codebook_beats_uniform_grid():
    torch.manual_seed(4)
    lin = nn.Linear(128, 32)
    errs = {init: float(((FakeQuantLinear.from_linear(lin, QuantConfig(bits=2, group_size=32, scheme="lut", init=init))
                          .quantized_weight() - lin.weight.detach()) ** 2).sum()) for init in ("rtn", "mse")}
    assert errs["mse"] < errs["rtn"]


def test_weighted_kmeans_matches_float64_lloyd_fixed_point():
    x = torch.tensor([[0.0, 0.1, 0.2, 1.0, 1.1, 5.0]], dtype=torch.float64)
    w = torch.tensor([[1.0, 1.0, 2.0, 1.0, 3.0, 1.0]], dtype=torch.float64)
    centroids = quant_init.weighted_kmeans_1d(x, w, 3)
    expected = torch.tensor([[(0.0 + 0.1 + 0.4) / 4, (1.0 + 3.3) / 4, 5.0]], dtype=torch.float64)
    torch.testing.assert_close(centroids, expected)


def test_data_aware_init_lowers_activation_weighted_error(teacher_dir, tokenizer):
    model = load_causal_lm(teacher_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    importance = activation_importance(model, [ids], "w2g32")
    assert set(importance) == {n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"}
    name = "model.layers.0.mlp.down_proj"
    weight = model.get_submodule(name).weight.detach().clone()
    imp = importance[name]
    assert imp.shape == (weight.shape[1],) and (imp > 0).all()

    def weighted_error(layer_importance):
        lin = nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            lin.weight.copy_(weight)
        cfg = QuantConfig(bits=2, group_size=32, init="mse")  # the importance weights the clipping search
        wq = FakeQuantLinear.from_linear(lin, cfg, importance=layer_importance).quantized_weight()
        return float((((wq - weight) ** 2) * imp).sum())

    assert weighted_error(imp) < weighted_error(None)


def _ste_surrogate(layer: FakeQuantLinear, params: dict[str, torch.Tensor], frozen: dict) -> torch.Tensor:
    """Float64 reference for the function whose gradient LSQ's STE defines: codes frozen at the current
    parameters, W/s passed straight through where the clamp lets it (Esser et al., 2020, eq. 3)."""
    w = layer.weight.detach().double().reshape(layer.out_features, -1, layer.group_size)
    s = params["scale"].unsqueeze(-1)
    if "scale_a" in params:
        s = s * (1 + (params["scale_a"] @ params["scale_b"]).reshape(w.shape))
    s0 = frozen["s"]
    through = frozen["mask"] * (w / s - w / s0)
    if layer.cfg.scheme == "int":
        z = frozen["z"] + (params["zero"] - frozen["zero"]).unsqueeze(-1)  # round(z) passes straight through
        q = frozen["mask"] * (frozen["r"] + z) + (1 - frozen["mask"]) * frozen["qc"]
        return s * (q - z + through)
    values = params["codebook"].expand(w.shape[0], w.shape[1], -1).gather(-1, frozen["idx"])
    return s * (values + through)


def _frozen_state(layer: FakeQuantLinear) -> dict:
    with torch.no_grad():
        w = layer.weight.double().reshape(layer.out_features, -1, layer.group_size)
        s0 = effective_scale(layer.scale, getattr(layer, "scale_a", None), getattr(layer, "scale_b", None),
                             layer.group_size).double().expand_as(w)
        if layer.cfg.scheme == "int":
            z = torch.round(layer.zero.double()).unsqueeze(-1)
            r = torch.round(w / s0)
            mask = ((r + z >= layer.cfg.qmin) & (r + z <= layer.cfg.qmax)).double()
            return {"s": s0, "z": z, "r": r, "zero": layer.zero.detach().double().clone(), "qc": (r + z).clamp(layer.cfg.qmin, layer.cfg.qmax), "mask": mask}
        cb = layer.codebook.double()
        v = w / s0
        idx = (v.unsqueeze(-1) - cb.unsqueeze(-2)).abs().argmin(-1)
        mask = ((v >= cb.amin(-1, keepdim=True)) & (v <= cb.amax(-1, keepdim=True))).double()
        return {"s": s0, "idx": idx, "mask": mask}


@pytest.mark.parametrize("case", SCHEME_CASES)
def test_quantiser_gradients_match_finite_differences(case):
    layer = _layer(SCHEME_CASES[case], seed=5).double()
    for p in layer.quant_parameters().values():
        p.requires_grad_(True)
    x = torch.randn(6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    upstream = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    (layer(x) * upstream).sum().backward()
    frozen = _frozen_state(layer)
    base = {k: p.detach().clone() for k, p in layer.quant_parameters().items()}

    def objective(params):
        wq = _ste_surrogate(layer, params, frozen).reshape(4, 16)
        return float(((x @ wq.T + layer.bias.detach()) * upstream).sum())

    eps = 1e-6
    for name, value in base.items():
        numeric = torch.zeros_like(value).reshape(-1)
        for i in range(value.numel()):
            plus, minus = value.clone().reshape(-1), value.clone().reshape(-1)
            plus[i] += eps
            minus[i] -= eps
            numeric[i] = (objective({**base, name: plus.reshape(value.shape)}) -
                          objective({**base, name: minus.reshape(value.shape)})) / (2 * eps)
        grad = getattr(layer, name).grad
        torch.testing.assert_close(grad, numeric.reshape(value.shape), atol=1e-6, rtol=1e-6, msg=f"{case}: {name}")
        if name in ("scale", "codebook", "scale_b"):
            assert grad.abs().sum() > 0, f"{case}: {name} gets no gradient"


ON_GRID_CASES = {**SCHEME_CASES, "float-zero": get_preset("q4_1"), "q4_k": get_preset("q4_k"),
                 "q6_k": get_preset("q6_k")}


def _on_grid_gradients(cfg: QuantConfig, hold_codes: bool) -> tuple[FakeQuantLinear, torch.Tensor]:
    """A float64 layer whose latent weight is its own dequantised codes (a GPTQ start), with the gradients of
    a random linear function of its output; also returns its codes."""
    layer = _layer(cfg, seed=8, in_features=256 if cfg.scheme == "kquant" else 64).double()
    with torch.no_grad():
        codes = layer.codes()
        layer.weight.copy_(layer.dequantize_codes(codes))
    layer.hold_codes = hold_codes
    layer.requires_grad_(True)
    x = torch.randn(6, layer.in_features, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    (layer(x) * torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10))).sum().backward()
    return layer, codes


@pytest.mark.parametrize("case", ON_GRID_CASES)
def test_a_layer_on_its_grid_holds_the_codes_in_its_quantiser_gradient(case):
    # On the grid W/s is the code, so LSQ's scale gradient round(W/s) - W/s vanishes and the scales of a GPTQ start
    # cannot train (issue 13). With hold_codes the quantiser gets d(dequantize(codes))/d(parameters), codes fixed.
    cfg = ON_GRID_CASES[case]
    lsq, _ = _on_grid_gradients(cfg, hold_codes=False)
    held, codes = _on_grid_gradients(cfg, hold_codes=True)
    assert torch.equal(lsq.quantized_weight(), held.quantized_weight())  # the forward is unchanged
    torch.testing.assert_close(held.weight.grad, lsq.weight.grad)  # the latent weight keeps its STE gradient
    scale_name = "super_scale" if cfg.scheme == "kquant" else "scale"
    if cfg.scheme != "lut":  # (a LUT's extreme entries sit on its clamp, within an ulp: LSQ passes some there)
        assert getattr(lsq, scale_name).grad.abs().max() < 1e-6 * getattr(held, scale_name).grad.abs().max()
    params = {k: p.detach().clone().requires_grad_() for k, p in held.quant_parameters().items()}
    x = torch.randn(6, held.in_features, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    upstream = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    (x @ held.quantizer.dequantize(codes, params).double().T * upstream).sum().backward()
    for name, p in params.items():
        if name == "zero" and cfg.zero_domain == "int":  # shifting an integer zero shifts the codes: Wq is unchanged
            torch.testing.assert_close(getattr(held, name).grad, getattr(lsq, name).grad)
        else:
            torch.testing.assert_close(getattr(held, name).grad, p.grad, rtol=1e-4, atol=1e-6, msg=f"{case}: {name}")

def test_fp16_snapping_is_exact_and_passes_gradients():
    layer = _layer(SCHEME_CASES["int-asym"])
    with torch.no_grad():
        layer.scale.add_(1e-5)  # an update too small for fp16 accumulates in the fp32 parameter...
    snapped = layer.scale.detach().half().float()
    expected = layer.quantizer.fake_quantize(layer.weight, {"scale": snapped, "zero": layer.zero})
    assert torch.equal(layer.quantized_weight(), expected)  # ...but the forward uses the fp16 value


def test_qat_trains_every_quantiser_parameter_and_no_weight():
    # The qat preset (make_trainable_) trains exactly quantizer_parameters: an int layer's scale and zero, a LUT
    # layer's scale, codebook and low-rank scale factors; the latent weights and biases stay frozen.
    from qat_lora.train.student import make_trainable_

    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    quantize_(model, QuantConfig(bits=2, group_size=8, exclude=(), overrides=(
        ("1", QuantConfig(bits=2, group_size=8, scheme="lut", scale_rank=2)),)))
    assert latent_weights(model) == [model[0].weight, model[1].weight]
    assert [id(p) for p in quantizer_parameters(model)] == [id(p) for p in (
        model[0].scale, model[0].zero, model[1].scale, model[1].codebook, model[1].scale_a, model[1].scale_b)]
    model = make_trainable_(model, "qat")
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert [id(p) for p in trainable] == [id(p) for p in quantizer_parameters(model)]
    model(torch.randn(3, 16)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in [model[0].scale, model[1].codebook])
    with pytest.raises(ValueError, match="--preset"):
        make_trainable_(model, "biases")


@pytest.mark.parametrize("preset", ["lut2g32", "w2g32"])
def test_peft_lora_wraps_every_quantised_linear(teacher_dir, preset):
    from qat_lora.train.lora import add_recovery_lora_

    student = quantize_(load_causal_lm(teacher_dir), preset)
    names = [n for n, m in student.named_modules() if isinstance(m, FakeQuantLinear)]
    model = add_recovery_lora_(student, r=2)
    wrapped = [n for n, m in model.named_modules() if isinstance(getattr(m, "base_layer", None), FakeQuantLinear)]
    assert len(wrapped) == len(names) == 14
    assert len([p for n, p in model.named_parameters() if "lora_" in n]) == 2 * len(names)


@pytest.mark.parametrize("train", ["quantizer", "weight"])
def test_wq_once_per_step_gives_the_per_micro_batch_gradients(train):
    # Three micro-batches through a trainable quantiser: building Wq once and backpropagating the summed dL/dWq
    # gives the gradients of building it per micro-batch (float64, exact up to summation order).
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 16, dtype=torch.float64)
    xs = [torch.randn(5, 64, dtype=torch.float64) for _ in range(3)]

    def grads(once: bool) -> dict[str, torch.Tensor]:
        layer = FakeQuantLinear.from_linear(copy.deepcopy(linear), PRESETS["w3g32"]).double()  # scales too
        params = [layer.weight] if train == "weight" else list(layer.quant_parameters().values())
        for p in layer.parameters():
            p.requires_grad_(any(p is q for q in params))
        with quantized_weights_once_per_step(layer, enabled=once) as backward_quantizers:
            for i, x in enumerate(xs):
                (layer(x).sin().sum() * (i + 1)).backward()
            assert (layer._step_leaf is not None) == once
            backward_quantizers()
        assert layer._step_leaf is None  # released: the next forward builds Wq from the updated parameters
        return {n: p.grad.clone() for n, p in layer.named_parameters() if p.requires_grad}

    per_micro, once = grads(False), grads(True)
    assert per_micro.keys() == once.keys() and per_micro
    for name in per_micro:
        torch.testing.assert_close(once[name], per_micro[name], rtol=1e-10, atol=1e-12)


def test_wq_once_per_step_skips_frozen_quantizers():
    layer = FakeQuantLinear.from_linear(torch.nn.Linear(32, 8), PRESETS["w4g32"])
    layer.weight.requires_grad_(False)
    with quantized_weights_once_per_step(layer):
        assert layer._step_leaf is None and not layer.quantized_weight().requires_grad


@pytest.mark.parametrize("per_group", [False, True])
def test_lut_lookup_as_compare_and_sum_equals_searchsorted_including_ties(monkeypatch, per_group):
    # XLA has no searchsorted: the lookup counts the midpoints below each value instead (device.py picks which).
    import qat_lora.runtime.device as dev
    from qat_lora.quant.quantizer import _lut_lookup

    g = torch.Generator().manual_seed(0)
    shape = (6, 4, 16) if per_group else (1, 1, 16)
    codebook = torch.randint(-8, 8, shape, generator=g).float() / 4  # repeated entries: equal midpoints
    ordered = codebook.sort(-1).values.expand(6, 4, -1)
    mids = (ordered[..., 1:] + ordered[..., :-1]) / 2
    v = torch.randn(6, 4, 32, generator=g) * 2
    v[..., :15] = mids  # values exactly on a midpoint: searchsorted (left) puts them below
    values, codes = _lut_lookup(v, codebook)
    monkeypatch.setattr(dev, "searchsorted_is_native", lambda device: False)
    values_cs, codes_cs = _lut_lookup(v, codebook)
    assert torch.equal(codes, codes_cs) and torch.equal(values, values_cs)


def test_a_frozen_layer_under_autocast_caches_wq_in_the_compute_dtype_with_the_same_output():
    layer = FakeQuantLinear.from_linear(nn.Linear(64, 32), QuantConfig(bits=3, group_size=32)).requires_grad_(False)
    x = torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = F.linear(x, layer.quantized_weight(), layer.bias)  # what autocast made of the fp32 Wq each forward
        got = layer(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, before)
    assert layer._cached_wq.dtype == torch.bfloat16  # cast once, kept: no per-forward cast of every frozen weight
    assert torch.equal(layer(x), F.linear(x, layer.quantized_weight().to(x.dtype), layer.bias))  # fp32 outside
    assert layer._cached_wq.dtype == torch.float32


def test_rank_one_scale_factors_start_at_the_group_scales_and_move_each_input_channel_at_the_rate():
    # A is 1 and B starts at 0: the same grid as without factors, and Adam's first step (about lr per parameter)
    # changes every input channel's step by a factor 1 +- lr, not 100x less.
    torch.manual_seed(0)
    linear = nn.Linear(32, 6)
    plain = FakeQuantLinear.from_linear(copy.deepcopy(linear), QuantConfig(bits=3, group_size=8))
    ranked = FakeQuantLinear.from_linear(copy.deepcopy(linear), QuantConfig(bits=3, group_size=8, scale_rank=1))
    assert torch.equal(ranked.quantized_weight(), plain.quantized_weight())
    assert torch.equal(ranked.scale_a, torch.ones(6, 1))
    lr = 1e-3
    opt = torch.optim.Adam([ranked.scale_b.requires_grad_()], lr=lr)
    ranked(torch.randn(4, 32)).pow(2).sum().backward()
    opt.step()
    factor = effective_scale(ranked.scale, ranked.scale_a, ranked.scale_b, 8) / ranked.scale.unsqueeze(-1)
    torch.testing.assert_close((factor - 1).abs(), torch.full((6, 4, 8), lr), rtol=1e-3, atol=0)
    # at rank 2 the second column is random and of order 1 (identical columns would stay rank 1)
    a = FakeQuantLinear.from_linear(linear, QuantConfig(bits=3, group_size=8, scale_rank=2)).scale_a
    assert torch.equal(a[:, 0], torch.ones(6)) and 0.2 < a[:, 1].abs().mean() < 2
