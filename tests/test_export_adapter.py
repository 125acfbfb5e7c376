"""Deploying the recovery (issue 18, item 3): the adapter beside a base plain transformers loads, merged in full
precision, merged into the grid with a held-out verdict."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from qat_lora.commands.cli import main
from qat_lora.train.config import StudentSpec, TrainConfig
from qat_lora.export.exporter import load_packed
from qat_lora.train.student import load_student
from qat_lora.train.trainer import train

QUANT = "w3g32"


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory, teacher_dir, cache_dir) -> str:
    """A recovery adapter really trained on the tiny cache (it beats its quantised base on held-out KL)."""
    out = tmp_path_factory.mktemp("lora-run")
    summary = train(TrainConfig(model=str(teacher_dir), quant=QUANT, cache=str(cache_dir), out=str(out),
                                max_steps=30, batch_size=4, lr=1e-2, lora_r=8, lora_alpha=16.0, device="cpu"),
                    log=lambda _: None)
    return summary["adapter"]


def _ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


def _student_logits(teacher_dir, adapter, ids) -> torch.Tensor:
    student = load_student(StudentSpec(str(teacher_dir), QUANT), adapter, attn_implementation="eager")
    with torch.no_grad():
        return student(input_ids=ids).logits


# Runs without qat_lora: what a user of plain transformers + PEFT (or vLLM's loader) would do.
PLAIN_PEFT = """
import sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
from safetensors.torch import load_file, save_file
base, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, attn_implementation="eager",
                                                  output_loading_info=True)
assert not info["missing_keys"] and not info["unexpected_keys"], info
model = PeftModel.from_pretrained(base, sys.argv[2]).eval() if sys.argv[2] != "-" else base.eval()
with torch.no_grad():
    logits = model(input_ids=load_file(sys.argv[3])["ids"]).logits
