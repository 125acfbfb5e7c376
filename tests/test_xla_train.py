"""The trainer's XLA paths on XLA:CPU (issue 14, part 2), each scenario in its own subprocess (DESIGN §6: the
device count, SPMD mode and compile counters are process-wide), held to torch_xla's debug metrics:

- the input pipeline: batches reach the device through torch_xla's ParallelLoader, ids as int32, laid out over
  the 'data' mesh under SPMD as they are copied;
- the persistent compile cache: on by default, a second `train()` / `evaluate()` in the same process (a
  notebook kernel) works, and a fresh process loads the graphs from disk instead of compiling them;
- evaluation under training's autocast, its sums read once at the end;
- LUT presets, on one device and under SPMD: <= 3 graphs, none after step 2, no CPU fallback;
- --matmul-precision recorded and restored after the run.
"""
from __future__ import annotations

import json

import pytest

from helpers_xla import on_xla, require_torch_xla

require_torch_xla()


NOTEBOOK = """
import json, sys
import torch_xla.backends as xb
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from qat_lora.runtime import xla
from qat_lora.commands.config import EvalConfig
from qat_lora.train.config import TrainConfig
from qat_lora.commands.evaluate import evaluate
from qat_lora.train.trainer import train

teacher, cache, out = sys.argv[1:4]
quiet, report = (lambda _: None), {}

def measured(name, fn):
    met.clear_all()
    result = fn()
    xm.wait_device_ops()
    report[name] = {**xla.compile_metrics(), "result": result}

eval_cfg = EvalConfig(model=teacher, quant="lut2g32", cache=cache, device="xla", batch_size=2)
# A notebook: evaluate, train, train again, evaluate again, all in one kernel (one XLA runtime).
measured("eval", lambda: evaluate(eval_cfg, log=quiet))
run = lambda name, steps: train(TrainConfig(
    model=teacher, cache=cache, quant="lut2g32", out=f"{out}/{name}", max_steps=steps, batch_size=2,
    warmup_steps=2, log_steps=5, save_steps=10, device="xla", matmul_precision="highest"), log=quiet)["compile"]
measured("train", lambda: run("first", 20))
report["precision_after"] = xb.get_mat_mul_precision()
measured("train_again", lambda: run("second", 4))
measured("eval_again", lambda: evaluate(eval_cfg, log=quiet))
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def notebook(tmp_path_factory, teacher_dir, cache_dir):
    root = tmp_path_factory.mktemp("notebook")
    return root, on_xla(NOTEBOOK, str(teacher_dir), str(cache_dir), str(root / "runs"), cache_home=root / "home")


@pytest.mark.slow
@pytest.mark.xla
def test_lut_preset_twenty_steps_compile_nothing_after_step_two(notebook):
    _, report = notebook
    compiled = report["train"]["result"]
    assert 1 <= compiled["graphs_compiled"] <= 3 and compiled["graphs_compiled_after_step_2"] == 0, compiled
    assert compiled["cpu_fallback_ops"] == [], compiled
    # Host reads only at --log-steps 5 (stop agreement + finite flag, metrics) and the one save: far fewer than
    # one per step.
    assert report["train"]["transfers_from_device"] < 20, report["train"]


@pytest.mark.slow
@pytest.mark.xla
def test_a_second_train_and_evaluate_in_one_process_work_and_compile_nothing_new(notebook):
    root, report = notebook
    again = report["train_again"]
    assert again["graphs_compiled"] == 0, again  # the first run's graphs, from the in-memory cache
    assert report["eval_again"]["graphs_compiled"] == 0, report["eval_again"]
    assert report["eval_again"]["result"] == report["eval"]["result"]
    # Evaluation: one graph for every batch (the last one padded), its sums read in ONE transfer at the end.
    assert report["eval"]["graphs_compiled"] == 1 and report["eval"]["transfers_from_device"] == 1, report["eval"]
    assert report["eval"]["cpu_fallback_ops"] == []
    # The cache is on by default, in the user's cache folder (evaluate initialised it first; train kept it).
    assert any((root / "home" / "qat-lora" / "xla").iterdir())


@pytest.mark.slow
@pytest.mark.xla
def test_matmul_precision_is_recorded_and_restored(notebook):
    root, report = notebook
    assert report["precision_after"] == "default"
    assert json.loads((root / "runs" / "first" / "config.json").read_text())["matmul_precision"] == "highest"


FRESH = """
import json, sys
import torch_xla.debug.metrics as met
from qat_lora.train.config import TrainConfig
from qat_lora.train.trainer import train

