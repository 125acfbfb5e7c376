"""compressed-tensors export (issue 18, item 2): transformers + the compressed-tensors package load the folder
and rebuild the student's Wq; the logits match."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from qat_lora.commands.cli import main
from qat_lora.train.config import StudentSpec
from qat_lora.export.config import ExportConfig
from qat_lora.export.compressed_tensors import pack_int32
from qat_lora.quant.fake_quant import FakeQuantLinear
from qat_lora.train.student import build_student

# compressed_tensors itself comes with the `dev` (and `ct`) extra; the loads below run in fresh processes.

# Runs without qat_lora: transformers' own compressed-tensors integration, weights decompressed at load.
CT_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig
from safetensors.torch import load_file, save_file
extra = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if sys.argv[4] == "dequantize" else {}
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, attn_implementation="eager",
                                             **extra).eval()
ids = load_file(sys.argv[2])["ids"]
with torch.no_grad():
    logits = model(input_ids=ids).logits
weights = {n + ".weight": m.weight.detach().float().contiguous() for n, m in model.named_modules()
           if n.endswith("_proj") and "weight" in dict(m.named_parameters(recurse=False))}
assert not any(name.startswith("qat_lora") for name in sys.modules)
save_file({"logits": logits.contiguous(), **weights}, sys.argv[3])
"""


def test_pack_int32_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    for bits in (2, 4, 8):
        half = 1 << (bits - 1)
        q = torch.randint(-half, half, (6, 70), generator=torch.Generator().manual_seed(bits))
        ours = pack_int32(q, bits)
        assert torch.equal(ours, pack_to_int32(q.to(torch.int8), bits))
        assert torch.equal(unpack_from_int32(ours, bits, torch.Size([6, 70])).long(), q)


@pytest.mark.slow
@pytest.mark.parametrize("quant,mode", [("w4g32", "dequantize"), ("w4g64", "dequantize"), ("w4pc", "dequantize"),
                                        ("w8pc", "dequantize"), ("w2g32", "dequantize"), ("q4_0", "compressed"),
                                        ("q4_0", "dequantize"),
                                        ("q8_0", "compressed")])
