"""Block-wise reconstruction (qat_lora/quant/blockwise.py, EfficientQAT Block-AP).

The stage must (a) lower every block's reconstruction error and the student's held-out KD loss, (b) touch
nothing but the decoder blocks' quantised weights and quantisers, (c) leave weights on the grid, so the
exported quantiser state rebuilds the same student, and (d) resume from saved blocks bit for bit.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from qat_lora.data import models
from qat_lora.quant.blockwise import BLOCK_FILE, PROGRESS_FILE, reconstruct_blocks_
from qat_lora.cache.reader import KDCache
from qat_lora.train.config import StudentSpec
from qat_lora.train.metrics import kd_metrics
from qat_lora.quant.calibration import calibration_batches
from qat_lora.quant.fake_quant import FakeQuantLinear, QuantConfig, get_preset, quantize_
from qat_lora.quant.state import quantizer_state_dict, save_quantizer_state
from qat_lora.train.student import build_student

SETTINGS = dict(steps=40, lr_weights=1e-3, lr_quant=1e-3, batch_size=4)
QUIET = dict(log=lambda _: None)


def _student(model_dir, preset: str = "w2g32"):
    return quantize_(models.load_causal_lm(model_dir), get_preset(preset))


def _heldout_soft_ce(model, cache_dir) -> float:
    return kd_metrics(model.eval(), KDCache(cache_dir), 8, torch.device("cpu"))["kd_soft_ce"]


def _fake_quant(model) -> dict[str, FakeQuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # A 64-wide model gains nothing from more threads, and on a busy 2-core host their spin-waits cost ~4x.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def batches(cache_dir) -> list[torch.Tensor]:
    return calibration_batches(str(cache_dir), 16, 4)  # training split, 16 x 32 tokens


@pytest.fixture(scope="module")
def reconstructed(teacher_dir, cache_dir, batches):
    """(RTN student's held-out soft CE, its parameters and requires_grad flags, the reconstructed student, the
    stage's report)."""
    student = _student(teacher_dir)
    rtn_soft_ce = _heldout_soft_ce(student, cache_dir)
    before = {n: (p.detach().clone(), p.requires_grad) for n, p in student.named_parameters()}
    report = reconstruct_blocks_(student, models.load_causal_lm(teacher_dir), batches, **SETTINGS, **QUIET)
    return rtn_soft_ce, before, student, report


def test_every_block_and_the_heldout_kd_loss_improve(reconstructed, cache_dir):
    rtn_soft_ce, _, student, report = reconstructed
    assert [b["index"] for b in report["blocks"]] == [0, 1] and report["seconds"] > 0
    for block in report["blocks"]:
        assert block["loss_after"] < block["loss_before"], block
    assert _heldout_soft_ce(student, cache_dir) < rtn_soft_ce


def test_only_the_quantised_weights_and_quantisers_change(reconstructed):
    _, before, student, _ = reconstructed
    trained = {f"{n}.{k}" for n, m in _fake_quant(student).items() for k in ("weight", *m.quant_parameters())}
    assert trained and all(n.startswith("model.layers.") for n in trained)
    for name, p in student.named_parameters():
        if name not in trained:  # embeddings, norms, lm_head
            assert torch.equal(p, before[name][0]), name
        assert p.requires_grad == before[name][1], name  # the caller's flags are restored
    assert all(not torch.equal(m.weight, before[f"{n}.weight"][0]) for n, m in _fake_quant(student).items())


def test_weights_end_on_the_grid_and_the_export_rebuilds_the_same_student(reconstructed, teacher_dir, tmp_path):
    _, _, student, _ = reconstructed
    path = tmp_path / "quantizer.safetensors"
    save_quantizer_state(student, path, codes=True)
    rebuilt = _fake_quant(build_student(StudentSpec(str(teacher_dir), "w2g32", str(path))))
    for name, module in _fake_quant(student).items():
        assert torch.equal(module.weight, module.quantized_weight()), name  # snapped: latent == Wq
        assert torch.equal(rebuilt[name].quantized_weight(), module.quantized_weight()), name


def test_a_resumed_run_equals_an_uninterrupted_one(teacher_dir, batches, tmp_path):
    teacher = models.load_causal_lm(teacher_dir)
    whole = _student(teacher_dir)
    reconstruct_blocks_(whole, teacher, batches, **SETTINGS, state_dir=tmp_path / "whole", **QUIET)

    def crash_after_block_0(message: str) -> None:
        if message.startswith("block 0:"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        reconstruct_blocks_(_student(teacher_dir), teacher, batches, **SETTINGS, state_dir=tmp_path / "cut",
                            log=crash_after_block_0)
    assert (tmp_path / "cut" / BLOCK_FILE.format(index=0)).exists()
    assert not (tmp_path / "cut" / BLOCK_FILE.format(index=1)).exists()
    resumed = _student(teacher_dir)
    report = reconstruct_blocks_(resumed, teacher, batches, **SETTINGS, state_dir=tmp_path / "cut", **QUIET)
    assert [b["resumed"] for b in report["blocks"]] == [True, False]
    expected, got = quantizer_state_dict(whole, codes=True), quantizer_state_dict(resumed, codes=True)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), resumed.parameters()))
    # the block files are slices of the final state under its own names: merging them is a dict update
    merged = {k: v for i in (0, 1) for k, v in load_file(str(tmp_path / "cut" / BLOCK_FILE.format(index=i))).items()}
    assert merged.keys() == expected.keys() and all(torch.equal(merged[k], expected[k]) for k in merged)
    progress = json.loads((tmp_path / "cut" / PROGRESS_FILE).read_text())
    assert [b["index"] for b in progress["blocks"]] == [0, 1]
    with pytest.raises(ValueError, match="other settings \\(lr_weights\\)"):
        reconstruct_blocks_(_student(teacher_dir), teacher, batches, **{**SETTINGS, "lr_weights": 5e-4},
                            state_dir=tmp_path / "cut", **QUIET)
    with pytest.raises(ValueError, match="other settings \\(grids, start\\)"):  # same shapes, another grid
        reconstruct_blocks_(_student(teacher_dir, "w3g32"), teacher, batches, **SETTINGS,
                            state_dir=tmp_path / "cut", **QUIET)
    other_start = _student(teacher_dir)  # e.g. another data-aware init of the same preset
    with torch.no_grad():
        next(iter(_fake_quant(other_start).values())).scale.mul_(1.01)
    with pytest.raises(ValueError, match="other settings \\(start\\)"):
        reconstruct_blocks_(other_start, teacher, batches, **SETTINGS, state_dir=tmp_path / "cut", **QUIET)


