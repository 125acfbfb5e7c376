"""Which XLA device a run gets and how often the training loop reads it (issue 47, items 2 and 4):

- `--device xla` never changes the PJRT device the host has: the environment's PJRT_DEVICE when set, else the
  TPU of a TPU host, else the host CPU; autocast's `auto` follows the runtime's device type, not the variable;
- a training step reads the device once per --log-steps (the stop agreement's read brings the step's metrics
  with it) and never in the steps between.
"""
from __future__ import annotations

import json

import pytest

from helpers_xla import on_xla, require_torch_xla
from qat_lora.runtime import device as dev
from qat_lora.runtime import xla

require_torch_xla()


def test_device_xla_takes_the_hosts_tpu_when_pjrt_device_is_unset(monkeypatch):
    started = []
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(dev, "tpu_present", lambda: True)
    monkeypatch.setattr(xla, "start_device", lambda kind: started.append(kind) or kind)
    dev.resolve_device("xla")
    dev.resolve_device("tpu")
    monkeypatch.setattr(dev, "tpu_present", lambda: False)
    dev.resolve_device("xla")
    assert started == ["TPU", "TPU", "CPU"]  # a TPU host's --device xla is its TPU, not one "chip" on the host CPU


POLICY = """
import json, os
from qat_lora.runtime import device as dev, precision, xla
device = dev.resolve_device("xla")
before = precision.autocast_dtype(device, "auto")
os.environ["PJRT_DEVICE"] = "TPU"  # the variable says TPU; the runtime already runs on the CPU
after = precision.autocast_dtype(device, "auto")
print(json.dumps({"runtime": xla.device_hardware(device), "before": str(before), "after": str(after)}))
"""


@pytest.mark.xla
def test_autocast_follows_the_runtimes_device_not_the_environment_variable():
    report = on_xla(POLICY)
    assert report == {"runtime": "CPU", "before": "None", "after": "None"}, report


READS = """
import json, sys
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from qat_lora.runtime import xla
from qat_lora.train.config import TrainConfig
from qat_lora.train.trainer import train

teacher, cache, out = sys.argv[1:4]
reads = {}
for steps in (8, 12, 16):
    met.clear_all()
    train(TrainConfig(model=teacher, cache=cache, quant="w2g32", out=f"{out}/{steps}", max_steps=steps,
                      batch_size=2, lora_r=4, warmup_steps=1, log_steps=4, device="xla"), log=lambda _: None)
    xm.wait_device_ops()
    reads[steps] = xla.compile_metrics()["transfers_from_device"]
print(json.dumps(reads))
"""


@pytest.mark.slow
@pytest.mark.xla
def test_one_device_read_per_log_step_and_none_between(teacher_dir, cache_dir, tmp_path):
    reads = {int(k): v for k, v in on_xla(READS, str(teacher_dir), str(cache_dir), str(tmp_path)).items()}
    # Four more steps = one more log step = exactly one more read (the agreement's, which carries the metrics).
    assert reads[12] - reads[8] == 1 and reads[16] - reads[12] == 1, reads
    metrics = [json.loads(line) for line in (tmp_path / "16" / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in logged] == [4, 8, 12, 16]
    assert all(m["grad_norm"] > 0 and m["loss"] > 0 and m["soft_ce"] >= m["kl"] for m in logged), logged
