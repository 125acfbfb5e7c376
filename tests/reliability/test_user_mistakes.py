"""Every mistake a user can make on the command line ends in one line on stderr naming the flag or file and the
fix, exit code 2, no traceback, and nothing written: missing required flags, bad values, paths that do not exist
or are the wrong kind. The checks run before any model loads (these cases take milliseconds)."""
from __future__ import annotations

from pathlib import Path

import pytest

from qat_lora.commands.cli import main

MISSING = [
    (["build-cache", "--data", "{corpus}", "--out", "{out}"], "--teacher is required"),
    (["build-cache", "--teacher", "{teacher}", "--out", "{out}"], "--data is required"),
    (["train", "--cache", "{cache}", "--out", "{out}"], "--model is required"),
    (["eval", "--text", "{corpus}", "--json-out", "{out}"], "--model is required"),
    (["eval", "--model", "{teacher}", "--json-out", "{out}"], "eval: pass --text (perplexity) and/or --cache"),
    (["export", "--out", "{out}"], "--model is required"),
    (["export", "--model", "{teacher}", "--out", "{out}"], "--quant is required for export"),
    (["quantize", "--cache", "{cache}", "--out", "{out}"], "--model is required"),
    (["quantize", "--model", "{teacher}", "--out", "{out}"], "--init gptq needs --cache"),
    (["recover", "--cache", "{cache}", "--out", "{out}"], "--model is required"),
    (["generate-data", "--data", "{corpus}", "--out", "{out}"], "--model is required"),
    (["generate-data", "--model", "{teacher}", "--out", "{out}"], "pass exactly one of --data"),
]

TRAIN = ["train", "--model", "{teacher}", "--cache", "{cache}", "--out", "{out}"]
BUILD = ["build-cache", "--teacher", "{teacher}", "--data", "{corpus}", "--out", "{out}"]
BAD_VALUES = [
    (TRAIN + ["--lr", "nan"], "--lr nan: must be positive"),
    (TRAIN + ["--lr", "-0.1"], "--lr -0.1: must be positive"),
    (TRAIN + ["--batch-size", "0"], "--batch-size 0: must be positive"),
    (TRAIN + ["--max-steps", "0"], "--max-steps 0: must be positive"),
    (TRAIN + ["--min-lr-ratio", "0"], "--min-lr-ratio 0.0: must be in (0, 1]"),
    (TRAIN + ["--preset", "lora"], "--preset 'lora': choose one of"),
    (TRAIN + ["--device", "gpu"], "--device 'gpu': choose one of"),
    (TRAIN + ["--num-chips", "-1"], "--num-chips -1: must be >= 0"),
    (TRAIN + ["--resume", "auto", "--overwrite"], "--resume and --overwrite exclude each other"),
    (TRAIN + ["--quant", "w5"], "unknown quantisation preset"),
    (BUILD + ["--seq-len", "0"], "--seq-len 0: must be positive"),
    (BUILD + ["--holdout-fraction", "1.5"], "--holdout-fraction 1.5: must be in [0, 1)"),
    (BUILD + ["--value-bits", "7"], "--value-bits 7"),
    (BUILD + ["--encoding", "zip"], "--encoding 'zip': choose sampled or topk"),
    (BUILD + ["--num-samples", "300"], "--num-samples 300: must be in [1, 255]"),
    (BUILD + ["--rank", "2", "--world-size", "2"], "--rank 2: must be in [0, --world-size 2)"),
    (BUILD + ["--dtype", "fp16"], "--dtype 'fp16': choose fp32 or bf16"),
    (BUILD + ["--text-encoding", "klingon"], "--text-encoding klingon: unknown encoding"),
    (BUILD + ["--text-errors", "shout"], "--text-errors shout: choose strict, replace or ignore"),
    (["eval", "--model", "{teacher}", "--text", "{corpus}", "--text-encoding", "klingon", "--json-out", "{out}"],
     "--text-encoding klingon: unknown encoding"),
    (["generate-data", "--model", "{teacher}", "--data", "{corpus}", "--top-p", "2", "--out", "{out}"],
     "--top-p 2.0: must be in (0, 1]"),
    (["generate-data", "--model", "{teacher}", "--data", "{corpus}", "--shard-samples", "5000", "--out", "{out}"],
     "--shard-samples 5000: at most 1000"),
    (["quantize", "--model", "{teacher}", "--cache", "{cache}", "--damp", "1", "--out", "{out}"],
     "--damp 1.0: must be in (0, 1)"),
    (["export", "--model", "{teacher}", "--quant", "w3g32", "--format", "onnx", "--out", "{out}"], "--format onnx"),
    (["recover", "--model", "{teacher}", "--cache", "{cache}", "--quant", "w2g32", "--qat", "full", "--out", "{out}"],
     "--qat 'full': choose one of"),
    (["demo", "--init", "best", "--work-dir", "{out}"], "--init 'best': choose one of"),
    (["demo", "--quant", "w5", "--work-dir", "{out}"], "unknown quantisation preset"),
    (["demo", "--encoding", "topk32", "--work-dir", "{out}"], "--encoding 'topk32': choose sampled or topk"),
    (["demo", "--num-samples", "0", "--work-dir", "{out}"], "--num-samples 0: must be in [1, 255]"),
]

