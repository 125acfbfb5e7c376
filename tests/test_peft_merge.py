"""PEFT's merges over a quantised student (issue 48, item 2): QuantLoraLinear is what PEFT wraps a FakeQuantLinear in,
its merges act on Wq (exact, or on the grid when asked), and the cached Wq never serves stale values."""
from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
from peft.tuners.lora.layer import Linear as StockLoraLinear
from safetensors.torch import load_file
from torch import nn

from conftest import save_random_adapter
from qat_lora.export.merge import merge_full_, merge_lora_
from qat_lora.quant.config import PRESETS
from qat_lora.quant.fake_quant import FakeQuantLinear
from qat_lora.quant.lora_layer import QuantLoraLinear
from qat_lora.train.config import StudentSpec
from qat_lora.train.student import build_student, load_student, make_trainable_

QUANT = "w3g32"


def _ids(model) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _wrapped(model) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(getattr(m, "base_layer", None), FakeQuantLinear)}


@pytest.fixture()
def adapted(teacher_dir, tmp_path):
    """A student with a random (non-zero B) recovery adapter, in eval mode; and its adapter folder."""
    model = save_random_adapter(teacher_dir, QUANT, tmp_path / "adapter")
    return model.eval(), tmp_path / "adapter"


# --- the cached Wq --------------------------------------------------------------------------------------------

def _frozen_layer() -> FakeQuantLinear:
    torch.manual_seed(0)
    return FakeQuantLinear.from_linear(nn.Linear(32, 8), PRESETS["w4g32"]).requires_grad_(False)


def _fresh_wq(layer: FakeQuantLinear) -> torch.Tensor:
    return copy.deepcopy(layer)._fake_quantize().detach()


@pytest.mark.parametrize("write", ["copy_", "set_data", "load_state_dict", "to_dtype", "scale_copy_"])
def test_cached_wq_follows_every_tracked_write(write):
    layer = _frozen_layer()
    before = layer.quantized_weight().clone()
    shift = torch.full_like(layer.weight, 0.3)
    with torch.no_grad():
        if write == "copy_":
            layer.weight.copy_(layer.weight + shift)
        elif write == "set_data":  # PEFT's safe_merge and set_storage_dtype_ write this way
            layer.weight.data = layer.weight + shift
        elif write == "load_state_dict":
            layer.load_state_dict({**layer.state_dict(), "weight": layer.weight + shift})
        elif write == "to_dtype":  # even after a write through .data, as the issue saw
            layer.weight.data += shift
            layer.to(torch.float64)
        else:
            layer.scale.copy_(layer.scale * 2)
    after = layer.quantized_weight()
    assert not torch.equal(after, before.to(after.dtype))
    assert torch.equal(after, _fresh_wq(layer))


@pytest.mark.parametrize("write", ["iadd", "copy_"])
def test_a_write_through_data_is_seen_after_invalidate_cache(write):
    # `.data` is a tensor with a version counter of its own: no key can see a write through it, by PyTorch's design
    # (the reason PEFT's stock merge left a stale Wq); QuantLoraLinear never writes so, and a user calls this.
    layer = _frozen_layer()
    layer.quantized_weight()
    version = layer.weight._version
    if write == "iadd":
        layer.weight.data += 0.3
    else:
        layer.weight.data.copy_(layer.weight + 0.3)
    assert layer.weight._version == version  # what the issue found
    layer.invalidate_cache()
    assert torch.equal(layer.quantized_weight(), _fresh_wq(layer))


def test_a_layer_with_a_cached_wq_pickles():
    # the cache's weak references cannot be pickled: torch.save and spawned ranks get the layer without its cache
    layer = _frozen_layer()
    layer.quantized_weight()
    again = pickle.loads(pickle.dumps(layer))
    assert again._cached_wq is None and torch.equal(again.quantized_weight(), layer.quantized_weight())


# --- dispatch and training ------------------------------------------------------------------------------------

def test_add_and_load_paths_wrap_quantised_linears_in_quant_lora_linear(adapted, teacher_dir):
    model, folder = adapted
    assert _wrapped(model) and all(type(m) is QuantLoraLinear for m in _wrapped(model).values())
    loaded = load_student(StudentSpec(str(teacher_dir), QUANT), str(folder))
    assert _wrapped(loaded) and all(type(m) is QuantLoraLinear for m in _wrapped(loaded).values())
    saved = json.loads((folder / "adapter_config.json").read_text())
    assert not any("custom" in k for k in saved)  # the files stay plain PEFT's
    assert torch.equal(_logits(loaded, _ids(model)), _logits(model, _ids(model)))


@pytest.mark.parametrize("preset", ["recovery-lora", "qat+lora"])
def test_training_forward_and_gradients_equal_stock_peft(teacher_dir, preset, monkeypatch):
    def build(stock: bool):
        if stock:  # today's path: PEFT's own lora.Linear around the FakeQuantLinear
            monkeypatch.setattr("qat_lora.quant.lora_layer.register_quant_lora", lambda config: config)
        torch.manual_seed(0)
        model = make_trainable_(build_student(StudentSpec(str(teacher_dir), QUANT)), preset, lora_r=4, lora_alpha=8.0)
        monkeypatch.undo()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # B = 0 would zero A's gradient
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
        return model

    ours, stock = build(stock=False), build(stock=True)
    assert {type(m) for m in _wrapped(ours).values()} == {QuantLoraLinear}
    assert {type(m) for m in _wrapped(stock).values()} == {StockLoraLinear}
    ids = _ids(ours)
    target = torch.randn(*ids.shape, ours.config.vocab_size, generator=torch.Generator().manual_seed(2))
    outputs = []
    for model in (ours, stock):
        logits = model(input_ids=ids).logits
        (logits * target).sum().backward()
        outputs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (ours_logits, ours_grads), (stock_logits, stock_grads) = outputs
    assert torch.equal(ours_logits, stock_logits)
    assert ours_grads.keys() == stock_grads.keys()
    assert any("lora_A" in n for n in ours_grads)
    assert preset == "recovery-lora" or any(n.endswith(".scale") for n in ours_grads)  # qat+lora: the scales too
    for name in ours_grads:
        assert torch.equal(ours_grads[name], stock_grads[name]), name


