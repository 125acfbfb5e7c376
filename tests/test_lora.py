"""Recovery LoRA over quantised linears (DESIGN §5)."""
from __future__ import annotations

import copy

import torch

from qat_lora.lora import add_recovery_lora_
from qat_lora.models import load_causal_lm
from qat_lora.quant import FakeQuantLinear, quantize_


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
