"""`qat-lora recover --budget-bits B`: the preset and LoRA rank chosen on the model's shapes ship within B bits per
quantised weight, base + unmerged adapter, as measured on the built student."""
from __future__ import annotations

import json

import pytest
import torch

from qat_lora.commands.budget import BUDGET_PRESETS, base_bits, choose_budget
from qat_lora.commands.cli import main
from qat_lora.commands.config import RecoverConfig, lora_probe_rates
from qat_lora.data import models

QUIET = dict(log=lambda _: None)

# The tiny teacher of conftest.make_model_dir (Llama, hidden 64, MLP 128, 4 heads of 16, 2 KV heads, 2 layers):
# (out, in) of each decoder layer's linears, counted here by hand, independently of the code under test.
LAYER = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
         "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64),
         "mlp.down_proj": (64, 128)}
SHAPES = [shape for _ in range(2) for shape in LAYER.values()]
WEIGHTS = sum(m * n for m, n in SHAPES)


def _base(bits: int, group: int | None, v8: bool = False, fp8: bool = False) -> float:
    """An asymmetric int preset: `bits` per code, an fp16 scale and a `bits`-wide zero per group (per channel: a
    row's width); `v8`: v_proj (the second 32 x 64 layer of each block) at 8 bits per channel instead; `fp8`: the
    group scales in 8 bits, and one 8-bit exponent per layer."""
    def layer(index: int, m: int, n: int) -> int:
        if v8 and index % len(LAYER) == 2:
            return 8 * m * n + (16 + 8) * m
        g = n if group is None else group
        return bits * m * n + ((8 if fp8 else 16) + bits) * m * n // g + (8 if fp8 else 0)
    return sum(layer(i, m, n) for i, (m, n) in enumerate(SHAPES)) / WEIGHTS


def _adapter(r: int) -> float:
    return 16 * r * sum(m + n for m, n in SHAPES) / WEIGHTS


BASES = {"w2g64": _base(2, 64), "w3g64": _base(3, 64), "w4g64": _base(4, 64), "w8pc": _base(8, None),
         "w2g64-v8": _base(2, 64, v8=True), "w3g64-v8": _base(3, 64, v8=True), "w4g64-v8": _base(4, 64, v8=True),
         "w2g32-v8": _base(2, 32, v8=True, fp8=True), "w3g32-v8": _base(3, 32, v8=True, fp8=True)}


def test_the_tiny_teachers_shapes_come_from_its_config(teacher_dir):
    shapes = models.linear_shapes(teacher_dir)
    expected = {f"model.layers.{i}.{name}": shape for i in range(2) for name, shape in LAYER.items()}
    assert shapes == {**expected, "lm_head": (shapes["lm_head"][0], 64)}
    assert torch.empty(1).device.type == "cpu"  # the meta device stayed inside linear_shapes


@pytest.mark.parametrize("preset", [*BUDGET_PRESETS, "q4_k", "w4g32", "lut3g64"])
def test_base_bits_from_the_shapes_are_those_of_the_built_student(preset, teacher_dir):
    from qat_lora.quant.fake_quant import quantize_
    from qat_lora.quant.state import bits_per_weight

    student = quantize_(models.load_causal_lm(teacher_dir), preset)  # q4_k: every layer its 32-block fallback
    assert base_bits(preset, models.linear_shapes(teacher_dir))[0] == pytest.approx(bits_per_weight(student),
                                                                                    rel=1e-12)
    if preset in BASES:
        assert base_bits(preset, models.linear_shapes(teacher_dir))[0] == pytest.approx(BASES[preset], rel=1e-12)


