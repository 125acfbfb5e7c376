"""Block-wise reconstruction: train each decoder block's quantised weights to reproduce the teacher's block.

EfficientQAT's Block-AP (Chen et al., 2024) after BRECQ (Li et al., 2021; DESIGN §8): for decoder block i,
with x_i the hidden states entering block i of the STUDENT (the outputs of its already-reconstructed blocks
0..i-1; block 0 gets the embeddings) and t_i those entering block i of the TEACHER, minimise

    ‖block_q,i(x_i) − block_fp,i(t_i)‖²     over block i's latent weights and scales/zeros (or LUT codebooks)

through FakeQuantLinear's straight-through forward, everything else frozen; then x_{i+1} = block_q,i(x_i).
Feeding the student's own inputs, as EfficientQAT does, rather than the teacher's, lets block i compensate
the error the earlier quantised blocks left in x_i. At 2 bits the weights must move far from any
round-to-nearest or GPTQ grid ("reconstruction"), which training only the scales or a LoRA cannot express.

    quantize_(student, replace(get_preset("w2g64"), init="mse")); gptq_(student, batches)
    report = reconstruct_blocks_(student, teacher, batches, steps=100, lr_weights=3e-3, lr_quant=1e-5,
                                 batch_size=4, state_dir=out / "blocks")

Each trained block is snapped onto its grid (latent weight := Wq, scales := their fp16 values, zeros := their
integers; Wq unchanged), so `save_quantizer_state(student, path, codes=True)` exports exactly what was
trained, and a run resumed from `state_dir` equals an uninterrupted one bit for bit (on the CPU).

Memory: the samples are the calibration sequences, N x L tokens. The student's inputs and the teacher's
targets are kept on the CPU in float32: 2 x N x L x hidden x 4 bytes (64 x 256 tokens at hidden 576: 75 MB),
plus as much again while a block's outputs replace them; the layer kwargs (rotary cos/sin) and one block's
activations for batch_size sequences live on the model's device.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F
from safetensors.torch import load_file

from qat_lora.quant import blocks
from qat_lora.runtime import device as dev
from qat_lora.runtime.files import atomic_write_json, save_safetensors
from qat_lora.quant.fake_quant import FakeQuantLinear, quantised_layers
from qat_lora.quant.state import CODES_KEY, quantizer_state_dict

PROGRESS_FILE = "progress.json"
BLOCK_FILE = "block-{index:03d}.safetensors"  # one block's quantizer_state_dict(codes=True) entries


def _samples(calibration_batches: list[torch.Tensor], batch_size: int) -> torch.Tensor:
    """The calibration sequences as one [N, L] tensor of input_ids (CPU); raises ValueError on ragged L."""
    lengths = {int(b.shape[1]) for b in calibration_batches}
    if not calibration_batches or len(lengths) != 1:
        raise ValueError(f"reconstruct_blocks_: need calibration batches [B, L] of one length L, got lengths "
                         f"{sorted(lengths)}; pack the calibration text to a fixed sequence length")
    ids = torch.cat([b.cpu() for b in calibration_batches])
    if batch_size <= 0 or batch_size > len(ids):
        raise ValueError(f"reconstruct_blocks_: batch_size={batch_size} with {len(ids)} calibration sequences; "
                         "use 1 <= batch_size <= the number of sequences")
    return ids


def _embed(model: nn.Module, ids: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, list[dict[int, dict]]]:
    """What enters decoder layer 0: hidden [N, L, hidden] float32 CPU, and per layer its kwargs per batch size.

    The kwargs (rotary cos/sin, causal or sliding-window mask) depend only on the batch shape and the layer's
    kind, since calibration batches carry no padding mask, so the ones captured for any batch of b sequences
    serve every batch of b sequences of that layer.
    """
    captured = blocks.capture_block_inputs(model, ids.split(batch_size))
    kwargs = [{int(h.shape[0]): kw for h, kw in zip(captured.hidden, layer)} for layer in captured.layer_kwargs()]
    return torch.cat(captured.hidden), kwargs


def _run(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[int, dict], batch_size: int) -> torch.Tensor:
    """The layer's outputs [N, L, hidden] (float32 CPU, no grad) on hidden [N, L, hidden], batch_size at a time."""
    chunks = list(hidden.split(batch_size))
    return torch.cat(blocks.run_block(layer, blocks.BlockInputs(chunks, [kwargs[len(c)] for c in chunks])))


