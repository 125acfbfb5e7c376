"""The full-precision part of an exported student: every tensor beside its quantised linears, as the packed, GGUF
and compressed-tensors formats all store it (each format lays out the quantised linears itself)."""
from __future__ import annotations

import torch
from torch import nn

from qat_lora.quant.fake_quant import FakeQuantLinear


def full_precision_tensors(model: nn.Module, layers: dict[str, FakeQuantLinear]) -> dict[str, torch.Tensor]:
    """State-dict tensors outside the quantised `layers`' latent weights and quantisers, detached on the CPU, each
    storage once: a head tied to the input embeddings shares their storage and is left out (llama.cpp reads a
    missing output.weight as "reuse token_embd"; the packed loader and transformers tie it again)."""
    skip = {f"{n}.{k}" for n, layer in layers.items() for k in ("weight", *layer.quant_parameters())}
    out, seen = {}, set()
    for key, tensor in model.state_dict().items():
        if key in skip or (tensor.numel() and tensor.data_ptr() in seen):  # empty tensors all point at 0
            continue
        seen.add(tensor.data_ptr())
        out[key] = tensor.detach().cpu().contiguous()
    return out
