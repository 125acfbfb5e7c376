"""GPTQ over a model: data-aware initialisation of FakeQuantLinear weights, one decoder layer at a time (Frantar
et al., 2022; DESIGN §8). The solve of one matrix given H is quant/gptq_solve.py.

    quantize_(model, get_preset("w3g64"))
    report = gptq_(model, calibration_batches)     # list of input_ids [B, L]

Everything runs once before training and may branch on values. `gptq_(..., device=...)` keeps only the current
decoder layer and its calibration activations on the device (the rest of the model on the host, so a model larger
than one chip works): the block forwards and XᵀX run there; the column loop runs where it is fast, on a CUDA
device itself, else on the host CPU (XLA: torch_xla 2.9 lowers no Cholesky or triangular solve, and a column loop
traced op by op would be a graph per column). Modules fed the same input (q/k/v, gate/up) share one H and are
solved as one stacked matrix.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
import time
from typing import Callable, Iterator

import torch
from torch import nn
import torch.nn.functional as F

from qat_lora.quant import blocks
from qat_lora.runtime import device as dev

from qat_lora.quant.fake_quant import FakeQuantLinear, quantised_layers
from qat_lora.quant.gptq_solve import gptq_quantize
from qat_lora.quant.quantizer import LOW_RANK_FACTORS


def relative_error(weight: torch.Tensor, wq: torch.Tensor, hessian: torch.Tensor) -> float:
    """‖(W - Wq) Xᵀ‖ / ‖W Xᵀ‖ computed from H ∝ XᵀX: sqrt(tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)).

    Args:
        weight, wq: [out, in]; hessian: [in, in] (undamped).
    """
    w, h = weight.detach().double(), hessian.double().to(weight.device)  # where they are: no host round trip
    delta = w - wq.detach().double().to(weight.device)
    num, den = ((delta @ h) * delta).sum(), ((w @ h) * w).sum()
    return float((num / den.clamp(min=1e-300)).clamp(min=0).sqrt())


@contextlib.contextmanager
def full_precision(modules: list[FakeQuantLinear]) -> Iterator[None]:
    """Inside the block these FakeQuantLinears compute x @ Wᵀ with their latent weight, not Wq."""
    # An instance attribute shadows the class's forward; hooks and PEFT wrappers still go through __call__.
    # A forward already set on the instance (e.g. by accelerate's device hooks) is put back afterwards.
    saved = [m.__dict__.get("forward") for m in modules]
    for m in modules:
        m.forward = lambda x, m=m: F.linear(x, m.weight.to(x.dtype), None if m.bias is None else m.bias.to(x.dtype))
    try:
        yield
    finally:
        for m, forward in zip(modules, saved):
            del m.forward
            if forward is not None:
                m.forward = forward


@torch.no_grad()
def collect_hessians(layer: nn.Module, inputs: blocks.BlockInputs, modules: dict[str, FakeQuantLinear],
                     to: torch.device | str = "cpu") -> dict:
    """H = 2 XᵀX / n ([in, in] float32, moved `to`) of each module's inputs X [n, in] while `layer` runs over
    `inputs`, computed on the layer's device. Modules fed the same tensor (q/k/v, gate/up) share one H, computed
    once per distinct input: the same tensor object under each name (read it, do not write to it).

    The caller decides whether the modules run quantised or in full precision (see `full_precision`).
    """
    sums: list[torch.Tensor] = []  # one XᵀX sum per distinct input
    counts: list[int] = []
    source: dict[str, int] = {}  # module name -> index of its input in `sums`
    last: list = [None, None]  # the latest hook call's input tensor and its index

    def hook(name):
        def accumulate(module, args, output):
            if args[0] is not last[0]:  # a new input: q/k/v (gate/up) then find their shared one in `last`
                x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
                index = source.setdefault(name, len(sums))
                if index == len(sums):
                    sums.append(x.T @ x)
                    counts.append(0)
                else:
                    sums[index] += x.T @ x
                counts[index] += x.shape[0]
                last[:] = [args[0], index]
            elif source.setdefault(name, last[1]) != last[1]:
                raise ValueError(f"collect_hessians: {name}'s input changed between batches")
        return accumulate

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    try:
        blocks.run_block(layer, inputs)
    finally:
        last.clear()
        for handle in handles:
            handle.remove()
    hessians = [(2.0 * total / count).to(to) for total, count in zip(sums, counts)]
    return {n: hessians[source[n]] for n in modules if n in source}


@torch.no_grad()
def _write_(module: FakeQuantLinear, result: dict[str, torch.Tensor]) -> None:
    """Load a gptq_quantize result into the module: latent weight := Wq, quantiser parameters := the result.

    In-place copies into the same Parameter objects (an optimizer built before stays valid); copy_ on the
    parameter itself, not on .data, bumps its version, which FakeQuantLinear's Wq cache key watches.
    """
    module.weight.copy_(result["weight"])
    for name, value in result.items():
        if name != "weight":
            getattr(module, name).copy_(value)
    if module.cfg.scale_rank:
        module.scale_b.zero_()  # s (1 + A 0) = s: the grid GPTQ fitted
    module._cached_wq = None


def _quantize_modules(modules: dict[str, FakeQuantLinear], h: torch.Tensor, damp: float, act_order: bool,
                      block_graphs: dict | None = None) -> dict:
    """GPTQ modules fed the same input (H), in place, the column loop on `h`'s device; returns each one's errors
    before (previous init) and after, and seconds. Rows are independent given H, so modules of one grid whose
    groups GPTQ fits itself (int, offset) are solved as one stacked matrix: one column loop for q/k/v, not three."""
    report, pending = {}, list(modules.items())
    while pending:
        first = pending[0][1]
        stack = [pending[0]] + ([(n, m) for n, m in pending[1:] if m.quantizer.gptq_fits_groups
                                 and (m.cfg, m.group_size) == (first.cfg, first.group_size)]
                                if first.quantizer.gptq_fits_groups else [])
        pending = [item for item in pending if item not in stack]
        start = time.perf_counter()
        # a copy: _write_ overwrites the latent weight, and the error report compares against W
        weights = [m.weight.detach().to(h.device, torch.float32, copy=True) for _, m in stack]
        rows = [w.shape[0] for w in weights]
        # Low-rank scale factors (scale_rank) restart at 1 (B = 0): GPTQ fits the group scales beneath them.
        own = {k: v for k, v in first.quant_parameters().items() if k not in LOW_RANK_FACTORS}
        result = gptq_quantize(torch.cat(weights), h, replace(first.cfg, scale_rank=0), first.group_size, damp=damp,
                               act_order=act_order, params=own if len(stack) == 1 else None, block_graphs=block_graphs)
        seconds = (time.perf_counter() - start) / len(stack)
        parts = [result] if len(stack) == 1 else [dict(zip(result, p)) for p in zip(*(v.split(rows) for v in result.values()))]
        for (n, m), w, mine in zip(stack, weights, parts):
            before = relative_error(w, m.quantized_weight().detach(), h)
            _write_(m, mine)
            report[n] = {"init_err": before, "gptq_err": relative_error(w, mine["weight"], h), "seconds": seconds}
    return report


@torch.no_grad()
def gptq_(model: nn.Module, calibration_batches: list[torch.Tensor], *, damp: float = 0.01, act_order: bool = False,
          device: torch.device | str | None = None, log: Callable[[str], None] = print) -> dict:
    """Sequential GPTQ over a model already through `quantize_`, in place, one decoder block at a time.

    Each block gets the hidden states coming out of the previous, already-quantised block (the first: the
    embeddings). H of every FakeQuantLinear of the block is collected in one forward with the whole block in
    full precision (latent weights), so q/k/v, o_proj, gate/up and down all see full-precision activations
    inside the block; then all its linears are quantised and the quantised block produces the next block's
    inputs. (The paper's code instead re-runs the block after each sub-layer group; this is the simpler
    variant.) Only FakeQuantLinears inside decoder layers are touched; lm_head / embeddings are not.

    Args:
        model: a transformers causal LM (possibly PEFT-wrapped) whose linears are FakeQuantLinear.
        calibration_batches: input_ids [B, L] each (training text, never the evaluation text).
        damp, act_order: see `gptq_quantize`.
        device: where each decoder layer runs while it is quantised (None: where it is). Only that layer and
            its calibration activations (when they fit, `BlockInputs.kept_on`; else one batch at a time) are on
            the device; the layer goes back where it was after.
    Returns:
        {"layers": {module name: {"init_err", "gptq_err", "seconds"}}, "seconds": total, "phases": {capture,
        hessians, solve, forward: seconds}} where the errors are ‖ΔW Xᵀ‖ / ‖W Xᵀ‖ (see `relative_error`) of the
        previous init and of GPTQ.
    """
    start, was_training = time.perf_counter(), model.training
    model.eval()  # no dropout in the statistics
    clock = dev.PhaseClock(device if device is not None else next(model.parameters()).device)
    inputs = blocks.capture_block_inputs(model, calibration_batches).kept_on(clock.device)
    clock.lap("capture")
    report: dict[str, dict] = {}
    block_graphs: dict = {}  # on CUDA: the column loop's graphs by block shape, shared by every layer
    for index, layer in enumerate(blocks.decoder_layers(model)):
        home = next(layer.parameters()).device
        run_on = torch.device(device) if device is not None else home
        solve_on = run_on if run_on.type == "cuda" else torch.device("cpu")  # see the module docstring
        layer.to(run_on)
        modules = quantised_layers(layer)
        if modules:
            with full_precision(list(modules.values())):
                hessians = collect_hessians(layer, inputs, modules, to=solve_on)
            clock.lap("hessians")
            by_input: dict[int, dict[str, FakeQuantLinear]] = {}  # modules sharing an H (q/k/v, gate/up)
            for name, module in modules.items():
                by_input.setdefault(id(hessians[name]), {})[name] = module
            for group in by_input.values():
                h = hessians[next(iter(group))]
                report.update({f"layers.{index}.{n}": r for n, r in
                               _quantize_modules(group, h, damp, act_order, block_graphs).items()})
            del hessians, h
            clock.lap("solve")
            errs = [report[f"layers.{index}.{n}"] for n in modules]
            log(f"gptq layer {index}: mean rel. output error {sum(e['init_err'] for e in errs) / len(errs):.4f} "
                f"-> {sum(e['gptq_err'] for e in errs) / len(errs):.4f}")
        inputs = inputs.with_hidden(blocks.run_block(layer, inputs))
        layer.to(home)
        clock.lap("forward")
    model.train(was_training)
    log(f"gptq phases: {clock.summary()}")
    return {"layers": report, "seconds": time.perf_counter() - start, "phases": clock.seconds}