def test_transformers_loads_the_folder_and_rebuilds_the_students_weights(quant, mode, teacher_dir, tmp_path):
    # mode compressed: plain from_pretrained, modules kept compressed and decompressed on the first forward;
    # dequantize: CompressedTensorsConfig(dequantize=True), weights decompressed as they load. transformers 5.23
    # with compressed-tensors 0.20 expects unpacked zero points on the first path (a size mismatch for packed
    # ones, which compressed-tensors' own compressor writes and vLLM reads), so asymmetric presets load the second way.
    out = tmp_path / "x"
    assert main(["export", "--model", str(teacher_dir), "--quant", quant, "--format", "compressed-tensors",
                 "--out", str(out)]) == 0
    config = json.loads((out / "compressed-tensors" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    stored = load_file(str(out / "compressed-tensors" / "model.safetensors"))
    assert stored["model.layers.0.mlp.up_proj.weight_packed"].dtype == torch.int32
    student = build_student(StudentSpec(str(teacher_dir), quant), "eager").eval()
    ids = torch.randint(0, student.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    subprocess.run([sys.executable, "-c", CT_LOAD, str(out / "compressed-tensors"), str(tmp_path / "ids.safetensors"),
                    str(tmp_path / "out.safetensors"), mode], check=True, timeout=300)
    loaded = load_file(str(tmp_path / "out.safetensors"))
    layers = {n: m for n, m in student.named_modules() if isinstance(m, FakeQuantLinear)}
    for name, layer in layers.items():
        assert torch.equal(loaded[f"{name}.weight"], layer.quantized_weight()), name
    with torch.no_grad():
        expected = student(input_ids=ids).logits
    torch.testing.assert_close(loaded["logits"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quant", ["w3g64", "lut2g32", "q4_1", "w4g64-v8"])
def test_unsupported_presets_get_one_line_naming_the_alternatives(quant, teacher_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="--format gguf, packed or dense"):
        ExportConfig(model=str(teacher_dir), quant=quant, format="compressed-tensors")
    assert main(["export", "--model", str(teacher_dir), "--quant", quant, "--format", "compressed-tensors",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "w4g32" in err[0] and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_peft_adapter_beside_the_compressed_tensors_base_reproduces_the_student(teacher_dir, tmp_path):
    from conftest import save_random_adapter
    from qat_lora.train.student import load_student

    save_random_adapter(teacher_dir, "q4_0", tmp_path / "run-adapter", seed=1)
    out = tmp_path / "x"
    assert main(["export", "--model", str(teacher_dir), "--quant", "q4_0", "--adapter", str(tmp_path / "run-adapter"),
                 "--format", "compressed-tensors", "--out", str(out)]) == 0
    student = load_student(StudentSpec(str(teacher_dir), "q4_0"), str(tmp_path / "run-adapter"), "eager")
    ids = torch.randint(0, student.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    # PEFT wraps nn.Linear weights: the base is loaded decompressed (compressed modules have no weight until their
    # first forward); vLLM applies the same adapter files over its own int kernels.
    script = CT_LOAD.replace("\nids = ", "\nfrom peft import PeftModel\nmodel = PeftModel.from_pretrained(model, "
                                        "sys.argv[5]).eval()\nids = ")
    subprocess.run([sys.executable, "-c", script, str(out / "compressed-tensors"), str(tmp_path / "ids.safetensors"),
                    str(tmp_path / "out.safetensors"), "dequantize", str(out / "adapter")], check=True, timeout=300)
    with torch.no_grad():
        expected = student(input_ids=ids).logits
    torch.testing.assert_close(load_file(str(tmp_path / "out.safetensors"))["logits"], expected, rtol=1e-5, atol=1e-5)


def test_eval_reads_the_compressed_tensors_folder_as_the_student_it_came_from(teacher_dir, corpus_dir, tmp_path,
                                                                              capsys):
    # every command that takes --model loads the folder with its weights decompressed (models._dequantizing):
    # plain loading keeps packed modules without a weight, which crashed eval before
    out = tmp_path / "x"
    assert main(["export", "--model", str(teacher_dir), "--quant", "w4g64", "--format", "compressed-tensors",
                 "--out", str(out)]) == 0
    results = {}
    for name, flags in {"student": ["--model", str(teacher_dir), "--quant", "w4g64"],
                        "file": ["--model", str(out / "compressed-tensors"), "--quant", "none"]}.items():
        assert main(["eval", *flags, "--text", str(corpus_dir / "a.txt"), "--seq-len", "32", "--max-tokens", "256",
                     "--json-out", str(tmp_path / f"{name}.json")]) == 0
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert results["file"]["tokens"] == results["student"]["tokens"] > 0
    assert results["file"]["nll"] == pytest.approx(results["student"]["nll"], rel=1e-5)
    capsys.readouterr()


def test_eval_quant_none_with_a_runs_files_is_one_line(teacher_dir, corpus_dir, tmp_path, capsys):
    # --quant none means unquantised; an adapter or quantizer file needs its student's preset, so say so
    for flag in ("--adapter", "--quantizer"):
        assert main(["eval", "--model", str(teacher_dir), "--quant", "none", flag, str(tmp_path / "run"),
                     "--text", str(corpus_dir)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--quant none" in err[0] and "leave --quant out" in err[0], err


def test_a_compressed_tensors_folder_without_the_package_is_one_line(teacher_dir, corpus_dir, tmp_path, monkeypatch,
                                                                      capsys):
    import importlib.util

    out = tmp_path / "x"
    assert main(["export", "--model", str(teacher_dir), "--quant", "w4g64", "--format", "compressed-tensors",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "compressed_tensors" else find_spec(name, *a))
    assert main(["eval", "--model", str(out / "compressed-tensors"), "--text", str(corpus_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'qat-lora[ct]'" in err[0], err
