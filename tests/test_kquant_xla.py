"""The K-quant and fp8-scaled (two-level scales) fake-quant forward and backward on XLA:CPU, held to torch_xla's counters: after the first steps no
graph compiles, nothing falls back to the CPU and nothing leaves the device (no .item(), no branch on values,
static shapes), and the XLA Wq equals the CPU one. Its own subprocess: the counters are process-wide."""
from __future__ import annotations

import pytest
from helpers_xla import on_xla, require_torch_xla

require_torch_xla()

STEPS = """
import json
import torch, torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch import nn
from qat_lora.runtime import xla
from qat_lora.quant.fake_quant import FakeQuantLinear, get_preset

report = {}
for preset in ("q2_k", "q3_k", "q4_k", "q6_k", "w3g32-v8", "w2g32-v8"):
    torch.manual_seed(0)
    layer = FakeQuantLinear.from_linear(nn.Linear(512, 32, bias=False), get_preset(preset))
    cpu_wq = layer.quantized_weight().detach().clone()
    device = torch_xla.device()
    layer = layer.to(device)
    params = [layer.weight, *layer.quant_parameters().values()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    x = torch.randn(8, 512).to(device)
    counters = {}
    for step in range(5):
        if step == 2:
            xm.wait_device_ops()
            met.clear_all()
        loss = layer(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
    xm.wait_device_ops()
    counters = xla.compile_metrics()
    layer_cpu = layer.to("cpu")
    report[preset] = {**counters, "moved": not torch.equal(layer_cpu.quantized_weight(), cpu_wq)}
    with torch.no_grad():  # the trained state, Wq on the CPU (what the export writes) and on XLA
        cpu_wq = layer_cpu.quantized_weight().clone()
        report[preset]["xla_equals_cpu"] = bool(torch.equal(layer_cpu.to(device).quantized_weight().cpu(), cpu_wq))
print(json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.xla
def test_kquant_training_steps_on_xla_compile_once_and_stay_on_the_device():
    report = on_xla(STEPS)
    for preset, counters in report.items():
        assert counters["graphs_compiled"] == 0, (preset, counters)  # steps 3-5 reuse step 2's graph
        assert counters["cpu_fallback_ops"] == [], (preset, counters)
        assert counters["transfers_from_device"] == 0, (preset, counters)
        assert counters["graph_executions"] >= 3, (preset, counters)
        assert counters["moved"], preset  # the quantiser and weights did train
        assert counters["xla_equals_cpu"], preset  # XLA:CPU's Wq is the CPU's (the export's) bit for bit
