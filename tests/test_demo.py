"""`qat-lora demo` end to end on a tiny model and synthetic text (assets patched in: no network), its budgets and
its report: the table with bits per weight, demo.png, the student's paths and the commands that use it."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import qat_lora.data.assets
from qat_lora.data.assets import Assets
from qat_lora.commands import demo
from qat_lora.commands.cli import build_parser, config_from_args, main
from qat_lora.commands.config import DEMO_BUDGETS, DemoConfig
from qat_lora.commands.demo import run_demo

COMMANDS = ("chat", "generate", "eval", "export_gguf", "export_dense")


def _config(command: str):
    """The config the CLI builds from a printed `qat-lora ...` command: its checks run (files, flags, base)."""
    args = build_parser().parse_args(shlex.split(command)[1:])
    return config_from_args(args.config_class, args)


@pytest.mark.slow
def test_demo_runs_the_whole_chain_and_writes_results(tmp_path, teacher_dir, corpus_dir, monkeypatch, capsys):
    assets = Assets(root=tmp_path, teacher_dir=teacher_dir, train_text_dir=corpus_dir, eval_text=corpus_dir / "b.txt")
    monkeypatch.setattr(qat_lora.data.assets, "fetch_assets", lambda root=None, **_: assets)
    result = run_demo(DemoConfig(work_dir=str(tmp_path / "demo"), quant="w2g32", seq_len=32, num_samples=16,
                                 cache_tokens=6_000, eval_tokens=1_000, max_steps=5, batch_size=4, calib_sequences=32,
                                 device="cpu"))
    saved = json.loads((tmp_path / "demo" / "demo.json").read_text())
    assert [r["model"] for r in saved["rows"]] == ["teacher", "ptq", "gptq", "recovered"]
    assert all(r["ppl"] > 1 and r["tokens"] > 900 for r in saved["rows"])
    teacher, ptq, gptq, recovered = saved["rows"]
    assert gptq["kd_kl"] < ptq["kd_kl"] and recovered["kd_kl"] < gptq["kd_kl"]  # each stage adds recovery
    init = tmp_path / "demo" / "init-w2g32-gptq" / "quantizer.safetensors"
    run, = (tmp_path / "demo").glob("run-w2g32-gptq-*")  # named by its settings: a rerun resumes it
    assert json.loads((run / "config.json").read_text())["quantizer"] == str(init)
    # The cache holds 16 teacher draws per position (the default encoding): the teacher's own KL to them is the
    # draws' noise floor, not 0, and every student lies above it.
    assert (tmp_path / "demo" / "cache-L32-n16-6000" / "manifest.json").is_file()
    assert 0 < teacher["kd_kl"] < min(r["kd_kl"] for r in (ptq, gptq, recovered))
    assert saved["gap_recovered"] == result["gap_recovered"]
    # Bits per weight as shipped: the teacher in bf16 (it runs in fp32); w2g32's 2-bit codes + an fp16 scale and a
    # 2-bit zero per 32 weights = 2.5625; the adapter shipped unmerged adds its fp16 entries per quantised weight.
    assert teacher["bits_per_weight"] == 16 and ptq["bits_per_weight"] == gptq["bits_per_weight"] == 2.5625
    assert recovered["bits_per_weight"] == 2.5625 + recovered["adapter_bits_per_weight"] > 2.5625
    # Every path the student needs, recorded and there; the printed commands parse, pass their configs' checks,
    # and generate answers.
    student = saved["student"]
    assert student["quantizer"] == str(init) and student["model"] == str(teacher_dir)
    assert all(Path(student[key]).exists() for key in ("model", "quantizer", "adapter", "cache", "eval_text"))
    assert Path(saved["figure"]) == tmp_path / "demo" / "demo.png" and Path(saved["figure"]).stat().st_size > 0
    assert student["gguf_requantized_to"] == "Q8_0" and "--gguf-requantize" in student["commands"]["export_gguf"]
    for name in COMMANDS:
        _config(student["commands"][name])
    out, err = capsys.readouterr()
    assert all(f"[{i}/5] " in out for i in range(1, 6))  # one line per stage, saying what runs and why
    assert all(bar in err for bar in ("gptq init", "calibrated LoRA start", "train", "perplexity", "KD metrics"))
    assert "| model | bits/weight | Wikipedia ppl | KD KL | top-1 |" in out and "| teacher (smollm2-135m) | 16 |" in out
    last = out.rstrip().splitlines()[-6:]  # where the student is, then the commands that use it
    assert last[0].startswith("the recovered student: w2g32 over ") and str(init) in last[0]
    assert [line.split(":")[0].strip() for line in last[1:4]] == ["chat", "evaluate", "llama.cpp"]
    assert student["commands"]["chat"] in last[1] and student["commands"]["export_dense"] in last[-1]
    assert "lossy" in last[4]  # w2g32 has no llama.cpp type: the honest command re-quantises, and says so
    adapter_card = (Path(student["adapter"]) / "README.md").read_text()
    assert "w2g32" in adapter_card and str(init) in adapter_card  # the real base, not PEFT's template
    # (--raw: the stand-in tokenizer has no chat template; SmolLM2's and Gemma 3's have one)
    argv = shlex.split(student["commands"]["generate"])[1:] + ["--max-new-tokens", "3", "--device", "cpu", "--raw"]
    assert main(argv) == 0


def test_demo_rate_is_the_teachers_measured_one_scaled_to_the_rank():
    """SmolLM2's 2e-3 lost to the GPTQ init on Gemma 3 (5e-4 won there): the default follows the teacher."""
    assert DemoConfig().lr == 2e-3
    assert DemoConfig(teacher="gemma3-270m").lr == 5e-4
    assert DemoConfig(lora_r=64).lr == 5e-4 and DemoConfig(teacher="gemma3-270m", lora_r=64).lr == 1.25e-4
    assert DemoConfig(teacher="gemma3-270m", lr=3e-3).lr == 3e-3  # a rate the user gives is kept


