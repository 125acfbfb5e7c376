"""Recovery LoRA over the quantised linears (DESIGN §5), through PEFT.

PEFT wraps each FakeQuantLinear (as `base_layer`) in quant/lora_layer.QuantLoraLinear, registered through its
custom-module dispatch when adapters are added or loaded here: PEFT's own forward, merges that act on Wq. B starts at
zero, so the adapted student equals the quantised student at step 0, unless `calibrated_lora_init_` sets each
pair to the best rank-r correction of its layer's quantisation error. Nothing on the base path is detached:
gradients flow through the frozen quantised weights to earlier adapters.
"""
from __future__ import annotations

import contextlib
import math
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from qat_lora.quant import blocks

from qat_lora.data import models
from qat_lora.quant.calibration import calibration_batches
from qat_lora.quant.gptq import collect_hessians
from qat_lora.quant.fake_quant import FakeQuantLinear, quantised_layers
from qat_lora.runtime import device as dev


def add_recovery_lora_(model: nn.Module, r: int = 16, alpha: float = 32.0, dropout: float = 0.0):
    """Wrap `model` in a PEFT model with LoRA adapters on every quantised linear; the base is frozen.

    Returns:
        the PeftModel (PEFT returns a new wrapper; the underlying modules are changed in place).
    Raises:
        ValueError: no quantised linear (call quantize_ first) or a non-positive rank.
    """
    from peft import LoraConfig, get_peft_model

    from qat_lora.quant.lora_layer import register_quant_lora

    if r <= 0:
        raise ValueError(f"--lora-r {r}: must be positive")
    names = list(quantised_layers(model))
    if not names:
        raise ValueError("add_recovery_lora_: the model has no quantised linear; call quantize_(model, preset) first")
    # Short leaf names ("q_proj", ...) keep adapter_config.json portable; fall back to full names when a
    # leaf name also belongs to a module left in full precision.
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
    clash = any(name.rsplit(".", 1)[-1] in leaves and not isinstance(module, FakeQuantLinear)
                for name, module in model.named_modules() if name)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=names if clash else leaves,
                        bias="none",
                        task_type="CAUSAL_LM")
    with _quiet_peft():
        return get_peft_model(model, register_quant_lora(config))


def load_recovery_lora(model: nn.Module, adapter_dir: str | Path):
    """Attach saved PEFT adapters (a run's `adapter/` folder or a checkpoint's) to a quantised student, each quantised
    linear wrapped in QuantLoraLinear (plain PEFT's `from_pretrained` would wrap it in its stock Linear, whose
    merges act on the latent weight)."""
    from peft import LoraConfig, PeftModel

    from qat_lora.quant.lora_layer import register_quant_lora

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").exists():
        raise ValueError(f"--adapter {adapter_dir}: no adapter_config.json; pass a run's adapter/ folder")
    from safetensors import SafetensorError

    try:
        config = register_quant_lora(LoraConfig.from_pretrained(str(adapter_dir)))
        with _quiet_peft():
            return PeftModel.from_pretrained(model, str(adapter_dir), config=config)
    except SafetensorError as e:
        raise ValueError(f"--adapter {adapter_dir}: its weights are damaged or truncated ({e}); use the run's intact "
                         "adapter/ or a checkpoint's") from None
    except RuntimeError as e:  # load_state_dict's size mismatch: the adapter was trained on another model
        mismatch = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), None)
        if mismatch is None:
            raise
        detail = mismatch.removeprefix("size mismatch for ").rstrip(".")
        raise ValueError(f"--adapter {adapter_dir}: made for another model ({detail}); pass the --model its run "
                         "trained") from None


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """PEFT reads transformers 5's deprecated `is_gradient_checkpointing` each time it wraps a model: a FutureWarning
    about the libraries' internals that a user can do nothing about, silenced here only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def _lora_layers(layer: nn.Module) -> dict[str, nn.Module]:
    """PEFT LoRA modules of one decoder layer whose base is a quantised linear, by name within the layer."""
    return {name: m for name, m in layer.named_modules()
            if isinstance(getattr(m, "base_layer", None), FakeQuantLinear) and getattr(m, "lora_A", None)}


def whitening_factor(hessian: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """L with L Lᵀ = H + damp x mean diag(H) x I (float64 Cholesky, where H is): the damping keeps dead input
    columns from blowing up the whitened error. Modules fed the same input (q/k/v) share one."""
    h = hessian.double()
    h = h + damp * h.diagonal().mean().clamp(min=1e-12) * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    return torch.linalg.cholesky(h)


def _top_singular_pairs(m: torch.Tensor, r: int, method: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U_r [out, r], S_r² [r] (descending) and V_rᵀ [r, in] of `m`.

    exact: the eigendecomposition of m's smaller Gram matrix (S² and U or V), float64, 2-20x faster than a full
    SVD at a linear's shapes on the CPU. randomized (Halko et al.'s range finder): k = max(2r, r + 16) seeded
    Gaussian probes, 8 power iterations re-orthonormalised by QR, then the SVD of the k x in projection: a few
    skinny GEMMs instead of an eigh of the full Gram matrix (on one H200 the 1B's calibrated start took 34 s with
    either, so the solve is not where that time goes: see its phases). On flat spectra (quantisation noise) it
    keeps >= 99.5 % of the optimal energy (tests/test_lora.py).
    """
    tall = m.shape[0] > m.shape[1]
    wide_m = m.T if tall else m  # rows <= columns: every Gram and probe on the short side
    if method == "randomized":
        k = min(max(2 * r, r + 16), wide_m.shape[0])
        g = torch.Generator(device=m.device).manual_seed(0)
        probe = torch.randn(wide_m.shape[1], k, dtype=m.dtype, device=m.device, generator=g)
        sketch = wide_m @ probe
        for _ in range(8):
            basis = torch.linalg.qr(sketch).Q
            sketch = wide_m @ (wide_m.T @ basis)
        basis = torch.linalg.qr(sketch).Q
        u_small, s, vh = torch.linalg.svd(basis.T @ wide_m, full_matrices=False)
        u, energy = basis @ u_small[:, :r], s[:r] ** 2
        vh = vh[:r]
    else:
        energy, u = torch.linalg.eigh(wide_m @ wide_m.T)  # ascending
        energy, u = energy.flip(0)[:r].clamp(min=0.0), u.flip(1)[:, :r]
        root = energy.sqrt()
        inverse_root = torch.where(root > 0, 1.0 / root, torch.zeros_like(root))  # a zero direction adds nothing
        vh = inverse_root[:, None] * (u.T @ wide_m)
    return (vh.T, energy, u.T) if tall else (u, energy, vh)


