"""Issue 14, chips and sizes: which TPU chips a run sees, ranks of a multi-chip cache build, bf16 student storage.
Pure functions and CPU maths here; the XLA runs (multi-chip build, FSDP over 4 devices) are in
test_xla_chips_spmd.py, each in its own subprocess."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import pytest
import torch

from qat_lora.train.config import StudentSpec, TrainConfig
from qat_lora.cache.launch import chip_rank
from qat_lora.runtime.launch import tpu_visibility_env
from qat_lora.runtime.sharding import shard_dim
from qat_lora.train.student import build_student, make_trainable_, set_storage_dtype_


@pytest.mark.xla
@pytest.mark.parametrize("host", [4, 8])
def test_one_process_over_a_subset_sees_only_the_first_chips(host):
    assert tpu_visibility_env(1, host, per_process=False) == {
        "TPU_VISIBLE_CHIPS": "0", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "1,1,1"}
    assert tpu_visibility_env(2, host, per_process=False) == {
        "TPU_VISIBLE_CHIPS": "0,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,2,1", "TPU_PROCESS_BOUNDS": "1,1,1"}
    expected_4 = {} if host == 4 else {"TPU_VISIBLE_CHIPS": "0,1,2,3", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
                                       "TPU_PROCESS_BOUNDS": "1,1,1"}
    assert tpu_visibility_env(4, host, per_process=False) == expected_4


@pytest.mark.xla
@pytest.mark.parametrize("host", [4, 8])
def test_replicas_over_a_subset_get_one_chip_each_and_n_processes(host):
    # torch_xla.launch starts min(chips, prod(TPU_PROCESS_BOUNDS)) replicas and gives each its chip itself.
    assert tpu_visibility_env(1, host, per_process=True) == {"TPU_PROCESS_BOUNDS": "1,1,1",
                                                             "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1"}
    assert tpu_visibility_env(2, host, per_process=True) == {"TPU_PROCESS_BOUNDS": "1,2,1",
                                                             "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1"}
    assert tpu_visibility_env(4, host, per_process=True) == ({} if host == 4 else {
        "TPU_PROCESS_BOUNDS": "2,2,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1"})


@pytest.mark.xla
def test_every_chip_sets_nothing_and_impossible_counts_are_one_line_errors():
    assert tpu_visibility_env(1, 1, per_process=False) == {}  # Colab's single-chip runtime: left as it is
    assert tpu_visibility_env(8, 8, per_process=True) == {}
    with pytest.raises(ValueError, match=r"^--num-chips 4: this host has 1 TPU chip\(s\); pass --num-chips 1"):
        tpu_visibility_env(4, 1, per_process=True)
    with pytest.raises(ValueError, match=r"^--num-chips 3: a TPU host runs on 1, 2, 4 or 8"):
        tpu_visibility_env(3, 8, per_process=False)


@pytest.mark.xla
def test_num_chips_zero_is_the_default_and_negative_is_refused(tmp_path):
    assert TrainConfig(model="m").num_chips == 0
    with pytest.raises(ValueError, match=r"^--num-chips -1: must be >= 0"):
        TrainConfig(model="m", num_chips=-1)
    with pytest.raises(ValueError, match=r"^--parallel 'x'"):
        TrainConfig(model="m", parallel="x")
    with pytest.raises(ValueError, match=r"^--storage-dtype bf16 --preset qat: .*--preset recovery-lora"):
        TrainConfig(model="m", storage_dtype="bf16", preset="qat")


@pytest.mark.xla
def test_build_cache_num_chips_is_a_count_and_leaves_the_resume_fingerprint_alone():
    from qat_lora.cache.config import CacheBuildConfig

    with pytest.raises(ValueError, match=r"^--num-chips -1: must be >= 0"):
        CacheBuildConfig(teacher="t", data=["d"], num_chips=-1)
    # Each builder runs with --num-chips 1, which stays out of the fingerprint: a build interrupted before the flag
    # existed (fingerprint of the other fields, as it was computed then) still resumes.
    cfg = CacheBuildConfig(teacher="t", data=["d"], num_chips=1)
    before = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in ("num_chips", "resume", "overwrite", "device", "parallel", "dtype", "matmul_precision",
                            "text_encoding", "text_errors", "xla_cache_dir")}
    assert cfg.fingerprint() == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()


@pytest.mark.xla
def test_chip_ranks_of_several_hosts_cover_every_sequence_once():
    hosts, chips = 3, 4
    ranks = [chip_rank(h, hosts, i, chips) for h in range(hosts) for i in range(chips)]
    assert sorted(r for r, _ in ranks) == list(range(hosts * chips))
    assert {w for _, w in ranks} == {hosts * chips}
    assert chip_rank(0, 1, 2, 4) == (2, 4)  # one host: rank = chip index


@pytest.mark.xla
def test_shard_dim_splits_the_largest_divisible_dimension_or_replicates():
    assert shard_dim((576, 64), 4) == 0
    assert shard_dim((6, 64), 4) == 1
    assert shard_dim((3,), 4) is None and shard_dim((2, 2), 4) is None


def _storage_student(model_dir, storage: str):
    student = make_trainable_(build_student(StudentSpec(str(model_dir), "w4g32"), "eager"), "recovery-lora")
    return set_storage_dtype_(student, storage).eval()


@pytest.mark.xla
def test_bf16_storage_keeps_no_fp32_latent_weight_and_matches_the_fp32_student(teacher_dir):
    from qat_lora.quant.fake_quant import FakeQuantLinear, quantizer_parameters

    fp32, bf16 = _storage_student(teacher_dir, "fp32"), _storage_student(teacher_dir, "bf16")
    layers = [m for m in bf16.modules() if isinstance(m, FakeQuantLinear)]
    assert layers and all(m.weight.dtype == torch.bfloat16 and m._cached_wq is None for m in layers)
    quantizer = {id(p) for p in quantizer_parameters(bf16)}
    frozen = [p for p in bf16.parameters() if not p.requires_grad and id(p) not in quantizer]
    assert all(p.dtype == torch.bfloat16 for p in frozen)  # embeddings, norms, lm_head, Wq
    assert all(p.dtype == torch.float32 for p in bf16.parameters() if p.requires_grad)  # LoRA
    assert all(b.dtype != torch.bfloat16 for b in bf16.buffers())  # rotary frequencies stay fp32

    def frozen_bytes(model):
        skip = {id(p) for p in quantizer_parameters(model)}
        return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad and id(p) not in skip)

    # Half the frozen bytes (the fp32 student also caches an fp32 Wq per layer after its first forward).
    assert frozen_bytes(bf16) * 2 == frozen_bytes(fp32)
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = fp32(input_ids=ids).logits, bf16(input_ids=ids).logits.float()
        with torch.autocast("cpu", torch.bfloat16):  # what TPU training runs anyway: bf16 matmuls, fp32 storage
            c = fp32(input_ids=ids).logits.float()

    def rel_rms(x):
        return float((x - a).pow(2).mean().sqrt() / a.pow(2).mean().sqrt())

    # Wq, weights and the residual stream rounded to bf16 (8-bit mantissa): within 4 % RMS of the fp32 logits
    # (measured 2.8 % on this model) and at most 1.5 x the error of bf16 autocast over fp32 storage (2.1 %).
    assert rel_rms(b) <= 0.04 and rel_rms(b) <= 1.5 * rel_rms(c), (rel_rms(b), rel_rms(c))
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95
    # The stored Wq is the fp32 student's Wq rounded once to bf16.
    ref = [m for m in fp32.modules() if isinstance(m, FakeQuantLinear)]
    torch.testing.assert_close(layers[0].weight, ref[0].quantized_weight().to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.xla
def test_selecting_chips_sets_the_variables_once_and_keeps_the_users_own(monkeypatch):
    from qat_lora.runtime import launch

    environ = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    monkeypatch.setattr(os, "environ", environ)  # what select_tpu_chips sets stays in this test
    monkeypatch.setattr(launch, "tpu_chip_count", lambda: 8)  # a v6e-8 host
    lines = []
    launch.select_tpu_chips(2, per_process=False, log=lines.append)
    assert (environ["TPU_VISIBLE_CHIPS"], environ["TPU_CHIPS_PER_PROCESS_BOUNDS"]) == ("0,1", "1,2,1")
    assert lines == ["TPU chips: TPU_VISIBLE_CHIPS=0,1 TPU_CHIPS_PER_PROCESS_BOUNDS=1,2,1 TPU_PROCESS_BOUNDS=1,1,1"]
    environ.clear()
    environ["TPU_VISIBLE_CHIPS"] = "4,5"  # the user's choice wins
    launch.select_tpu_chips(1, per_process=False, log=lines.append)
    assert environ == {"TPU_VISIBLE_CHIPS": "4,5"}
    with pytest.raises(ValueError, match="this host has 8 TPU chip"):
        launch.select_tpu_chips(16, per_process=True)
    monkeypatch.setattr(launch, "tpu_chip_count", lambda: 0)  # chips not visible on the PCI bus: set nothing
    environ.clear()
    launch.select_tpu_chips(1, per_process=False, log=lines.append)
    assert environ == {} and "cannot be counted" in lines[-1]


@pytest.mark.xla
def test_all_chips_means_one_device_off_a_tpu_host(monkeypatch):
    from qat_lora.runtime import launch

    monkeypatch.setattr(launch.dev, "tpu_present", lambda: False)
    assert launch.chips_to_use(0, "cpu") == launch.chips_to_use(0, "xla") == 1
    assert launch.chips_to_use(3, "cpu") == 3
    monkeypatch.setattr(launch.dev, "tpu_present", lambda: True)
    monkeypatch.setattr(launch, "tpu_chip_count", lambda: 4)
    assert launch.chips_to_use(0, "tpu") == 4 and launch.chips_to_use(0, "cpu") == 1


@pytest.mark.xla
@pytest.mark.multiprocess
def test_fsdp_without_xla_is_a_one_line_error():
    from qat_lora.train.launch import run

    with pytest.raises(ValueError, match=r"^--parallel fsdp with --device cpu: SPMD needs --device xla or tpu"):
        run(TrainConfig(model="m", device="cpu", num_chips=2, parallel="fsdp"), log=lambda _: None)


@pytest.mark.xla
@pytest.mark.parametrize("parallel, started", [("auto", "spmd"), ("spmd", "spmd"), ("processes", "replicas")])
def test_parallel_auto_on_a_tpu_host_is_one_spmd_process(monkeypatch, parallel, started):
    import sys
    import types

    from qat_lora.train import launch

    ran, chips = [], []
    monkeypatch.setattr(launch.dev, "tpu_present", lambda: True)
    monkeypatch.setattr(launch, "chips_to_use", lambda n, device: n)
    monkeypatch.setattr(launch, "select_tpu_chips", lambda n, per_process, log: chips.append(per_process))
    monkeypatch.setattr(launch, "_train_spmd", lambda cfg, fsdp=False: ran.append("spmd") or 0)
    monkeypatch.setitem(sys.modules, "torch_xla", types.SimpleNamespace(launch=lambda fn, args: ran.append("replicas")))
    launch.run(TrainConfig(model="m", device="tpu", num_chips=4, parallel=parallel), log=lambda _: None)
    # The tested path by default: one process over the 4 chips (each chip visible to it), not 4 unsupervised
    # replicas; replicas only when asked for.
    assert ran == [started] and chips == [started == "replicas"]