@pytest.mark.parametrize("budget, preset, rank", [
    (2.28125, "w2g64", None),  # exactly the smallest base, nothing left
    (2.5, "w2g64", None),  # w2g64-v8 (2.62) does not fit
    (2.63, "w2g64-v8", None),  # the mix with more bits; w2g32-v8 (2.65) does not fit
    (3.0, "w2g32-v8", None),  # groups of 32 with fp8 scales, the most bits under 3, and no room for an adapter
    (8.1, "w4g64-v8", 8),  # w8pc (8.33) does not fit; 3.56 bits left hold r8 (3.56)
    (8.5, "w8pc", None),  # the most code bits win over an adapter
    (15.6, "w8pc", 16),
    (100.0, "w8pc", 32),  # r64 is wider than the 32-row k_proj / v_proj: never chosen on this model
])
def test_the_chooser_takes_the_widest_base_then_the_largest_rank_that_fit(budget, preset, rank, teacher_dir):
    choice = choose_budget(budget, models.linear_shapes(teacher_dir))
    assert (choice.preset, choice.lora_r) == (preset, rank)
    assert choice.base_bits == pytest.approx(BASES[preset], rel=1e-12)
    assert choice.adapter_bits == pytest.approx(_adapter(rank) if rank else 0.0, rel=1e-12)
    assert choice.total_bits <= budget
    bigger = [r for r in (64, 32, 16, 8) if r <= 32 and (rank is None or r > rank)]
    assert all(BASES[preset] + _adapter(r) > budget for r in bigger)  # no larger rank would have fit


def test_a_total_exactly_at_the_budget_fits():
    shapes = {"model.layers.0.mlp.up_proj": (1024, 1024)}  # r64: 16 * 64 * 2048 / 1024**2 = 2 bits exactly
    choice = choose_budget(6.3125, shapes)  # w4g64: 4 + (16 + 4) / 64
    assert (choice.preset, choice.lora_r, choice.total_bits) == ("w4g64", 64, 6.3125)
    assert choose_budget(6.31, shapes).lora_r == 32