def _demo_config(*argv: str) -> DemoConfig:
    return _config(shlex.join(["qat-lora", "demo", *argv]))


def test_budget_sets_the_flags_left_at_zero_and_typed_flags_win():
    keys = DEMO_BUDGETS["default"].keys()
    assert {k: getattr(_demo_config(), k) for k in keys} == DEMO_BUDGETS["default"]  # README's 12-minute demo
    assert {k: getattr(_demo_config("--budget", "quick"), k) for k in keys} == DEMO_BUDGETS["quick"]
    mixed = _demo_config("--budget", "quick", "--max-steps", "40")
    assert mixed.max_steps == 40 and mixed.cache_tokens == DEMO_BUDGETS["quick"]["cache_tokens"]
    assert DemoConfig(budget="quick", eval_tokens=512).eval_tokens == 512  # from Python too
    # Fewer steps from the calibrated start need a lower rate: a quarter of the teacher's, unless --lr says
    assert DemoConfig(budget="quick").lr == 5e-4 and _demo_config("--budget", "quick", "--lr", "2e-3").lr == 2e-3
    with pytest.raises(ValueError, match="--budget 'slow'"):
        DemoConfig(budget="slow")
    with pytest.raises(ValueError, match="--max-steps -1"):
        DemoConfig(max_steps=-1)


def test_commands_name_every_flag_of_the_student_and_keep_exact_gguf_presets_exact(tmp_path):
    record = demo.student_record(DemoConfig(quant="q4_0", work_dir=str(tmp_path)), "/m/teacher", "", "/w/run/adapter",
                                 "/w/cache", "/t/wiki.txt")
    assert record["quantizer"] is None and "no quantiser file" in record["base"]  # RTN: the preset's own init
    assert record["gguf_requantized_to"] is None and "--gguf-requantize" not in record["commands"]["export_gguf"]
    assert record["commands"]["chat"] == "qat-lora chat --model /m/teacher --quant q4_0 --adapter /w/run/adapter"
    spaced = demo.student_record(DemoConfig(work_dir=str(tmp_path), budget="quick"), "/m/my teacher",
                                 "/w/q.safetensors", "/w/a", "/w/c", "/t/w.txt")
    assert shlex.split(spaced["commands"]["eval"])[1:] == [  # as the table measured it
        "eval", "--model", "/m/my teacher", "--quant", "w3g64", "--quantizer", "/w/q.safetensors", "--adapter", "/w/a",
        "--text", "/t/w.txt", "--seq-len", "256", "--max-tokens", str(DEMO_BUDGETS["quick"]["eval_tokens"]),
        "--cache", "/w/c"]


def test_the_report_says_how_to_get_the_figure_when_matplotlib_is_missing(tmp_path, monkeypatch, capsys):
    import qat_lora.commands.plot as plot

    monkeypatch.setattr(plot, "_pyplot", lambda: (_ for _ in ()).throw(ValueError("plot: needs matplotlib")))
    table = [["model", "bits/weight"], ["teacher", "16"]]
    assert demo._figure(table, str(tmp_path), tmp_path) is None
    result = {"gap_recovered": 0.5, "wall_s": 60.0, "train": {"wall_s": 30.0, "tokens": 1_000}, "figure": None,
              "student": demo.student_record(DemoConfig(work_dir=str(tmp_path)), "/m", "", "/a", "/c", "/t")}
    demo._report(result, table, DemoConfig(), tmp_path)
    assert "no demo.png: matplotlib is missing (pip install matplotlib" in capsys.readouterr().out