@pytest.mark.parametrize("preset", ["w2g32", "lut2g32"])
def test_qwen3_int_and_lut_blocks_improve_and_stay_on_the_grid(preset, qwen3_dir, batches):
    student = _student(qwen3_dir, preset)
    codebooks = {n: m.codebook.detach().clone() for n, m in _fake_quant(student).items() if preset.startswith("lut")}
    report = reconstruct_blocks_(student, models.load_causal_lm(qwen3_dir), batches, **SETTINGS, **QUIET)
    for block in report["blocks"]:
        assert block["loss_after"] < block["loss_before"], block
    for name, module in _fake_quant(student).items():
        assert torch.equal(module.weight, module.quantized_weight()), name
        assert torch.equal(module.dequantize_codes(module.codes()), module.quantized_weight()), name
    assert all(not torch.equal(m.codebook, codebooks[n]) for n, m in _fake_quant(student).items() if codebooks)


@pytest.mark.parametrize("calibration, batch_size, message", [
    ([torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long)], 2, "one length L"),
    ([], 2, "one length L"),
    ([torch.zeros(2, 8, dtype=torch.long)], 4, "batch_size=4 with 2 calibration sequences"),
])
def test_bad_calibration_is_a_one_line_error(calibration, batch_size, message, teacher_dir):
    teacher = models.load_causal_lm(teacher_dir)
    with pytest.raises(ValueError, match=message):
        reconstruct_blocks_(_student(teacher_dir), teacher, calibration, **{**SETTINGS, "batch_size": batch_size},
                            **QUIET)


def test_students_the_stage_cannot_reconstruct_are_one_line_errors(teacher_dir, batches):
    teacher = models.load_causal_lm(teacher_dir)
    with pytest.raises(ValueError, match="hold no FakeQuantLinear; run quantize_"):
        reconstruct_blocks_(models.load_causal_lm(teacher_dir), teacher, batches, **SETTINGS, **QUIET)
    low_rank = quantize_(models.load_causal_lm(teacher_dir), QuantConfig(bits=2, group_size=32, scale_rank=2))
    with pytest.raises(ValueError, match="scale_rank > 0"):
        reconstruct_blocks_(low_rank, teacher, batches, **SETTINGS, **QUIET)


def test_a_block_that_training_makes_worse_keeps_its_start(teacher_dir, batches):
    # An absurd weight learning rate throws every block off its teacher: each must come back as it started.
    student, start = _student(teacher_dir), _student(teacher_dir)
    report = reconstruct_blocks_(student, models.load_causal_lm(teacher_dir), batches,
                                 **{**SETTINGS, "steps": 5, "lr_weights": 10.0}, **QUIET)
    assert all(b["reverted"] and b["loss_after"] == pytest.approx(b["loss_before"], rel=1e-6)
               for b in report["blocks"])
    for name, module in _fake_quant(student).items():
        assert torch.equal(module.quantized_weight(), _fake_quant(start)[name].quantized_weight())