def test_a_budget_below_every_base_is_one_line_naming_the_smallest(teacher_dir, cache_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"--budget-bits 2.2: below the smallest this model ships at, w2g64's "
                                         r"2.2812 bits per weight; pass --budget-bits 2.2813 or more"):
        choose_budget(2.2, models.linear_shapes(teacher_dir))
    out = tmp_path / "run"
    assert main(["recover", "--model", str(teacher_dir), "--cache", str(cache_dir), "--out", str(out),
                 "--budget-bits", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["qat-lora recover: error: --budget-bits 2: below the smallest this model ships at, w2g64's "
                   "2.2812 bits per weight; pass --budget-bits 2.2813 or more"]
    assert not out.exists()  # refused before --out is made


@pytest.mark.parametrize("flags", [["--quant", "w3g64"], ["--quant", "w2g64"], ["--lora-r", "16"],
                                   ["--lora-r", "8", "--quant", "w4g64"]])
def test_budget_with_quant_or_rank_is_refused(flags, teacher_dir, cache_dir, tmp_path, capsys):
    argv = ["recover", "--model", str(teacher_dir), "--cache", str(cache_dir), "--out", str(tmp_path / "r"),
            "--budget-bits", "4", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("pass --budget-bits or --quant/--lora-r, not both")
    assert not (tmp_path / "r").exists()


def test_budget_flag_checks(teacher_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="pass --budget-bits or --quant/--lora-r, not both"):  # from Python too
        RecoverConfig(model=str(teacher_dir), budget_bits=4.0, quant="w2g64")
    RecoverConfig(model=str(teacher_dir), budget_bits=4.0, quant="w3g64")  # the default: the budget chooses
    for value in ("-1", "nan", "inf"):
        assert main(["recover", "--model", str(teacher_dir), "--budget-bits", value]) == 2
        assert capsys.readouterr().err.startswith(f"qat-lora recover: error: --budget-bits {float(value)}: must be")
    # a budget with no room for an adapter runs qat, so its flags are not refused as unused
    assert main(["recover", "--model", str(teacher_dir), "--budget-bits", "2", "--qat-steps", "3", "--qat-lr",
                 "1e-3", "--out", str(tmp_path / "r")]) == 2
    assert "below the smallest" in capsys.readouterr().err


def test_the_budget_resolves_into_the_flags_the_stages_run_with(teacher_dir, cache_dir, tmp_path):
    from qat_lora.commands.recover import _resolve_budget

    base = dict(model=str(teacher_dir), cache=str(cache_dir), out=str(tmp_path / "r"))
    cfg, record = _resolve_budget(RecoverConfig(**base, budget_bits=8.1), **QUIET)
    assert (cfg.quant, cfg.lora_r, cfg.lora_steps, cfg.qat, cfg.budget_bits) == ("w4g64-v8", 8, 200, "none", 0.0)
    assert cfg.lr == lora_probe_rates(8)  # the default probe at the chosen rank, not at --lora-r's default
    assert record["preset"] == "w4g64-v8" and record["lora_r"] == 8 and record["bits"] == 8.1
    cfg, record = _resolve_budget(RecoverConfig(**base, budget_bits=3.0, qat_steps=7), **QUIET)
    assert (cfg.quant, cfg.lora_steps, cfg.qat, cfg.qat_steps, record["lora_r"]) == ("w2g32-v8", 0, "qat", 7, None)
    assert cfg.qat_lr == 1e-3  # the chosen preset's rate (2 bits), not the default --quant's
    cfg, _ = _resolve_budget(RecoverConfig(**base, budget_bits=100.0, lora_steps=0), **QUIET)  # no adapter asked
    assert (cfg.quant, cfg.lora_steps, cfg.qat, cfg.qat_lr) == ("w8pc", 0, "qat", 2e-4)
    cfg, _ = _resolve_budget(RecoverConfig(**base, budget_bits=3.0, qat="weight-qat"), **QUIET)  # as typed
    assert (cfg.quant, cfg.lora_steps, cfg.qat) == ("w2g32-v8", 0, "weight-qat")
    assert _resolve_budget(RecoverConfig(**base, quant="w3g64"), **QUIET)[1] is None  # no budget: as typed


def test_recover_with_a_budget_ships_within_it(teacher_dir, cache_dir, tmp_path, capsys):
    from qat_lora.quant.state import bits_per_weight
    from qat_lora.train.config import StudentSpec
    from qat_lora.train.student import adapter_bits_per_weight, load_student

    out = tmp_path / "run"
    argv = ["recover", "--model", str(teacher_dir), "--cache", str(cache_dir), "--out", str(out),
            "--budget-bits", "8.1", "--calib-sequences", "16", "--lora-steps", "2", "--lr", "1e-3",
            "--lora-init", "zero", "--save-steps", "0", "--device", "cpu"]
    assert main(argv) == 0
    assert "budget 8.1 bits per weight: w4g64-v8 4.5382 + LoRA r8 3.5556 = 8.0938" in capsys.readouterr().out
    summary = json.loads((out / "recover.json").read_text())
    budget = summary["budget"]
    assert {k: budget[k] for k in ("bits", "preset", "lora_r")} == {"bits": 8.1, "preset": "w4g64-v8", "lora_r": 8}
    assert summary["config"]["quant"] == "w4g64-v8" and summary["config"]["lora_r"] == 8
    assert json.loads((out / "lora" / "config.json").read_text())["lora_r"] == 8
    student = load_student(StudentSpec(str(teacher_dir), "w4g64-v8", summary["quantizer"]), summary["adapter"])
    base, adapter = bits_per_weight(student), adapter_bits_per_weight(student)
    assert base == pytest.approx(budget["base_bits"], rel=1e-12)
    assert adapter == pytest.approx(budget["adapter_bits"], rel=1e-12) and adapter > 0
    assert base + adapter == pytest.approx(budget["total_bits"], rel=1e-12) and base + adapter <= 8.1
