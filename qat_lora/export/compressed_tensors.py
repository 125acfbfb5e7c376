"""compressed-tensors export (issue 18, item 2): the `pack-quantized` layout that transformers (with the
compressed-tensors package) and vLLM load natively.

    qat-lora export --model M --quant w4g32 --format compressed-tensors --out exports/w4g32
        compressed-tensors/  config.json (quantization_config), model.safetensors, tokenizer

Per quantised linear: `weight_packed` (int32; 32 / b signed codes per word, code j of a word at bits j*b..,
each stored as q + 2^(b-1)), `weight_scale` [out, groups] in the model's dtype, `weight_shape` [2], and for
asymmetric grids `weight_zero_point` (int32, packed the same way along the output dimension). The runtime
computes W = (q - zp) * scale; with our code c in [0, 2^b) stored as q = c - 2^(b-1) and
zp = round(z) - qmin - 2^(b-1), q - zp = c + qmin - round(z): exactly our grid (DESIGN §4), so the weights
it rebuilds equal the student's Wq. Only widths that divide 32 (2, 4, 8 bits) are written: there every
compressed-tensors version packs the same way (3-bit words are laid out differently across versions, and
vLLM's kernels take 4 and 8 bits). LUT grids, low-rank scales and llama.cpp's float offsets (q4_1) have no
compressed-tensors form.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from qat_lora.runtime.files import atomic_write_json, save_pretrained, save_safetensors
from qat_lora.export.tensors import full_precision_tensors  # full-precision tensors, tied head skipped
from qat_lora.quant.fake_quant import FakeQuantLinear, quantised_layers
from qat_lora.quant.config import QuantConfig
from qat_lora.quant.quantizer import quantizer_for

CT_DIR = "compressed-tensors"
CT_BITS = (2, 4, 8)
WEIGHTS_FILE = "model.safetensors"


def unsupported_reason(cfg: QuantConfig) -> str | None:
    """Why a preset (or any of its per-module overrides) has no compressed-tensors layout, or None."""
    if cfg.overrides:  # written as one config group per grid, but transformers 5 dequantizes the second group wrong
        return "per-module grids (a mixed preset), which transformers does not read back exactly"
    reasons = (quantizer_for(c).compressed_tensors_reason() for c in (cfg, *(o for _, o in cfg.overrides)))
    return next((r for r in reasons if r), None)


def check_supported(cfg: QuantConfig, preset: str) -> None:
    """Raises ValueError naming the alternatives when `--format compressed-tensors` cannot write `preset`."""
    reason = unsupported_reason(cfg)
    if reason:
        raise ValueError(f"--format compressed-tensors: --quant {preset} uses {reason}; compressed-tensors takes int "
                         "2/4/8-bit presets (w2g32, w2g64, w4g32, w4g64, w4pc, w8pc, q4_0, q8_0); export this one "
                         "with --format gguf, packed or dense")


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed codes in [-2^(b-1), 2^(b-1)) along the last dimension, 32 / b per int32 word, code j of a
    word at bit j * b, each offset by 2^(b-1) (compressed-tensors' pack_to_int32 for widths dividing 32).

    Args:
        values: [rows, cols] integers.
    Returns:
        [rows, ceil(cols * b / 32)] int32.
    """
    per_word = 32 // bits
    u = (values.to(torch.int64) + (1 << (bits - 1))).numpy().astype(np.uint64)
    rows, cols = u.shape
    u = np.pad(u, ((0, 0), (0, -cols % per_word))).reshape(rows, -1, per_word)
    shifts = (np.arange(per_word, dtype=np.uint64) * np.uint64(bits))
    words = (u << shifts).sum(-1).astype(np.uint32)  # no bits overlap: the sum is the bitwise or
    return torch.from_numpy(words.view(np.int32).copy())


def _layer_tensors(name: str, layer: FakeQuantLinear, dtype: torch.dtype) -> tuple[dict, bool]:
    """The compressed tensors of one linear and whether its grid is symmetric (no zero point stored)."""
    cfg, half = layer.cfg, 1 << (layer.cfg.bits - 1)
    zero = layer.stored_quant_parameters()["zero"]  # the integer zero the grid uses (0 without a zero point)
    zp = (zero - cfg.qmin - half).to(torch.int64)  # [out, groups]
    if zp.min() < -half or zp.max() >= half:
        raise ValueError(f"--format compressed-tensors: {name} has zero points outside its {cfg.bits}-bit grid "
                         "(trained past it); export it with --format packed or dense")
    q = layer.codes().to(torch.int64) - half  # [out, in]: the signed code the runtime stores
    out = {f"{name}.weight_packed": pack_int32(q, cfg.bits),
           f"{name}.weight_scale": layer.scale.detach().to(dtype).contiguous(),
           f"{name}.weight_shape": torch.tensor(list(layer.weight.shape), dtype=torch.int64)}
    symmetric = bool(cfg.symmetric and not zp.any())
    if not symmetric:
        out[f"{name}.weight_zero_point"] = pack_int32(zp.T.contiguous(), cfg.bits).T.contiguous()
    return out, symmetric


def _weights_args(layer: FakeQuantLinear, symmetric: bool) -> dict:
    # The preset's strategy, not the layer's: a 64-wide layer under g64 stays "group", so one config group covers
    # the model (transformers' load-time dequantiser applies a single scheme to every dense layer).
    per_channel = layer.cfg.group_size is None
    return {"num_bits": layer.cfg.bits, "type": "int", "symmetric": symmetric,
            "group_size": None if per_channel else layer.group_size,
            "strategy": "channel" if per_channel else "group", "dynamic": False, "actorder": None,
            "observer": "minmax", "observer_kwargs": {}}


@torch.no_grad()
def save_compressed_tensors(model: nn.Module, out_dir: str | Path, quant: QuantConfig, preset: str,
                            tokenizer=None) -> dict:
    """Write `out_dir` as a compressed-tensors pack-quantized folder for a fake-quant student (no PEFT wrapper).

    Returns:
        {"bytes": weights file size, "groups": number of config groups, "layers": quantised linears}.
    Raises:
        ValueError: the preset or a trained zero point has no compressed-tensors form (names the alternatives).
    """
    check_supported(quant, preset)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    layers = quantised_layers(model)
    tensors, groups = {}, {}
    for name, layer in layers.items():
        parts, symmetric = _layer_tensors(name, layer, dtype)
        tensors.update(parts)
        args = json.dumps(_weights_args(layer, symmetric), sort_keys=True)  # one config group per distinct grid
        groups.setdefault(args, []).append(name)
    tensors.update(full_precision_tensors(model, layers))
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {f"group_{i}": {"targets": names, "weights": json.loads(args), "input_activations": None,
                                         "output_activations": None, "format": "pack-quantized"}
                          for i, (args, names) in enumerate(groups.items())},
        "ignore": [], "kv_cache_scheme": None, "global_compression_ratio": None}
    save_safetensors(tensors, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    atomic_write_json(out_dir / "config.json", config)
    if getattr(model, "generation_config", None) is not None:
        save_pretrained(model.generation_config, out_dir)
    if tokenizer is not None:
        save_pretrained(tokenizer, out_dir)
    return {"bytes": (out_dir / WEIGHTS_FILE).stat().st_size, "groups": len(groups), "layers": len(layers)}

