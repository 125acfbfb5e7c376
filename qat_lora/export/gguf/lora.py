"""GGUF LoRA adapter (issue 18, item 3): the recovery adapter as a file llama.cpp applies next to the GGUF base.

    qat-lora export --model M --quant q4_0 --adapter runs/x/adapter --format gguf --out exports/q4_0
        gguf/model.gguf     the quantised base
        gguf/adapter.gguf   llama-cli -m gguf/model.gguf --lora gguf/adapter.gguf

Written as llama.cpp's convert_lora_to_gguf lays it out: general.type "adapter", adapter.type "lora",
adapter.lora.alpha; per adapted linear `<base tensor name>.lora_a` (A, [r, in]) and `.lora_b` (B, [out, r]) in
F32, where llama.cpp adds (alpha / r) * B @ A x. The base's names and q/k row order come from arch.py's
`tensor_naming`, so B's rows (for the Llama layout: Llama, Mistral) follow the permuted rows of the base weight
they adapt; Phi-3's fused qkv_proj / gate_up_proj are adapted as the single matrices llama.cpp stores.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from qat_lora.export.gguf.arch import _gguf, gguf_architecture, tensor_naming
from qat_lora.export.gguf.writer import gguf_file

ADAPTER_FILE = "adapter.gguf"


def _adapted_linears(peft_model):
    """(state-dict prefix of the base linear, A [r, in], B [out, r], alpha) for every LoRA-wrapped linear; alpha
    is scaling * r, which llama.cpp divides by r again (so rsLoRA's alpha / sqrt(r) is carried exactly)."""
    for name, module in peft_model.named_modules():
        if not getattr(module, "lora_A", None) or not hasattr(module, "base_layer"):
            continue
        if len(module.active_adapters) != 1:
            raise ValueError("--format gguf: one active adapter per layer is written; merge the others first")
        key = module.active_adapters[0]
        a, b = module.lora_A[key].weight.detach().float(), module.lora_B[key].weight.detach().float()
        prefix = name.removeprefix("base_model.model.")
        yield prefix, a.cpu().numpy(), b.cpu().numpy(), float(module.scaling[key]) * a.shape[0]


@torch.no_grad()
def save_gguf_lora(peft_model, out_dir: str | Path, name: str = "recovery-lora") -> dict:
    """Write `out_dir/adapter.gguf` for a PEFT LoRA model of a GGUF_ARCHITECTURES family; atomic (temporary name,
    then rename).

    Returns:
        {"file", "bytes", "alpha", "rank", "tensors"}.
    Raises:
        ValueError: an architecture the GGUF base cannot have, no adapted linear, or layers with different
            alpha / r (llama.cpp stores one).
    """
    gguf = _gguf()
    config = peft_model.get_base_model().config
    arch = gguf_architecture(config).arch
    gguf_name, permuted = tensor_naming(config)
    layers = list(_adapted_linears(peft_model))
    if not layers:
        raise ValueError("--adapter: no LoRA layer found; pass a run's adapter/ folder")
    ratios = {round(alpha / a.shape[0], 6) for _, a, _, alpha in layers}
    if len(ratios) != 1:
        raise ValueError("--format gguf: the adapter's layers use different alpha / rank; llama.cpp stores one alpha, "
                         "use --merge-adapter or the PEFT adapter/")
    alpha = layers[0][3]
    with gguf_file(out_dir, ADAPTER_FILE, arch) as (writer, path):
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_name(name)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        for prefix, a, b, _ in layers:
            base = gguf_name(f"{prefix}.weight")
            writer.add_tensor(f"{base}.lora_a", np.ascontiguousarray(a, dtype=np.float32))
            writer.add_tensor(f"{base}.lora_b",
                              np.ascontiguousarray(permuted(f"{prefix}.weight", b), dtype=np.float32))
    return {"file": str(path), "bytes": path.stat().st_size, "alpha": alpha, "rank": int(layers[0][1].shape[0]),
            "tensors": 2 * len(layers)}
