"""The quantiser's state: its tensors by name, `quantizer.safetensors` (written, read, checked for codes), and
what the quantised base costs to store (bits per weight).

A state names each tensor as in the plain quantised student (`model.layers.0.mlp.up_proj.scale`), PEFT wrapper or
not; a student whose weights moved off the base model's (GPTQ, block-wise, weight-qat) also stores each layer's
integer codes (`....codes`), and loading them puts its latent weights back on the grid. A student whose
normalisation weights trained (`--train-norms`) stores them too (`model.layers.0.input_layernorm.weight`): they
are full-precision vectors every format ships anyway, so they cost no bits, and they belong to the same base.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from qat_lora.runtime import device as dev

from qat_lora.quant.fake_quant import FakeQuantLinear, quantised_layers
from qat_lora.runtime.files import first_line, save_safetensors

CODES_KEY = "codes"  # a quantiser state's integer codes of a layer whose weights moved
# The base model a quantiser or adapter was made from (identities.weights_signature): in the quantiser's safetensors
# metadata, and in a small JSON beside the adapter's PEFT files (PEFT ignores it). Files without it load unchecked.
MODEL_SIGNATURE_KEY = "qat_lora.model_signature"


def _state_name(module_name: str) -> str:
    """A module's name as the plain quantised student spells it, with or without PEFT's wrapping."""
    return module_name.removeprefix("base_model.model.").replace(".base_layer", "")


def norm_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The normalisation layers' own parameters (RMSNorm / LayerNorm gains and biases; Gemma's q/k norms too),
    named as in the plain student, PEFT wrapper or not: full-precision vectors that scale the inputs of the
    quantised linears (a per-channel rescale the grid itself cannot make) and ship at fp16 whatever the grid."""
    return {f"{_state_name(name)}.{key}": p for name, module in model.named_modules()
            if "norm" in type(module).__name__.lower() for key, p in module.named_parameters(recurse=False)}


def quantizer_state_dict(model: torch.nn.Module, codes: bool = False, norms: bool = False
                         ) -> dict[str, torch.Tensor]:
    """Quantiser parameters named as in the plain quantised student (`model.layers.0.mlp.up_proj.scale`),
    whether or not `model` is wrapped by PEFT; with `codes`, also each layer's integer codes
    (`....codes`, uint8 [out, in]): the state of a student whose weights moved (GPTQ, weight-qat), on the grid;
    with `norms`, also the normalisation weights (norm_parameters: a student whose norms trained)."""
    out = dict(norm_parameters(model)) if norms else {}
    for name, module in model.named_modules():
        if isinstance(module, FakeQuantLinear):
            base = _state_name(name)
            out.update({f"{base}.{key}": p for key, p in module.quant_parameters().items()})
            if codes:
                out[f"{base}.{CODES_KEY}"] = module.codes()
    return out


@torch.no_grad()
def load_quantizer_state_(model: torch.nn.Module, path: str | Path) -> None:
    """Copy a run's `quantizer.safetensors` into a quantised student built with the same --quant.

    Raises:
        ValueError: a tensor is missing or has another shape (the file belongs to another model or preset).
    """
    try:
        saved = load_file(str(path))
    except SafetensorError as e:
        raise ValueError(f"--quantizer {path}: damaged or truncated ({first_line(e)}); use the run's intact copy or "
                         "rerun the stage that wrote it") from None
    params = quantizer_state_dict(model)
    missing = sorted(set(params) - set(saved))
    if missing:
        raise ValueError(f"{path}: no value for {missing[0]} ({len(missing)} missing); build the student with the "
                         "run's --model and --quant")
    for name, p in params.items():
        if saved[name].shape != p.shape:
            raise ValueError(f"{path}: {name} has shape {tuple(saved[name].shape)}, the student's is "
                             f"{tuple(p.shape)}; build the student with the run's --model and --quant")
        p.copy_(saved[name].to(p.device, p.dtype))
    for name, module in model.named_modules():  # moved weights: the latent weight becomes its on-grid value
        key = f"{_state_name(name)}.{CODES_KEY}"
        if isinstance(module, FakeQuantLinear) and key in saved:
            codes = saved[key]
            if codes.shape != module.weight.shape:
                raise ValueError(f"{path}: {key} has shape {tuple(codes.shape)}, the student's weight is "
                                 f"{tuple(module.weight.shape)}; build the student with the run's --model")
            module.weight.copy_(module.dequantize_codes(codes.to(module.weight.device)))
            module.hold_codes = True  # on the grid, LSQ's scale gradient is 0: hold the codes instead (fake_quant.py)
    for name, p in norm_parameters(model).items():  # trained norms, where the file has them
        if name in saved:
            if saved[name].shape != p.shape:
                raise ValueError(f"{path}: {name} has shape {tuple(saved[name].shape)}, the student's is "
                                 f"{tuple(p.shape)}; build the student with the run's --model")
            p.copy_(saved[name].to(p.device, p.dtype))


def save_quantizer_state(model: torch.nn.Module, path: Path, codes: bool = False,
                         model_signature: str | None = None, norms: bool = False) -> None:
    """Write `quantizer_state_dict(model, codes, norms)` to `path` atomically (temp name, then rename), recording
    the signature of the base model it belongs to."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = dev.state_dict_to_cpu(quantizer_state_dict(model, codes, norms))  # one transfer from an XLA device
    save_safetensors({k: v.contiguous() for k, v in state.items()}, path,
                     {MODEL_SIGNATURE_KEY: model_signature} if model_signature else None)


def _state_keys(path: str | Path) -> list[str]:
    from safetensors import safe_open

    if not path:
        return []
    try:
        with safe_open(str(path), "pt") as f:
            return list(f.keys())
    except SafetensorError as e:
        raise ValueError(f"--quantizer {path}: damaged or truncated ({first_line(e)})") from None


def has_codes(path: str | Path) -> bool:
    """Whether a quantiser state file carries codes (its student's weights moved from the base model's)."""
    return any(key.endswith("." + CODES_KEY) for key in _state_keys(path))


def has_norms(path: str | Path) -> bool:
    """Whether a quantiser state file carries normalisation weights (its student's norms trained)."""
    return any(key.rsplit(".", 2)[-2].endswith("norm") for key in _state_keys(path) if key.count(".") >= 2)


def layer_bits(layer: FakeQuantLinear) -> int:
    """Storage bits of one quantised linear: codes at their width plus every quantiser tensor as stored (fp16;
    a K-quant's integer sub-block scales at their own width)."""
    return layer.quantizer.storage_bits(layer.out_features, layer.in_features)


# What a full-precision model's weights ship at (bf16 / fp16), whatever dtype it was evaluated in: the reference
# every quantised row's bits per weight stands beside (the demo's table, README's headline, the results).
FULL_PRECISION_BITS = 16.0


def quantised_weight_count(model: torch.nn.Module) -> int:
    """Weights of the quantised linears (at least 1: the denominator of every bits-per-weight figure)."""
    return max(1, sum(m.weight.numel() for m in quantised_layers(model).values()))


def bits_per_weight(model: torch.nn.Module) -> float:
    """Mean storage bits per quantised weight, scales, zeros, codebooks and low-rank factors included."""
    layers = quantised_layers(model).values()
    return sum(layer_bits(m) for m in layers) / quantised_weight_count(model)
