"""Recovery LoRA over quantised linears (DESIGN §5)."""
from __future__ import annotations

import copy

import pytest
import torch

from qat_lora.train.lora import add_recovery_lora_
from qat_lora.data.models import load_causal_lm
from qat_lora.quant.fake_quant import FakeQuantLinear, quantize_


def _student(path):
    return quantize_(load_causal_lm(path), "w2g32")


def test_lora_at_init_leaves_logits_unchanged(teacher_dir):
    student = _student(teacher_dir)
    ids = torch.randint(0, student.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = student(input_ids=ids).logits
        after = add_recovery_lora_(copy.deepcopy(student), r=4)(input_ids=ids).logits
    assert torch.equal(before, after)


def test_only_lora_parameters_train_and_wrap_quantised_base(teacher_dir):
    model = add_recovery_lora_(_student(teacher_dir), r=4)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, FakeQuantLinear)


def test_early_adapter_gradient_matches_reference_without_detach(teacher_dir):
    """Gradients must flow through the frozen quantised base: compare layer-0's LoRA gradient with a
    reference built from plain Linears holding Wq and LoRA added by hand (no PEFT, no caching)."""
    torch.manual_seed(0)
    model = add_recovery_lora_(_student(teacher_dir), r=4, alpha=8.0)
    for name, p in model.named_parameters():  # B = 0 at init would zero A's gradient: randomise it
        if "lora_B" in name:
            with torch.no_grad():
                p.normal_(0, 0.05)
    reference = load_causal_lm(teacher_dir)
    hooks, ref_params = [], {}
    for name, module in model.base_model.model.named_modules():
        if not isinstance(module, FakeQuantLinear):
            continue
        owner = model.base_model.model.get_submodule(name.rsplit(".", 1)[0])
        ref_linear = reference.get_submodule(name.removesuffix(".base_layer"))
        with torch.no_grad():
            ref_linear.weight.copy_(module.quantized_weight())
        a = owner.lora_A["default"].weight.detach().clone().requires_grad_()
        b = owner.lora_B["default"].weight.detach().clone().requires_grad_()
        ref_params[name.removesuffix(".base_layer")] = (a, b)
        hooks.append(ref_linear.register_forward_hook(lambda m, inp, out, a=a, b=b: out + inp[0] @ a.T @ b.T * 2.0))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    target = torch.randn(2, 12, model.config.vocab_size, generator=torch.Generator().manual_seed(2))
    (model(input_ids=ids).logits * target).sum().backward()
    (reference(input_ids=ids).logits * target).sum().backward()
    layer0 = model.base_model.model.model.layers[0].self_attn.q_proj
    a_ref, b_ref = ref_params["model.layers.0.self_attn.q_proj"]
    assert a_ref.grad.abs().sum() > 0
    torch.testing.assert_close(layer0.lora_A["default"].weight.grad, a_ref.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(layer0.lora_B["default"].weight.grad, b_ref.grad, atol=1e-5, rtol=1e-4)
    for h in hooks:
        h.remove()


def _correlated_inputs(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) @ (torch.randn(d, d, generator=g) / d**0.5)
    x[:, [1, 17]] *= 8.0  # outlier channels, as in LLM activations
    return x


@pytest.mark.parametrize("method", ["exact", "randomized"])
@pytest.mark.parametrize("out_features, in_features", [(24, 64), (64, 24)], ids=["wide", "tall"])
def test_low_rank_correction_is_the_optimum_in_the_output_metric(out_features, in_features, method):
    """Against an independent construction (symmetric square root of H by eigh instead of Cholesky, a full SVD
    instead of the smaller Gram's eigenvectors or the randomized range finder): the same rank-r product, the
    removed output energy equals the kept singular values, and weighting by H beats the plain truncated SVD of
    the weight error."""
    from qat_lora.train.lora import low_rank_correction, whitening_factor

    g = torch.Generator().manual_seed(0)
    delta = torch.randn(out_features, in_features, generator=g, dtype=torch.float64) * 0.01
    x = _correlated_inputs(400, in_features, 1).double()
    h = x.T @ x / x.shape[0]
    r, damp = 5, 0.01
    left, right, kept, total = low_rank_correction(delta, whitening_factor(h, damp), r, method)
    assert left.shape == (out_features, r) and right.shape == (r, in_features)
    assert kept.shape == (r,) and bool((kept[:-1] >= kept[1:]).all())
    hd = h + damp * h.diagonal().mean() * torch.eye(in_features, dtype=torch.float64)
    evals, evecs = torch.linalg.eigh(hd)
    root = evecs @ torch.diag(evals.sqrt()) @ evecs.T
    u, s, vh = torch.linalg.svd(delta @ root)
    reference = u[:, :r] @ torch.diag(s[:r]) @ vh[:r] @ torch.linalg.inv(root)
    torch.testing.assert_close(left @ right, reference, rtol=1e-7, atol=1e-10)

    def error(c):  # tr((delta - c) Hd (delta - c)ᵀ)
        d = delta - c
        return float(((d @ hd) * d).sum())

    assert error(left @ right) == pytest.approx(float(total - kept.sum()), rel=1e-9)
    assert error(torch.zeros_like(delta)) == pytest.approx(float(total), rel=1e-9)
    torch.testing.assert_close(kept, s[:r] ** 2, rtol=1e-9, atol=0.0)
    u0, s0, vh0 = torch.linalg.svd(delta)
    assert error(left @ right) < 0.95 * error(u0[:, :r] @ torch.diag(s0[:r]) @ vh0[:r])


@pytest.mark.parametrize("shape", [(256, 1024), (1024, 256)], ids=["wide", "tall"])
def test_randomized_correction_keeps_the_optimal_energy_on_a_flat_spectrum(shape):
    """Quantisation error is noise-like: its whitened spectrum has no gap after r, the hard case for a range
    finder. The randomized pairs still remove >= 99.5 % of what the exact top-r removes, with a valid
    factorisation (the error left equals total - kept), and auto picks it only on CUDA."""
    from qat_lora.train.lora import low_rank_correction, whitening_factor

    g = torch.Generator().manual_seed(3)
    out_features, in_features = shape
    delta = torch.randn(shape, generator=g, dtype=torch.float64) * (1 + 3 * torch.rand(in_features, generator=g,
                                                                                        dtype=torch.float64))
    x = _correlated_inputs(2048, in_features, 4).double()
    factor = whitening_factor(x.T @ x / x.shape[0])
    r = 16
    exact = low_rank_correction(delta, factor, r, "exact")
    fast = low_rank_correction(delta, factor, r, "randomized")
    assert float(fast[2].sum()) >= 0.995 * float(exact[2].sum())
    assert float(fast[2].sum()) <= float(exact[2].sum()) * (1 + 1e-9)
    torch.testing.assert_close(fast[3], exact[3])
    m = delta @ factor
    left_m = (delta - fast[0] @ fast[1]) @ factor
    assert float(left_m.square().sum()) == pytest.approx(float(m.square().sum() - fast[2].sum()), rel=1e-6)
    auto = low_rank_correction(delta, factor, r)  # on the CPU: exact
    torch.testing.assert_close(auto[0] @ auto[1], exact[0] @ exact[1], rtol=0, atol=0)


def test_calibrated_init_sets_each_pair_and_brings_the_student_closer_to_the_teacher(teacher_dir):
    from qat_lora.quant import blocks
    from qat_lora.train.lora import calibrated_lora_init_, low_rank_correction, whitening_factor

    teacher = load_causal_lm(teacher_dir)
    zero = add_recovery_lora_(_student(teacher_dir), r=4, alpha=8.0)
    model = copy.deepcopy(zero)
    base_before = {n: p.clone() for n, p in model.named_parameters() if "lora_" not in n}
    g = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, teacher.config.vocab_size, (4, 24), generator=g) for _ in range(3)]
    report = calibrated_lora_init_(model, teacher, calib, log=lambda _: None)
    assert all(torch.equal(p, base_before[n]) for n, p in model.named_parameters() if "lora_" not in n)
    assert set(report["layers"]) == {f"layers.{i}.{n}" for i in range(2) for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}
    assert all(0.0 < share < 1.0 for share in report["layers"].values())

    # Layer 0's q_proj sees normed embeddings, the same in teacher and student: rebuild its correction by hand.
    seen = []
    hook = teacher.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda m, inp, out: seen.append(inp[0].reshape(-1, inp[0].shape[-1]).double()))
    with torch.no_grad():
        for ids in calib:
            teacher(input_ids=ids)
    hook.remove()
    x = torch.cat(seen)
    q_proj = blocks.decoder_layers(model)[0].self_attn.q_proj
    delta = teacher.model.layers[0].self_attn.q_proj.weight.double() - q_proj.base_layer.quantized_weight().double()
    left, right, *_ = low_rank_correction(delta, whitening_factor(2.0 * x.T @ x / x.shape[0]), 4)
    product = q_proj.scaling["default"] * q_proj.lora_B["default"].weight.double() @ q_proj.lora_A["default"].weight.double()
    torch.testing.assert_close(product, left @ right, rtol=1e-4, atol=1e-6)

    held_out = torch.randint(0, teacher.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        target = teacher(input_ids=held_out).logits
        gap = [float(((m(input_ids=held_out).logits - target) ** 2).mean()) for m in (zero, model)]
    assert gap[1] < 0.9 * gap[0]


def test_calibrated_init_refuses_a_model_without_adapters_or_another_reference(teacher_dir):
    from qat_lora.train.lora import calibrated_lora_init_

    ids = [torch.zeros(1, 8, dtype=torch.long)]
    with pytest.raises(ValueError, match="no LoRA adapter over a quantised linear"):
        calibrated_lora_init_(_student(teacher_dir), load_causal_lm(teacher_dir), ids)
    deeper = load_causal_lm(teacher_dir)
    deeper.model.layers.append(copy.deepcopy(deeper.model.layers[0]))
    with pytest.raises(ValueError, match="the reference model has 3 decoder layers, the student 2"):
        calibrated_lora_init_(add_recovery_lora_(_student(teacher_dir), r=4), deeper, ids)


def test_the_calibrated_start_of_a_multi_rank_run_is_the_masters_on_every_rank(teacher_dir, cache_dir, monkeypatch):
    from qat_lora.train import run as run_module
    from qat_lora.train.config import TrainConfig

    computed = []
    monkeypatch.setattr(run_module, "lora_start_", lambda *a, **k: computed.append(k.get("device")))

    class Rank1:  # the second of two ranks: the master's tensor comes first in every gather
        is_master, world_size = False, 2

        @staticmethod
        def all_gather(t):
            return [torch.full_like(t, 0.5), t]

    model = add_recovery_lora_(_student(teacher_dir), r=4, alpha=8.0)
    cfg = TrainConfig(model=str(teacher_dir), cache=str(cache_dir), quant="w2g32", lora_init="calibrated",
                      lora_r=4, lora_alpha=8.0)
    run_module._lora_start_(cfg, model, torch.device("cpu"), Rank1(), lambda _: None)
    assert computed == []  # rank 1 computes nothing: one SVD per layer in the whole run, not one per rank
    assert all(torch.all(p == 0.5) for n, p in model.named_parameters() if "lora_" in n)


def test_wrapping_a_student_in_lora_warns_about_nothing_a_user_can_fix(teacher_dir):
    # PEFT reads a property transformers 5 deprecated: its FutureWarning was the last line a demo user saw.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        add_recovery_lora_(_student(teacher_dir), r=2, alpha=4.0)
