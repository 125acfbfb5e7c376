"""The full-precision part of an exported student: every tensor beside its quantised linears, as the packed, GGUF
and compressed-tensors formats all store it (each format lays out the quantised linears itself); and the packed
format's bit stream of integer codes."""
from __future__ import annotations

import numpy as np
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


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes into a little-endian bit stream, `bits` bits per code.

    Args:
        codes: any shape, integers in [0, 2^bits).
    Returns:
        [ceil(numel * bits / 8)] uint8.
    """
    flat = codes.reshape(-1).to(torch.uint8).numpy()
    bit_planes = np.unpackbits(flat[:, None], axis=1, bitorder="little")[:, :bits]  # [N, bits]
    return torch.from_numpy(np.packbits(bit_planes.reshape(-1), bitorder="little"))


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of `pack_codes`: [numel] uint8 codes."""
    bit_stream = np.unpackbits(packed.numpy(), bitorder="little")[: numel * bits].reshape(numel, bits)
    weights = (1 << np.arange(bits, dtype=np.uint16))
    return torch.from_numpy((bit_stream.astype(np.uint16) * weights).sum(1).astype(np.uint8))
