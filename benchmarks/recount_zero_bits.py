"""Recount the bits per weight of earlier results with integer zero points at the codes' width (issue 48).

Until 2026-12-06 every quantiser tensor counted 16 bits, an integer zero point included, though it is one code of
the grid: the packed export (format 2) now stores it at the codes' width, as compressed-tensors and GPTQ
checkpoints do, and `quant.state.bits_per_weight` counts it so. This rewrites `bits_per_weight` of each record in
the given results files that was counted the old way (the old figure kept as `bits_per_weight_fp16_zeros`), then
the file's markdown table and frontier plot where they were drawn:

    python benchmarks/recount_zero_bits.py docs/results/*.json

Counted on SmolLM2-135M's shapes: a grouped preset loses (16 - b) / g bits on any model (one zero per group of g);
a preset with per-channel layers is recounted on SmolLM2 records only. Records counted the new way already, or
whose figure matches neither count, are left as they are (printed).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery  # noqa: E402  (the results files' own reader, table and plots)

from qat_lora.commands.budget import base_bits  # noqa: E402
from qat_lora.data import models  # noqa: E402
from qat_lora.quant.config import get_preset  # noqa: E402
from qat_lora.runtime.files import atomic_write_json  # noqa: E402


def zero_bits_saved(preset: str, shapes: dict[str, tuple[int, int]]) -> float:
    """Bits per quantised weight that counting integer zeros at their width saves on linears of these shapes (a
    grouped preset's figure is the same on every model its groups divide: one zero per group)."""
    cfg, saved, weights = get_preset(preset), 0, 0
    for name, (out_features, in_features) in shapes.items():
        layer = cfg.for_module(name)
        if layer is None:
            continue
        layer, group = layer.for_layer(in_features)
        if layer.scheme == "int" and layer.zero_domain == "int":  # "none" counted 0 bits, "float" stays fp16
            saved += (16 - layer.bits) * out_features * (in_features // group)
        weights += out_features * in_features
    return saved / weights


def recount(path: Path, shapes: dict[str, tuple[int, int]]) -> int:
    results = recovery.load_results(path)
    changed = 0
    for record in results["records"]:
        preset, bits = record.get("preset"), record.get("bits_per_weight")
        if not preset or bits is None or "bits_per_weight_fp16_zeros" in record:
            continue
        cfg = get_preset(preset)
        per_channel = any(c.group_size is None for c in (cfg, *dict(cfg.overrides).values()))
        if per_channel and "gemma" in path.name:  # records name no model; only the Gemma files hold another one
            print(f"{path}: {record['key']}: a per-channel grid on another model; left as it is")
            continue
        saved, new = zero_bits_saved(preset, shapes), base_bits(preset, shapes)[0]
        if not saved or abs(bits - new) < 1e-3:
            continue  # no integer zero, or counted the new way already
        if abs(bits - (new + saved)) > 1e-3:
            print(f"{path}: {record['key']}: {bits} is neither count of {preset}; left as it is")
            continue
        record["bits_per_weight_fp16_zeros"] = bits
        record["bits_per_weight"] = round(bits - saved, 4)
        changed += 1
    if changed:
        atomic_write_json(path, results)
        if path.with_suffix(".md").exists():
            recovery.write_markdown(path, results["records"])
        frontier = path.with_name(path.stem + "_frontier.png")
        if frontier.exists():
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            recovery.plot_frontier(plt, results["records"], frontier)
    print(f"{path}: {changed} records recounted")
    return changed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="results files (recovery.py's --json)")
    args = p.parse_args(argv)
    shapes = models.linear_shapes("smollm2-135m")
    for path in args.files:
        data = json.loads(path.read_text()) if path.suffix == ".json" else None
        if isinstance(data, dict) and isinstance(data.get("records"), list):
            recount(path, shapes)


if __name__ == "__main__":
    main()