def low_rank_correction(delta: torch.Tensor, factor: torch.Tensor, r: int, method: str = "auto"
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rank-r product closest to `delta` in the output norm of inputs with second moment H = L Lᵀ.

    min over rank-r C of tr((delta - C) H (delta - C)ᵀ) = ‖(delta - C) Xᵀ‖² / n for H = XᵀX / n: with `factor`
    L from `whitening_factor`, the SVD M = delta L = U S Vᵀ gives C = U_r S_r V_rᵀ L⁻¹ (Eckart-Young in the
    whitened space). Only r singular pairs are used (`_top_singular_pairs`; method auto: randomized on CUDA when
    the matrix is at least 4 probes wide, exact otherwise, so CPU results stay exact).

    Returns:
        (left [out, r], right [r, in], kept [r], total) in float64 with C = left @ right, split so both factors
        carry sqrt(S_r); kept: S_r², the output error energy each direction removes, descending; total: ‖M‖²,
        the energy before (so 1 - kept.sum() / total is the share left).
    """
    m = delta.double().to(factor.device) @ factor
    r = min(r, *m.shape)
    if method == "auto":
        method = "randomized" if m.device.type == "cuda" and 4 * max(2 * r, r + 16) <= min(m.shape) else "exact"
    u, energy, vh = _top_singular_pairs(m, r, method)
    half = energy.pow(0.25)  # sqrt(S_r): each factor carries half the scale
    left, right_white = u * half, half[:, None] * vh
    # (sqrt(S_r) V_rᵀ) L⁻¹ = (L⁻ᵀ (sqrt(S_r) V_rᵀ)ᵀ)ᵀ: one triangular solve instead of an inverse.
    right = torch.linalg.solve_triangular(factor.T, right_white.T, upper=True).T
    return left, right, energy, m.square().sum()


@torch.no_grad()
def calibrated_lora_init_(model: nn.Module, reference: nn.Module, batches: list[torch.Tensor], damp: float = 0.01,
                          log: Callable[[str], None] = print, device: torch.device | str | None = None) -> dict:
    """Set every recovery LoRA pair to the best rank-r correction of its layer's quantisation error on
    calibration inputs, instead of B = 0 (the idea of LoftQ / CLoQ, in GPTQ's output metric).

    For a quantised linear with full-precision weight W (from `reference`), grid weight Wq and inputs X seen in
    the student, scale·B·A := the rank-r minimiser of ‖(W - Wq - scale·B·A) Xᵀ‖ (`low_rank_correction`). Decoder
    blocks go in order, each fed the outputs of the already corrected block before it, so later corrections see
    the inputs they will get. On Gemma 3 270M w3g64 after GPTQ, rank 16 holds about a quarter of that error's
    energy (docs/RESULTS.md).

    Args:
        model: the PEFT model from `add_recovery_lora_` (adapters not yet trained).
        reference: the full-precision model the student was quantised from (same architecture, not quantised).
        batches: input_ids [B, L] (training text, never the evaluation text).
        device: where each decoder layer (student and reference) runs in turn, then goes back where it was
            (None: where it is); the Cholesky and SVD run there on CUDA, else on the host (XLA lowers neither).
    Returns:
        {"layers": {name: share of the layer's output error removed}, "removed": mean share, "seconds", "phases":
        {capture, hessians, solve, forward: seconds} (CUDA: the device waited for at each boundary)}.
    Raises:
        ValueError: the model has no LoRA over a quantised linear, or `reference` has other layers.
    """
    start, was_training = time.perf_counter(), model.training
    model.eval()
    layers, ref_layers = blocks.decoder_layers(model), blocks.decoder_layers(reference)
    if len(layers) != len(ref_layers):
        raise ValueError(f"calibrated_lora_init_: the reference model has {len(ref_layers)} decoder layers, the "
                         f"student {len(layers)}; pass the model the student was quantised from")
    if not any(_lora_layers(layer) for layer in layers):
        raise ValueError("calibrated_lora_init_: no LoRA adapter over a quantised linear; call add_recovery_lora_ "
                         "first")
    clock = dev.PhaseClock(device if device is not None else next(model.parameters()).device)
    inputs = blocks.capture_block_inputs(model, batches).kept_on(clock.device)
    clock.lap("capture")
    removed: dict[str, float] = {}
    for index, (layer, ref_layer) in enumerate(zip(layers, ref_layers)):
        loras = _lora_layers(layer)
        homes = [next(m.parameters()).device for m in (layer, ref_layer)]
        run_on = torch.device(device) if device is not None else homes[0]
        solve_on = run_on if run_on.type == "cuda" else torch.device("cpu")
        layer.to(run_on)
        ref_layer.to(run_on)
        if loras:
            hessians = collect_hessians(layer, inputs, {n: m.base_layer for n, m in loras.items()}, to=solve_on)
            clock.lap("hessians")
            factors: dict[int, torch.Tensor] = {}  # one Cholesky per distinct input (q/k/v share theirs)
            for name, lora in loras.items():
                key = lora.active_adapters[0]
                a, b = lora.lora_A[key].weight, lora.lora_B[key].weight
                base = lora.base_layer
                delta = ref_layer.get_submodule(name).weight.detach().to(solve_on, torch.float64) - \
                    base.quantized_weight().detach().to(solve_on, torch.float64)
                h = hessians[name]
                if id(h) not in factors:
                    factors[id(h)] = whitening_factor(h, damp)
                left, right, kept, total = low_rank_correction(delta, factors[id(h)], a.shape[0])
                # PEFT adds scaling x B(A(x)): fold 1/scaling into both factors equally.
                fold = 1.0 / math.sqrt(float(lora.scaling[key]))
                b.copy_((left * fold).to(b.dtype))
                a.copy_((right * fold).to(a.dtype))
                removed[f"layers.{index}.{name}"] = float(kept.sum() / total.clamp(min=1e-300))
            clock.lap("solve")
        inputs = inputs.with_hidden(blocks.run_block(layer, inputs))
        layer.to(homes[0])
        ref_layer.to(homes[1])
        clock.lap("forward")
    model.train(was_training)
    share = sum(removed.values()) / len(removed)
    log(f"calibrated LoRA init: {share:.1%} of the layers' output error energy removed on average "
        f"({time.perf_counter() - start:.0f} s: {clock.summary()})")
    return {"layers": removed, "removed": share, "seconds": time.perf_counter() - start, "phases": clock.seconds}


def lora_start_(model: nn.Module, lora_init: str, model_path: str, cache_dir: str, sequences: int, batch_size: int,
                log: Callable[[str], None] = print, device: torch.device | str | None = None) -> dict:
    """Set a fresh PEFT model's adapters as `lora_init` says: "calibrated" (`calibrated_lora_init_` on the first
    `sequences` training sequences of a KD cache, all if it holds fewer, against `model_path`'s full-precision
    weights, one decoder layer at a time on `device`) or a saved adapter folder (its A and B copied in). "zero"
    leaves them as PEFT made them.

    Raises:
        ValueError: the folder's adapter covers other modules or shapes (TrainConfig checks rank and alpha).
    """
    if lora_init == "zero":
        return {}
    if lora_init == "calibrated":
        from qat_lora.cache.reader import KDCache

        batches = calibration_batches(cache_dir, min(sequences, KDCache(cache_dir).num_sequences("train")),
                                      batch_size)
        return calibrated_lora_init_(model, models.load_causal_lm(model_path), batches, log=log, device=device)
    _copy_adapter_(model, Path(lora_init))
    log(f"LoRA starts from the adapters in {lora_init}")
    return {"from": lora_init}


@torch.no_grad()
def _copy_adapter_(model: nn.Module, folder: Path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(folder / "adapter_model.safetensors"))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"--lora-init {folder}: its adapter_model.safetensors cannot be read ({e}); pass an intact "
                         "adapter folder") from None
    try:
        result = set_peft_model_state_dict(model, state)
    except RuntimeError as e:  # shapes: an adapter made for another model
        raise ValueError(f"--lora-init {folder}: made for another model ({str(e).splitlines()[-1].strip()})") from None
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"--lora-init {folder}: its adapters cover other modules (missing "
                         f"{(missing or ['none'])[0]}, unexpected {(result.unexpected_keys or ['none'])[0]}); pass "
                         "an adapter made for this model and preset")
