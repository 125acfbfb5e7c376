"""GGUF LoRA adapter (issue 18, item 3): read back with gguf's reader, the adapter's tensors, names and alpha are
llama.cpp's convert_lora_to_gguf layout, and base + (alpha / r) B A rebuilds the student's adapted weights in
llama.cpp's row order. llama.cpp itself applies the adapter of every family in tests/test_gguf_families.py."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import save_random_adapter
from qat_lora.commands.cli import main
from qat_lora.train.config import StudentSpec
from qat_lora.export.gguf.writer import tensor_naming
from qat_lora.train.student import load_student

gguf = pytest.importorskip("gguf")


def _field(reader, key):
    return reader.fields[key].contents()


@pytest.mark.parametrize("model", ["teacher_dir", "qwen3_dir"])
def test_gguf_adapter_round_trips_and_rebuilds_the_adapted_weights(model, request, tmp_path):
    teacher_dir = request.getfixturevalue(model)
    save_random_adapter(teacher_dir, "q4_0", tmp_path / "run-adapter", r=4, alpha=12.0, seed=2)
    out = tmp_path / "x"
    assert main(["export", "--model", str(teacher_dir), "--quant", "q4_0", "--adapter", str(tmp_path / "run-adapter"),
                 "--format", "gguf", "--out", str(out)]) == 0
    lora = gguf.GGUFReader(str(out / "gguf" / "adapter.gguf"))
    assert _field(lora, "general.type") == "adapter" and _field(lora, "adapter.type") == "lora"
    assert _field(lora, "general.architecture") == {"teacher_dir": "llama", "qwen3_dir": "qwen3"}[model]
    assert _field(lora, "adapter.lora.alpha") == pytest.approx(12.0)
    tensors = {t.name: np.array(t.data) for t in lora.tensors}
    base = {t.name: t for t in gguf.GGUFReader(str(out / "gguf" / "model.gguf")).tensors}
    student = load_student(StudentSpec(str(teacher_dir), "q4_0"), str(tmp_path / "run-adapter"))
    gguf_name, permuted = tensor_naming(student.get_base_model().config)
    wrapped = {n.removeprefix("base_model.model."): m for n, m in student.named_modules() if hasattr(m, "lora_A")
               and hasattr(m, "base_layer")}
    assert len(tensors) == 2 * len(wrapped) == 28
    for prefix, module in wrapped.items():
        key = f"{prefix}.weight"
        name = gguf_name(key)
        a, b = module.lora_A["default"].weight.detach().numpy(), module.lora_B["default"].weight.detach().numpy()
        assert np.array_equal(tensors[f"{name}.lora_a"], a), name  # [r, in]
        assert np.array_equal(tensors[f"{name}.lora_b"], permuted(key, b)), name  # [out, r], llama.cpp's rows
        # What llama.cpp computes: W_base + (alpha / r) * B @ A, against PEFT's adapted weight in the same row order
        w = gguf.quants.dequantize(base[name].data, base[name].tensor_type).reshape(b.shape[0], a.shape[1])
        applied = w + (12.0 / a.shape[0]) * tensors[f"{name}.lora_b"] @ tensors[f"{name}.lora_a"]
        expected = module.base_layer.quantized_weight() + module.get_delta_weight("default")
        np.testing.assert_allclose(applied, permuted(key, expected.detach().numpy()), rtol=0, atol=1e-6)
