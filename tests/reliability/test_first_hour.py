"""What a new user meets in the first hour: scripts that say their own name, defaults and required flags, a
--version, builds that speak of ranks only when there are several, a warning for a useless held-out split, a
plain CPU run without torch_xla noise, eval progress, and a demo whose stop message names a command that works."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import qat_lora.data.assets
import qat_lora.train.trainer as train_module
from qat_lora import __version__
from qat_lora.data.assets import Assets
from qat_lora.commands.cli import main
from qat_lora.commands.config import DemoConfig
from qat_lora.commands.demo import run_demo

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {"build_kd_cache.py": "--teacher", "train_recovery_lora.py": "--model", "train_qat.py": "--model",
           "train_recovery_lora_multi.py": "--model", "eval_perplexity.py": "--model"}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_help_shows_its_name_true_defaults_required_flags_and_version(script):
    def run(*args):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})

    shown = run("--help")
    assert shown.returncode == 0 and shown.stdout.startswith(f"usage: {script} "), shown.stdout[:200]
    required = next(line for line in shown.stdout.splitlines() if line.strip().startswith(SCRIPTS[script] + " "))
    assert "(required)" in required and "(default: )" not in shown.stdout
    if script == "train_qat.py":  # this script trains the quantiser: its help says so, and it does
        assert "(default: qat)" in shown.stdout
    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"{script} {__version__}"


def test_qat_lora_version():
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0


@pytest.mark.slow
@pytest.mark.xla
def test_single_process_build_names_no_rank_warns_of_a_one_sequence_holdout_and_no_xla_noise(teacher_dir, corpus_dir,
                                                                                              tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "USE_TORCH_XLA")}
    argv = [sys.executable, "-m", "qat_lora", "build-cache", "--teacher", str(teacher_dir), "--data",
            str(corpus_dir), "--seq-len", "32", "--max-tokens", "300", "--holdout-fraction", "0.1", "--out",
            str(tmp_path / "cache"), "--device", "cpu"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**env, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rank" not in result.stdout, result.stdout
    assert ("warning: the held-out split holds 1 sequence(s) of 32 tokens, too few to measure anything; raise "
            "--holdout-fraction or --max-tokens") in result.stdout
    assert "PJRT" not in result.stderr and "torch_xla" not in result.stderr
    again = subprocess.run(argv + ["--resume"], capture_output=True, text=True, timeout=300,
                           env={**env, "PYTHONPATH": str(ROOT)})  # a preemption loop reruns a finished build
    assert again.returncode == 0 and "already complete; nothing to resume" in again.stdout


def test_eval_shows_progress(teacher_dir, corpus_dir, cache_dir, capsys):
    assert main(["eval", "--model", str(teacher_dir), "--text", str(corpus_dir), "--cache", str(cache_dir),
                 "--seq-len", "32", "--max-tokens", "300", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "perplexity: 100%" in err and "KD metrics (heldout): 100%" in err


@pytest.mark.slow
def test_demo_stopped_by_sigterm_names_a_command_that_continues_it(tmp_path, teacher_dir, corpus_dir, monkeypatch,
                                                                   capsys):
    assets = Assets(root=tmp_path, teacher_dir=teacher_dir, train_text_dir=corpus_dir, eval_text=corpus_dir / "b.txt")
    monkeypatch.setattr(qat_lora.data.assets, "fetch_assets", lambda root=None, **_: assets)
    cfg = DemoConfig(work_dir=str(tmp_path / "demo"), quant="w2g32", seq_len=32, encoding="topk", top_k=8,
                     cache_tokens=3_000,
                     eval_tokens=200, max_steps=4, batch_size=4, init="none", device="cpu")
    real, calls = train_module.forward_loss, {"n": 0}

    def preempted_at_step_2(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the cloud's preemption notice, in the middle of training
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "forward_loss", preempted_at_step_2)
    with pytest.raises(SystemExit) as stop:
        run_demo(cfg)
    out = capsys.readouterr().out
    stopped = next(line for line in out.splitlines() if line.startswith("stopped by SIGTERM"))
    assert stop.value.code == 143 and stopped.startswith("stopped by SIGTERM after step 2; checkpoint ")
    assert stopped.endswith("; rerun the same qat-lora demo command to continue (the cache, init and checkpoints are "
                            "kept)")  # not `--resume auto`, which demo does not take
    monkeypatch.setattr(train_module, "forward_loss", real)
    result = run_demo(cfg)  # the command it names: the same demo again
    assert "resumed from" in capsys.readouterr().out and result["train"]["steps"] == 4


def test_an_interrupted_single_process_build_says_how_to_continue_without_naming_a_rank(teacher_dir, corpus_dir,
                                                                                        tmp_path, capsys):
    out = tmp_path / "cache"
    argv = ["build-cache", "--teacher", str(teacher_dir), "--data", str(corpus_dir), "--seq-len", "32",
            "--max-tokens", "600", "--shard-sequences", "4", "--out", str(out), "--device", "cpu"]
    assert main(argv) == 0
    for name in ("manifest.json", "manifest-r000.json"):  # as a kill before the end of the build leaves it
        (out / name).unlink()
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (f"qat-lora build-cache: error: --out {out}: holds an unfinished build; "
                                               "pass --resume or --overwrite")
    assert main(argv + ["--resume"]) == 0 and main(["cache", "verify", str(out)]) == 0
