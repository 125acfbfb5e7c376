"""`qat-lora plot RUN_DIR`: the training loss and held-out eval curves of a run, drawn to a PNG; and the demo's
summary figure (its table beside the loss curve).

    qat-lora plot runs/w3g64            # writes runs/w3g64/curves.png
"""
from __future__ import annotations

import os
from pathlib import Path

from qat_lora.runtime.runs import METRICS_FILE, read_metrics

PLOT_FILE = "curves.png"


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw loss (train, and held-out when the run evaluated) and learning rate against the step.

    Returns:
        the PNG path (`RUN_DIR/curves.png` unless `out` is given).
    Raises:
        ValueError: no metrics, or matplotlib missing.
    """
    plt = _pyplot()
    if out and Path(out).is_dir():
        raise ValueError(f"plot --out {out}: is a folder; pass a file name such as {Path(out) / PLOT_FILE}")
    train, evals = read_metrics(run_dir)
    if not train and not evals:
        raise ValueError(f"plot: {Path(run_dir) / METRICS_FILE} holds no records yet")
    fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out KD loss")
    ax_loss.set(xlabel="step", ylabel="loss", title=Path(run_dir).name)
    ax_loss.legend()
    ax_lr.plot([r["step"] for r in train], [r["lr"] for r in train])
    ax_lr.set(xlabel="step", ylabel="learning rate")
    fig.tight_layout()
    return _save(plt, fig, Path(out) if out else Path(run_dir) / PLOT_FILE)


def plot_demo(table: list[list[str]], run_dir: str | Path, out: str | Path) -> Path:
    """The demo's figure: its results table (`table`: the header row, then one row of cells per model) beside
    the training loss of its run.

    Raises:
        ValueError: matplotlib missing.
    """
    plt = _pyplot()
    train, _ = read_metrics(run_dir)
    fig, (ax_table, ax_loss) = plt.subplots(1, 2, figsize=(13, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    ax_table.axis("off")
    cells = ax_table.table(cellText=table[1:], colLabels=table[0], loc="center", cellLoc="center")
    cells.auto_set_font_size(False)
    cells.set_fontsize(9)
    cells.auto_set_column_width(list(range(len(table[0]))))  # the model names whole
    cells.scale(1.0, 1.6)
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train])
    ax_loss.set(xlabel="step", ylabel="KD loss (train)", title="recovery LoRA")
    fig.tight_layout()
    return _save(plt, fig, Path(out))


def _pyplot():
    """matplotlib.pyplot drawing to files only (no display on servers and TPU VMs)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plot: needs matplotlib; pip install matplotlib") from None
    return plt


def _save(plt, fig, path: Path) -> Path:
    tmp = path.with_name(path.name + ".tmp")  # then renamed: a link at `path` is replaced, never written through
    fig.savefig(tmp, dpi=100, format=path.suffix.lstrip(".") or "png")
    os.replace(tmp, path)
    plt.close(fig)
    return path