teacher, cache, out = sys.argv[1:4]
summary = train(TrainConfig(model=teacher, cache=cache, quant="lut2g32", out=out, max_steps=4, batch_size=2,
                            warmup_steps=2, log_steps=5, save_steps=10, device="xla", matmul_precision="highest"),
                log=lambda _: None)
print(json.dumps({**summary["compile"], "undeserializable": met.counter_value("PersistentCacheDeserializeFailure") or 0}))
"""


@pytest.mark.slow
@pytest.mark.xla
def test_a_fresh_process_loads_its_graphs_from_the_persistent_cache(notebook, teacher_dir, cache_dir, tmp_path):
    root, _ = notebook
    report = on_xla(FRESH, str(teacher_dir), str(cache_dir), str(tmp_path / "run"), cache_home=root / "home")
    # Every graph was found on disk under the key the first process wrote it with (none missed). XLA:CPU's PJRT
    # client cannot deserialize executables (measured: PersistentCacheDeserializeFailure), so there it compiles
    # them again; a TPU loads them (hits, nothing compiled).
    assert report["persistent_cache_misses"] == 0, report
    found = report["persistent_cache_hits"] + report["undeserializable"]
    assert found == report["persistent_cache_hits"] + report["graphs_compiled"] >= 1, report


SPMD = """
import json, sys
import torch, torch_xla
from qat_lora.runtime import device as dev
from qat_lora.cache.reader import KDCache
from qat_lora.train.config import TrainConfig
from qat_lora.runtime.distributed import SpmdBackend
from qat_lora.train.trainer import train

teacher, cache, out = sys.argv[1:4]
backend = SpmdBackend()
rows = KDCache(cache).batches("train", 4, shuffle=False)
dims = {k: v.dim() + 1 for k, v in KDCache(cache).sequence(0).items()}
with dev.device_batches(rows, torch_xla.device(), backend.input_sharding(dims)) as batches:
    batch = next(batches)
layout = {k: {"dtype": str(v.dtype), "device": v.device.type, "sharding": torch_xla._XLAC._get_xla_sharding_spec(v)}
          for k, v in batch.items()}
summary = train(TrainConfig(model=teacher, cache=cache, quant="lut2g32", out=out, max_steps=6, batch_size=1,
                            warmup_steps=2, log_steps=3, device="xla", xla_cache_dir="off"),
                log=lambda _: None, backend=backend)
print(json.dumps({"layout": layout, "compile": summary["compile"], "world_size": summary["world_size"]}))
"""


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
def test_spmd_batches_arrive_sharded_as_int32_and_the_lut_step_compiles_once(teacher_dir, cache_dir, tmp_path):
    report = on_xla(SPMD, str(teacher_dir), str(cache_dir), str(tmp_path / "run"), devices=2)
    layout = report["layout"]
    assert layout["input_ids"]["dtype"] == "torch.int32" and layout["topk_ids"]["dtype"] == "torch.int32"
    assert layout["topk_logprobs"]["dtype"] == "torch.float32"
    for name, tensor in layout.items():  # split over the 2 devices along the batch, as it was copied
        assert tensor["device"] == "xla" and tensor["sharding"].startswith("{devices=[2,"), (name, tensor)
    compiled = report["compile"]
    assert report["world_size"] == 2
    assert 1 <= compiled["graphs_compiled"] <= 3 and compiled["graphs_compiled_after_step_2"] == 0, compiled
    assert compiled["cpu_fallback_ops"] == [], compiled
