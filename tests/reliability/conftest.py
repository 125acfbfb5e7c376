"""What the reliability tests share: the training flags of their tiny runs and one finished run to damage."""
from __future__ import annotations

from pathlib import Path

import pytest

from qat_lora.commands.cli import main

TRAIN = ["--batch-size", "4", "--lora-r", "4", "--warmup-steps", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def run_w2(tmp_path_factory, teacher_dir, cache_dir) -> Path:
    """A finished 2-step recovery-lora run at w2g32: adapter/, config.json (which records --quant)."""
    out = tmp_path_factory.mktemp("runs") / "w2g32"
    assert main(["train", "--model", str(teacher_dir), "--cache", str(cache_dir), "--out", str(out), "--quant",
                 "w2g32", "--max-steps", "2", *TRAIN]) == 0
    return out