def _fake_quant_modules(layer: nn.Module) -> list[FakeQuantLinear]:
    return list(quantised_layers(layer).values())


def _fingerprint(modules: list[FakeQuantLinear]) -> str:
    """A digest of the student's starting point (latent weights + quantisers): saved blocks only resume onto the
    init they were reconstructed from (the same model, preset and data-aware init)."""
    digest = hashlib.sha256()
    for module in modules:
        for tensor in (module.weight, *module.quant_parameters().values()):
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _paired_layers(student: nn.Module, teacher: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(student block, teacher block) pairs; raises ValueError on models the stage cannot reconstruct."""
    layers, teacher_layers = blocks.decoder_layers(student), blocks.decoder_layers(teacher)
    if len(layers) != len(teacher_layers):
        raise ValueError(f"reconstruct_blocks_: the student has {len(layers)} decoder blocks, the teacher "
                         f"{len(teacher_layers)}; pass the student's own full-precision model as the teacher")
    modules = [m for layer in layers for m in _fake_quant_modules(layer)]
    if not modules:
        raise ValueError("reconstruct_blocks_: the student's decoder blocks hold no FakeQuantLinear; run "
                         "quantize_(student, config) first")
    if not all(m.quantizer.reconstructable for m in modules):
        raise ValueError("reconstruct_blocks_: the llama.cpp presets (q4_0, q4_1, q8_0, q2_k, q3_k, q4_k, q6_k: fp16 "
                         "offsets, signed or two-level scales) are not supported yet; use --blockwise-steps 0 "
                         "with them")
    if any(m.cfg.scale_rank for m in modules):  # s * (1 + A @ B) is not fp16-exact: no exact on-grid snap
        raise ValueError("reconstruct_blocks_: low-rank scales (scale_rank > 0) are not supported; reconstruct "
                         "with scale_rank=0 and add the low-rank factors afterwards")
    return list(zip(layers, teacher_layers))


def _train_block_(layer: nn.Module, modules: list[FakeQuantLinear], inputs: torch.Tensor, targets: torch.Tensor,
                  kwargs: dict, *, steps: int, lr_weights: float, lr_quant: float, batch_size: int,
                  generator: torch.Generator) -> None:
    """`steps` AdamW steps of MSE(block(inputs[idx]), targets[idx]) over the modules' weights and quantisers.

    inputs, targets: [N, L, hidden] float32 CPU; kwargs: the layer kwargs of a batch of batch_size sequences.
    Mini-batches: one seeded permutation of the N samples per epoch, remainder dropped (fixed shapes).
    """
    weights = [m.weight for m in modules]
    quantizer = [p for m in modules for p in m.quant_parameters().values()]
    # No weight decay: it would pull latent weights and scales towards 0, i.e. off the learned grid.
    optimizer = torch.optim.AdamW([{"params": weights, "lr": lr_weights}, {"params": quantizer, "lr": lr_quant}],
                                  weight_decay=0.0)
    device, dtype = weights[0].device, weights[0].dtype
    kwargs = blocks.on_device(kwargs, device)  # the rotary tables and mask, once (captured on the host)
    order = torch.empty(0, dtype=torch.long)
    for p in (*weights, *quantizer):
        p.requires_grad_(True)  # trains() turns True: each forward rebuilds Wq from the updated tensors
    try:
        with torch.enable_grad():
            for _ in range(steps):
                if len(order) < batch_size:
                    order = torch.randperm(len(inputs), generator=generator)
                idx, order = order[:batch_size], order[batch_size:]
                out = layer(inputs[idx].to(device, dtype), **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                loss = F.mse_loss(out.float(), targets[idx].to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                for m in modules:  # a scale through 0 would flip its group's sign (Quantizer.constrain_)
                    m.quantizer.constrain_(m.quant_parameters())
                dev.sync(device)  # XLA: one graph per step (the same graph every step), no host read
    finally:
        for p in (*weights, *quantizer):
            p.requires_grad_(False)
            p.grad = None


@torch.no_grad()
def _snap_to_grid_(module: FakeQuantLinear) -> None:
    """Store exactly what the forward uses, leaving Wq unchanged: scales/codebooks := their fp16 values, zeros :=
    their integers (the forward rounds both), latent weight := Wq (so the codes export it exactly)."""
    codes = module.codes()
    for name, value in module.quantizer.snapped_parameters(module.quant_parameters()).items():
        getattr(module, name).copy_(value)
    module.weight.copy_(module.dequantize_codes(codes))
    module._cached_wq = None


def _block_prefix(model: nn.Module, layer: nn.Module) -> str:
    """The layer's name as `quantizer_state_dict` spells it (`model.layers.3`), PEFT wrapper or not."""
    name = next(n for n, m in model.named_modules() if m is layer)
    return name.removeprefix("base_model.model.")


def _save_block(path: Path, prefix: str, layer: nn.Module) -> None:
    """Write the block's quantiser state with codes, keyed as in the whole model's state (temp name, rename)."""
    state = {f"{prefix}.{k}": v.detach().cpu().contiguous() for k, v in quantizer_state_dict(layer, True).items()}
    save_safetensors(state, path)


@torch.no_grad()
def _load_block_(path: Path, prefix: str, layer: nn.Module) -> None:
    """Load a saved block: quantiser parameters copied, latent weight := dequantize_codes(codes) (on the grid).

    Raises:
        ValueError: a tensor is missing or has another shape (the folder holds another model's or preset's blocks).
    """
    saved = load_file(str(path))
    for key, tensor in quantizer_state_dict(layer, True).items():
        name = f"{prefix}.{key}"
        if name not in saved or saved[name].shape != tensor.shape:
            raise ValueError(f"{path}: no {name} of shape {tuple(tensor.shape)}; the block state belongs to another "
                             "model or preset: delete the folder or pass another state_dir")
    for name, module in layer.named_modules():
        if isinstance(module, FakeQuantLinear):
            key = f"{prefix}.{name.replace('.base_layer', '')}"
            for attr, p in module.quant_parameters().items():
                p.copy_(saved[f"{key}.{attr}"].to(p.device, p.dtype))
            module.weight.copy_(module.dequantize_codes(saved[f"{key}.{CODES_KEY}"].to(module.weight.device)))
            module._cached_wq = None


def _done_blocks(state_dir: Path | None, settings: dict) -> list[dict]:
    """Report entries of the blocks a previous run saved (a prefix of the blocks; [] for a fresh folder).

    Raises:
        ValueError: the folder's progress was written with other settings (mixing them would not resume).
    """
    if state_dir is None or not (state_dir / PROGRESS_FILE).exists():
        return []
    progress = json.loads((state_dir / PROGRESS_FILE).read_text())
    if progress["settings"] != settings:
        diff = sorted(k for k in settings if progress["settings"].get(k) != settings[k])
        raise ValueError(f"{state_dir}: saved blocks were reconstructed with other settings ({', '.join(diff)}); "
                         "delete the folder or pass the same settings to resume")
    done = []  # a block counts once both its file and its progress entry were written, in block order
    for entry in progress["blocks"]:
        if entry["index"] != len(done) or not (state_dir / BLOCK_FILE.format(index=len(done))).exists():
            break
        done.append(entry)
    return done


def reconstruct_blocks_(student: nn.Module, teacher: nn.Module, calibration_batches: list[torch.Tensor], *,
                        steps: int, lr_weights: float, lr_quant: float, batch_size: int,
                        state_dir: Path | None = None, seed: int = 0, device: torch.device | str | None = None,
                        log: Callable[[str], None] = print) -> dict:
    """Block-AP over a student already through `quantize_` (and possibly `gptq_`), in place, block by block.

    Args:
        student: causal LM (possibly PEFT-wrapped) whose decoder linears are FakeQuantLinear; only their latent
            weights and quantiser parameters change (embeddings, norms, biases, lm_head keep their values).
        teacher: the same full-precision model, a separate copy (only read).
        calibration_batches: input_ids [B, L] each, one L (training text, never the evaluation text).
        steps: optimizer steps per block; lr_weights / lr_quant: AdamW learning rates of the latent weights and
            of the quantiser (scales, zeros, LUT codebooks); batch_size: sequences per step and per forward.
        state_dir: if given, block i is saved as `block-{i:03d}.safetensors` (its `quantizer_state_dict` entries,
            with codes) + `progress.json`; a rerun loads the saved blocks instead of training them again.
        seed: block i draws its mini-batches from a generator seeded with seed + i.
        device: where block i of the student and of the teacher run and train while block i is reconstructed
            (None: where they are); the rest of both models, the samples and the saved state stay on the host.
    Returns:
        {"blocks": [{"index", "loss_before", "loss_after", "seconds", "resumed"}], "seconds": total}: losses are
        the MSE over all samples of the block's output against the teacher's, before and after training.
    """
    start, was_training = time.perf_counter(), student.training
    ids = _samples(calibration_batches, batch_size)
    settings = {"steps": steps, "lr_weights": lr_weights, "lr_quant": lr_quant, "batch_size": batch_size,
                "seed": seed, "samples": list(ids.shape)}
    pairs = _paired_layers(student, teacher)
    modules = [m for layer, _ in pairs for m in _fake_quant_modules(layer)]
    settings.update(grids=sorted({m.quantizer.name for m in modules}), start=_fingerprint(modules))
    done = _done_blocks(state_dir, settings)
    flags = [(p, p.requires_grad) for p in student.parameters()]
    student.eval().requires_grad_(False)
    try:
        inputs, kwargs = _embed(student, ids, batch_size)
        targets, teacher_kwargs = _embed(teacher, ids, batch_size)
        report = []
        for index, (layer, teacher_layer) in enumerate(pairs):
            homes = [next(m.parameters()).device for m in (layer, teacher_layer)]
            for m, home in zip((layer, teacher_layer), homes):
                m.to(home if device is None else device)  # only this block pair on the device
            targets = _run(teacher_layer, targets, teacher_kwargs[index], batch_size)  # t_{i+1} = block_fp,i(t_i)
            entry = _reconstruct_block_(student, layer, index, inputs, targets, kwargs[index], done, state_dir,
                                        settings, generator=torch.Generator().manual_seed(seed + index))
            for m, home in zip((layer, teacher_layer), homes):
                m.to(home)
            inputs = entry.pop("outputs")  # x_{i+1} = block_q,i(x_i), no grad
            report.append(entry)
            if state_dir is not None and not entry["resumed"]:
                atomic_write_json(state_dir / PROGRESS_FILE, {"settings": settings, "blocks": report})
            log(f"block {index}: mse {entry['loss_before']:.4g} -> {entry['loss_after']:.4g} "
                f"({'loaded' if entry['resumed'] else 'trained'}, {entry['seconds']:.1f} s)")
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        student.train(was_training)
    return {"blocks": report, "seconds": time.perf_counter() - start}


def _reconstruct_block_(model: nn.Module, layer: nn.Module, index: int, inputs: torch.Tensor, targets: torch.Tensor,
                        kwargs: dict[int, dict], done: list[dict], state_dir: Path | None, settings: dict, *,
                        generator: torch.Generator) -> dict:
    """Train (or load from state_dir) one block; returns its report entry plus "outputs" [N, L, hidden]."""
    started, batch_size = time.perf_counter(), settings["batch_size"]
    modules, prefix = _fake_quant_modules(layer), _block_prefix(model, layer)
    path = None if state_dir is None else state_dir / BLOCK_FILE.format(index=index)
    if index < len(done):
        _load_block_(path, prefix, layer)
        return {**done[index], "resumed": True, "outputs": _run(layer, inputs, kwargs, batch_size)}
    start = [t.detach().clone() for m in modules for t in (m.weight, *m.quant_parameters().values())]
    before = F.mse_loss(_run(layer, inputs, kwargs, batch_size), targets).item()
    if modules and settings["steps"] > 0:
        _train_block_(layer, modules, inputs, targets, kwargs[batch_size], steps=settings["steps"],
                      lr_weights=settings["lr_weights"], lr_quant=settings["lr_quant"], batch_size=batch_size,
                      generator=generator)
    for module in modules:
        _snap_to_grid_(module)
    outputs = _run(layer, inputs, kwargs, batch_size)
    reverted = F.mse_loss(outputs, targets).item() > before
    if reverted:  # the trained block came out worse (seen once in 30 SmolLM2 blocks at w2g64): keep the start
        with torch.no_grad():
            for t, saved in zip((t for m in modules for t in (m.weight, *m.quant_parameters().values())), start):
                t.copy_(saved)
        for module in modules:
            module._cached_wq = None
            _snap_to_grid_(module)
        outputs = _run(layer, inputs, kwargs, batch_size)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _save_block(path, prefix, layer)
    return {"index": index, "loss_before": before, "loss_after": F.mse_loss(outputs, targets).item(),
            "reverted": reverted, "seconds": round(time.perf_counter() - started, 3), "resumed": False,
            "outputs": outputs}