# --- merges -----------------------------------------------------------------------------------------------------

def test_merge_then_unmerge_is_exact_and_restores_wq_bit_for_bit(adapted):
    model, _ = adapted
    ids = _ids(model)
    expected = _logits(model, ids)
    wrapped = _wrapped(model)
    bases = {n: m.base_layer for n, m in wrapped.items()}
    wq = {n: b.quantized_weight().clone() for n, b in bases.items()}
    model.merge_adapter()
    assert all(type(m.base_layer) is nn.Linear and m.merged for m in wrapped.values())
    torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)  # (Wq + BA) x vs Wq x + B(A x)
    model.unmerge_adapter()
    assert all(m.base_layer is bases[n] and not m.merged for n, m in wrapped.items())
    assert all(torch.equal(bases[n].quantized_weight(), wq[n]) for n in bases)
    assert torch.equal(_logits(model, ids), expected)


def test_grid_merge_then_unmerge_restores_the_latent_weight_bit_for_bit(adapted):
    model, _ = adapted
    ids = _ids(model)
    expected = _logits(model, ids)
    wrapped = _wrapped(model)
    latent = {n: m.base_layer.weight.clone() for n, m in wrapped.items()}
    for m in wrapped.values():
        m.merge(grid=True)
    for m in wrapped.values():  # on the grid: the layer serves Q(Wq + dW), which is a fixed point of Q
        assert isinstance(m.base_layer, FakeQuantLinear)
        wq = m.base_layer.quantized_weight()
        assert torch.equal(copy.deepcopy(m.base_layer).requires_grad_(False).quantized_weight(), wq)
    for m in wrapped.values():
        m.unmerge()
    assert all(torch.equal(m.base_layer.weight, latent[n]) for n, m in wrapped.items())
    assert torch.equal(_logits(model, ids), expected)


def test_mixing_exact_and_grid_merges_and_non_finite_merges_are_refused(adapted):
    model, _ = adapted
    layer = next(iter(_wrapped(model).values()))
    layer.update_layer("other", 4, lora_alpha=8.0, config=model.peft_config["default"])
    layer.merge(adapter_names=["default"])
    with pytest.raises(ValueError, match=r"merge\(grid=True\): adapters \['default'\] are already merged exactly"):
        layer.merge(adapter_names=["other"], grid=True)
    layer.unmerge()
    with torch.no_grad():
        layer.lora_B["other"].weight.fill_(float("inf"))
    with pytest.raises(ValueError, match="is not finite"):
        layer.merge(safe_merge=True, adapter_names=["other"])
    assert not layer.merged and isinstance(layer.base_layer, FakeQuantLinear)


def test_merge_and_unload_equals_the_adapted_student_and_the_full_precision_merge(adapted):
    model, _ = adapted
    ids = _ids(model)
    expected = _logits(model, ids)
    full = merge_full_(copy.deepcopy(model)).state_dict()
    merged = model.merge_and_unload()
    assert not any(isinstance(m, (FakeQuantLinear, StockLoraLinear)) for m in merged.modules() if m is not merged)
    torch.testing.assert_close(_logits(merged, ids), expected, rtol=1e-4, atol=1e-4)
    state = merged.state_dict()
    assert state.keys() == full.keys() and all(torch.equal(state[k], full[k]) for k in full)
    # the issue: a stale Wq after the merge, then Q(W + dW) after .to(); now a plain dense weight throughout
    torch.testing.assert_close(_logits(merged.to(torch.float32), ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_python_merges_equal_the_cli_exports_bit_for_bit(adapted, teacher_dir, tmp_path):
    from qat_lora.commands.cli import main
    from qat_lora.export.exporter import load_packed

    _, folder = adapted
    out = tmp_path / "e"
    assert main(["export", "--model", str(teacher_dir), "--quant", QUANT, "--adapter", str(folder), "--merge-fp",
                 "--merge-adapter", "--format", "packed", "--out", str(out)]) == 0
    spec = StudentSpec(str(teacher_dir), QUANT)
    fp = load_student(spec, str(folder)).merge_and_unload()  # the Python API: exact
    exported = load_file(str(out / "merged-fp" / "model.safetensors"))
    state = fp.state_dict()
    merged_linears = [k for k in exported if k.endswith("proj.weight")]
    assert merged_linears and all(torch.equal(exported[k], state[k]) for k in merged_linears)
    grid = load_student(spec, str(folder))  # the Python API: on the grid
    for m in _wrapped(grid).values():
        m.merge(grid=True)
    grid = grid.unload()
    packed = load_packed(out / "packed")
    layers = {n: m for n, m in grid.named_modules() if isinstance(m, FakeQuantLinear)}
    assert layers and all(torch.equal(m.quantized_weight(), packed.get_submodule(n).quantized_weight())
                          for n, m in layers.items())
    # and the export's own grid merge is that function
    reference, _ = merge_lora_(load_student(spec, str(folder)))
    assert all(torch.equal(m.quantized_weight(), reference.get_submodule(n).quantized_weight())
               for n, m in layers.items())
