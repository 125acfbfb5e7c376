"""The TPU default step, compiled (issue 47, item 3): bf16 autocast around PEFT + FakeQuantLinear + the chunked
loss, on XLA:CPU, for recovery-lora, qat and FSDP with bf16 storage. Each preset's bf16 run compiles a bounded
set of graphs, none after step 2, runs no op on the CPU, and gives the fp32 step's loss within bf16 tolerance.
Each scenario in its own process (DESIGN §6: SPMD and the counters are process-wide)."""
from __future__ import annotations

import pytest

from helpers_xla import on_xla, require_torch_xla

require_torch_xla()

RUNS = """
import json, sys
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from qat_lora.runtime import xla
from qat_lora.train.config import TrainConfig
from qat_lora.train.launch import run

teacher, cache, out, chips, parallel, storage = sys.argv[1:7]
presets = sys.argv[7:]
report = {}
for preset in presets:
    for precision in ("fp32", "bf16"):
        met.clear_all()
        name = f"{preset}-{precision}"
        run(TrainConfig(model=teacher, cache=cache, quant="w2g32", preset=preset, out=f"{out}/{name}",
                        max_steps=5, batch_size=2, lora_r=4, warmup_steps=1, lr=1e-3, log_steps=1,
                        precision=precision, device="xla", num_chips=int(chips), parallel=parallel,
                        storage_dtype=storage if precision == "bf16" else "fp32"), log=lambda _: None)
        xm.wait_device_ops()
        losses = [json.loads(l)["loss"] for l in open(f"{out}/{name}/metrics.jsonl") if '"loss"' in l]
        report[name] = {**json.load(open(f"{out}/{name}/compile_report.json")), "losses": losses}
print(json.dumps(report))
"""


def _check(report: dict, presets: list[str]) -> None:
    for preset in presets:
        fp32, bf16 = report[f"{preset}-fp32"], report[f"{preset}-bf16"]
        assert bf16["cpu_fallback_ops"] == [], bf16
        assert 1 <= bf16["graphs_compiled"] <= 3 and bf16["graphs_compiled_after_step_2"] == 0, bf16
        # The first step's loss is the same model on the same batch: bf16 matmuls change it by well under 2 %.
        assert bf16["losses"][0] == pytest.approx(fp32["losses"][0], rel=2e-2), (fp32["losses"], bf16["losses"])
        assert bf16["losses"][0] != fp32["losses"][0]  # autocast really ran in bf16
        assert all(loss == loss and loss > 0 for loss in bf16["losses"]), bf16["losses"]


@pytest.mark.slow
@pytest.mark.xla
def test_bf16_autocast_step_compiles_once_with_no_cpu_fallback(teacher_dir, cache_dir, tmp_path):
    presets = ["recovery-lora", "qat"]
    report = on_xla(RUNS, str(teacher_dir), str(cache_dir), str(tmp_path), "1", "auto", "fp32", *presets,
                    cache_home=tmp_path / "home")
    _check(report, presets)


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_bf16_autocast_fsdp_with_bf16_storage_compiles_once_with_no_cpu_fallback(teacher_dir, cache_dir, tmp_path):
    report = on_xla(RUNS, str(teacher_dir), str(cache_dir), str(tmp_path), "2", "fsdp", "bf16", "recovery-lora",
                    devices=2, cache_home=tmp_path / "home")
    _check(report, ["recovery-lora"])
