"""Checkpoints carry checksums: a damaged one is named, never resumed, and `--resume auto` falls back to the
newest intact one, ending exactly where an uninterrupted run ends."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from qat_lora.train import checkpoint as ckpt
from qat_lora.train.config import TrainConfig
from qat_lora.train.trainer import train


def _cfg(teacher_dir, cache_dir, out, **kw) -> TrainConfig:
    base = dict(model=str(teacher_dir), cache=str(cache_dir), quant="w2g32", out=str(out), max_steps=4, batch_size=4,
                lr=1e-3, lora_r=4, warmup_steps=1, save_steps=1, keep_checkpoints=0, device="cpu")
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, teacher_dir, cache_dir):
    out = tmp_path_factory.mktemp("ref") / "run"
    train(_cfg(teacher_dir, cache_dir, out), log=lambda _: None)
    return out


def _interrupted_after_step_3(reference, tmp_path):
    """The reference run as a kill right after checkpoint-3 would have left it."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for name in ("summary.json", "adapter"):
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    return run


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_file_of_a_checkpoint_is_checksummed(reference):
    saved = ckpt.list_checkpoints(reference)[-1]
    files = json.loads((saved / ckpt.STATE_FILE).read_text())["files"]
    on_disk = {p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file()} - {ckpt.STATE_FILE}
    assert set(files) == on_disk and "adapter/adapter_model.safetensors" in files
    assert ckpt.checkpoint_problem(saved) is None


@pytest.mark.parametrize("damaged", ["trainable.safetensors", "optimizer.safetensors",
                                     "adapter/adapter_model.safetensors"])
def test_resume_auto_skips_a_damaged_checkpoint_and_matches_the_uninterrupted_run(damaged, reference, teacher_dir,
                                                                                  cache_dir, tmp_path):
    run = _interrupted_after_step_3(reference, tmp_path)
    _flip_a_byte(run / "checkpoint-3" / damaged)
    messages = []
    train(_cfg(teacher_dir, cache_dir, run, resume="auto"), log=messages.append)
    assert any(f"checkpoint-3 cannot be resumed ({damaged} is damaged" in m for m in messages)
    assert any("resumed from" in m and m.split("resumed from ")[1].startswith(str(run / "checkpoint-2"))
               for m in messages)
    done, expected = load_file(str(run / "adapter" / "adapter_model.safetensors")), \
        load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    assert done.keys() == expected.keys() and all(torch.equal(done[k], expected[k]) for k in done)


def test_explicit_resume_of_a_damaged_checkpoint_names_the_file(reference, teacher_dir, cache_dir, tmp_path):
    run = _interrupted_after_step_3(reference, tmp_path)
    _flip_a_byte(run / "checkpoint-3" / "rng.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint-3: rng.safetensors is damaged \(sha256 differs"):
        train(_cfg(teacher_dir, cache_dir, run, resume=str(run / "checkpoint-3")), log=lambda _: None)


@pytest.mark.parametrize("fault", ["state not json", "file removed"])
def test_broken_state_or_missing_file_is_not_resumed(fault, reference, tmp_path):
    run = _interrupted_after_step_3(reference, tmp_path)
    target = run / "checkpoint-3"
    if fault == "state not json":
        (target / ckpt.STATE_FILE).write_text('{"step": 3, "fi')
    else:
        (target / "optimizer.safetensors").unlink()
    assert ckpt.checkpoint_problem(target) is not None
    assert ckpt.find_resume_point(run, "auto", log=lambda _: None) == run / "checkpoint-2"


def test_a_checkpoint_with_other_optimizer_groups_is_refused_by_name(teacher_dir, cache_dir, tmp_path):
    """A qat+lora checkpoint from before the quantiser had its own group (one group for adapter and scales) is
    refused in one line naming it, not with torch's bare group-count error."""
    run = tmp_path / "run"
    train(_cfg(teacher_dir, cache_dir, run, preset="qat+lora", max_steps=3), log=lambda _: None)
    saved = ckpt.list_checkpoints(run)[-1]
    state = json.loads((saved / ckpt.STATE_FILE).read_text())
    groups = state["optimizer"]["param_groups"]
    assert len(groups) == 2  # the adapter, then the scales and zeros
    state["optimizer"]["param_groups"] = [{**groups[0], "params": groups[0]["params"] + groups[1]["params"]}]
    (saved / ckpt.STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ValueError, match=rf"{saved.name} holds 1 optimizer group\(s\), this run has 2 .*--overwrite"):
        train(_cfg(teacher_dir, cache_dir, run, preset="qat+lora", max_steps=3, resume=str(saved)),
              log=lambda _: None)