assert not any(name.startswith("qat_lora") for name in sys.modules)
save_file({"logits": logits.contiguous()}, sys.argv[4])
"""


def _plain_logits(tmp_path, folder, adapter, ids) -> torch.Tensor:
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    subprocess.run([sys.executable, "-c", PLAIN_PEFT, str(folder), str(adapter), str(tmp_path / "ids.safetensors"),
                    str(tmp_path / "logits.safetensors")], check=True, timeout=180)
    return load_file(str(tmp_path / "logits.safetensors"))["logits"]


@pytest.mark.slow
def test_unmerged_adapter_loads_over_the_dense_base_with_plain_peft(teacher_dir, trained_adapter, tmp_path):
    # The bug: dense/ held PEFT's wrapped names (q_proj.base_layer.weight), so transformers re-initialised
    # every adapted linear at random and only warned. Now dense/ is the plain base and adapter/ is PEFT's.
    out = tmp_path / "e"
    assert main(["export", "--model", str(teacher_dir), "--quant", QUANT, "--adapter", trained_adapter,
                 "--out", str(out)]) == 0
    dense_keys = load_file(str(out / "dense" / "model.safetensors")).keys()
    assert not any("lora" in k or "base_layer" in k for k in dense_keys)
    ids = _ids(load_packed(out / "packed").config.vocab_size)
    expected = _student_logits(teacher_dir, trained_adapter, ids)
    assert torch.equal(_plain_logits(tmp_path, out / "dense", out / "adapter", ids), expected)
    from peft import PeftModel

    packed = PeftModel.from_pretrained(load_packed(out / "packed"), str(out / "adapter")).eval()
    with torch.no_grad():  # load_packed builds sdpa attention, the student here eager: rounding only
        torch.testing.assert_close(packed(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    report = json.loads((out / "export.json").read_text())
    assert set(report["folders"]) == {"packed", "dense", "adapter"}
    assert "PeftModel.from_pretrained" in report["folders"]["adapter"]


@pytest.mark.slow
def test_full_precision_merge_is_a_plain_folder_equal_to_the_student(teacher_dir, trained_adapter, cache_dir,
                                                                     tmp_path, capsys):
    out = tmp_path / "e"
    assert main(["export", "--model", str(teacher_dir), "--quant", QUANT, "--adapter", trained_adapter, "--merge-fp",
                 "--cache", str(cache_dir), "--format", "packed", "--out", str(out)]) == 0
    ids = _ids(load_packed(out / "packed").config.vocab_size)
    expected = _student_logits(teacher_dir, trained_adapter, ids)
    merged = _plain_logits(tmp_path, out / "merged-fp", "-", ids)
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)  # (Wq + BA) x vs Wq x + B(A x): rounding
    report = json.loads((out / "export.json").read_text())
    assert "NOT smaller" in report["folders"]["merged-fp"] and "NOT smaller" in capsys.readouterr().out
    verdict = report["adapter"]["merge_fp"]
    assert verdict["good"] and verdict["recovery_kept"] == pytest.approx(1.0, abs=0.02)


@pytest.mark.slow
def test_grid_merge_reports_the_recovery_it_loses(teacher_dir, trained_adapter, cache_dir, tmp_path, capsys):
    out = tmp_path / "e"
    assert main(["export", "--model", str(teacher_dir), "--quant", QUANT, "--adapter", trained_adapter,
                 "--merge-adapter", "--cache", str(cache_dir), "--format", "packed", "--out", str(out)]) == 0
    adapter = json.loads((out / "export.json").read_text())["adapter"]
    base, student = adapter["heldout"]["base"], adapter["heldout"]["student"]
    assert student["kd_kl"] < base["kd_kl"] and student["ppl"] > 1  # the adapter really recovered (KL to the teacher)
    merge = adapter["merge"]
    from qat_lora.export.merge import heldout_metrics

    measured = heldout_metrics(load_packed(out / "packed"), str(cache_dir), 4)  # the exported file, reloaded
    assert merge["merged"]["kd_kl"] == pytest.approx(measured["kd_kl"], rel=1e-9)
    kept = (base["kd_kl"] - measured["kd_kl"]) / (base["kd_kl"] - student["kd_kl"])
    assert merge["recovery_kept"] == pytest.approx(kept, rel=1e-9)
    # 30 steps of LoRA move each weight far less than a 3-bit step: re-quantisation snaps most of it back
    assert merge["requant_rel_error"] > 0.5 and not merge["good"] and kept < 0.5
    assert "WARNING --merge-adapter: keeps only" in capsys.readouterr().out


def test_grid_merge_without_a_cache_warns_from_the_requantisation_error(teacher_dir, trained_adapter, tmp_path,
                                                                         capsys):
    out = tmp_path / "e"
    assert main(["export", "--model", str(teacher_dir), "--quant", QUANT, "--adapter", trained_adapter,
                 "--merge-adapter", "--format", "packed", "--out", str(out)]) == 0
    assert "pass --cache to measure it" in capsys.readouterr().out


@pytest.mark.slow
def test_resnap_stage_trains_the_merged_grid_back_toward_the_recovery(teacher_dir, trained_adapter, cache_dir,
                                                                    tmp_path):
    from qat_lora.export.merge import heldout_metrics, merge_lora_

    out = tmp_path / "e"
    assert main(["export", "--model", str(teacher_dir), "--quant", QUANT, "--adapter", trained_adapter,
                 "--merge-adapter", "--cache", str(cache_dir), "--resnap-steps", "30",
                 "--format", "packed", "--out", str(out)]) == 0
    adapter = json.loads((out / "export.json").read_text())["adapter"]
    merge = adapter["merge"]
    assert merge["resnap"]["preset"] == "weight-qat" and (out / "resnap" / "run" / "summary.json").exists()
    assert not (out / "resnap" / "model").exists()  # the full-precision working copy is not left behind
    exported = heldout_metrics(load_packed(out / "packed"), str(cache_dir), 4)  # the low-bit file, reloaded
    assert merge["merged"]["kd_kl"] == pytest.approx(exported["kd_kl"], rel=1e-9)
    grid_only, _ = merge_lora_(load_student(StudentSpec(str(teacher_dir), QUANT), trained_adapter))
    plain_merge = heldout_metrics(grid_only, str(cache_dir), 4)
    assert exported["kd_kl"] < plain_merge["kd_kl"]  # the re-snap won back what re-quantisation erased
    base, student = adapter["heldout"]["base"]["kd_kl"], adapter["heldout"]["student"]["kd_kl"]
    assert merge["recovery_kept"] == pytest.approx((base - exported["kd_kl"]) / (base - student), rel=1e-9)
    assert merge["recovery_kept"] > (base - plain_merge["kd_kl"]) / (base - student)


def test_resnap_needs_the_merge_and_a_cache():
    from qat_lora.export.config import ExportConfig

    with pytest.raises(ValueError, match="--resnap-steps needs --merge-adapter and --cache"):
        ExportConfig(model="m", quant=QUANT, adapter="a", merge_adapter=True, resnap_steps=10)
    with pytest.raises(ValueError, match="--resnap-preset 'recovery-lora'"):
        ExportConfig(model="m", quant=QUANT, resnap_preset="recovery-lora")