WRONG_PATHS = [
    (["train", "--model", "./no-model", "--cache", "{cache}", "--out", "{out}"],
     "model ./no-model: no such model folder or .gguf file"),
    (["train", "--model", "{file}", "--cache", "{cache}", "--out", "{out}"], "a file, not a model"),
    (["train", "--model", "{teacher}", "--cache", "{out}-nope", "--out", "{out}"], "no manifest.json; build one"),
    (["train", "--model", "{teacher}", "--cache", "{teacher}", "--out", "{out}"], "no manifest.json; build one"),
    (["train", "--model", "{teacher}", "--cache", "{cache}", "--out", "{file}"], "is a file; pass a folder"),
    (["build-cache", "--teacher", "{teacher}", "--data", "{out}-nope", "--out", "{out}"],
     "-nope: no such file or folder"),
    (["quantize", "--model", "{teacher}", "--cache", "{cache}", "--out", "{file}"], "is a file; pass a folder"),
    (["recover", "--model", "{teacher}", "--cache", "{cache}", "--quant", "w2g32", "--out", "{file}"],
     "is a file; pass a folder"),
    (["export", "--model", "{teacher}", "--quant", "w3g32", "--out", "{file}"], "is a file; pass a folder"),
    (["generate-data", "--model", "{teacher}", "--data", "{corpus}", "--out", "{file}"], "is a file; pass a folder"),
    (["generate-data", "--model", "{teacher}", "--prompts", "{out}-nope.txt", "--out", "{out}"],
     "-nope.txt: no such file"),
    (["eval", "--model", "{teacher}", "--text", "{out}-nope.txt", "--json-out", "{out}"],
     "--text {out}-nope.txt: no such file or folder"),
    (["eval", "--model", "{teacher}", "--quant", "w2g32", "--adapter", "{out}-nope", "--text", "{corpus}",
      "--json-out", "{out}"], "no adapter_config.json; pass a run's adapter/ folder"),
    (["eval", "--model", "{teacher}", "--quant", "w2g32", "--quantizer", "{out}-nope", "--text", "{corpus}",
      "--json-out", "{out}"], "-nope: no such file; pass a qat run's quantizer.safetensors"),
    (["cache", "verify", "{out}"], "no manifest.json; build one"),
    (["cache", "inspect", "{file}"], "no manifest.json; build one"),
    (["cache", "merge", "{out}"], "no manifest-r*.json; run build-cache first"),
    (["plot", "{out}"], "metrics.jsonl not found; pass a run folder"),
]


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    """(exit code, stderr lines); an exception escaping main() is a traceback a user would see: a failure."""
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, [line for line in err.splitlines() if line.strip()]


@pytest.fixture
def paths(tmp_path, teacher_dir, cache_dir, corpus_dir) -> dict[str, str]:
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's file\n")
    return {"teacher": str(teacher_dir), "cache": str(cache_dir), "corpus": str(corpus_dir),
            "out": str(tmp_path / "out"), "file": str(notes)}


@pytest.mark.parametrize("argv, message", MISSING + BAD_VALUES + WRONG_PATHS,
                         ids=[" ".join(a[:1] + a[-2:]) + f" [{i}]" for i, (a, _) in
                              enumerate(MISSING + BAD_VALUES + WRONG_PATHS)])
def test_mistake_is_one_line_exit_2_and_writes_nothing(argv, message, paths, tmp_path, capsys):
    code, err = run_cli([a.format(**paths) for a in argv], capsys)
    command = argv[0]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"qat-lora {command}: error: ") and message.format(**paths) in err[0], err
    assert not Path(paths["out"]).exists() and Path(paths["file"]).read_text() == "the user's file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no stray folder or temp file either
