"""What identifies a model, a tokenizer and a run's inputs, cheaply and without trusting names: the hashes a cache
manifest records (tokenizer, teacher), and the weights signature quantisers, adapters and runs record so that a
resume or a reuse on other inputs is refused."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from qat_lora.data.models import local_path
from qat_lora.runtime.files import sha256_file


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the vocabulary and special tokens: equal hashes mean equal token ids for equal text."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "class": type(tokenizer).__name__.replace("Fast", ""),
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


def model_fingerprint(model: nn.Module, name_or_path: str | Path) -> dict:
    """Identity of a teacher: where it came from, and hashes of its config and weights."""
    config = model.config.to_dict()
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    weights = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        weights.update(key.encode())
        weights.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return {"name_or_path": str(name_or_path), "model_type": config.get("model_type"),
            "config_sha256": config_hash, "weights_sha256": weights.hexdigest()}


_SIGNATURE_ROWS = 8  # rows read per tensor: spread over it, so a fine-tune that touches any layer changes them


def weights_signature(name_or_path: str | Path) -> str | None:
    """A cheap identity of a model's weights as stored on disk, read without loading the model: sha256 over
    every safetensors tensor's name, dtype, shape and 8 rows spread over it (a .gguf file: its size and 64
    spread 16 KiB chunks). Two models of the same shapes differ in it; the same weights re-saved by another
    library version do not. None for hub names, pickle checkpoints (nothing to read safely) and damaged files
    (the model loader names those).

    Quantiser and adapter files record it for the model they were made from; a run records it to refuse a
    resume on other weights.
    """
    from safetensors import SafetensorError

    try:
        return _weights_signature(local_path(name_or_path))
    except (SafetensorError, OSError):
        return None


def _weights_signature(path: Path) -> str | None:
    from safetensors import safe_open

    digest = hashlib.sha256()
    if path.is_file() and path.suffix == ".gguf":
        size = path.stat().st_size
        digest.update(str(size).encode())
        with path.open("rb") as f:
            for i in range(64):
                f.seek(i * max(0, size - (1 << 14)) // 63)
                digest.update(f.read(1 << 14))
        return digest.hexdigest()
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    opened = [safe_open(str(f), "pt") for f in files]
    names = sorted((name, i) for i, f in enumerate(opened) for name in f.keys())
    for name, i in names:
        part = opened[i].get_slice(name)
        shape, dtype = part.get_shape(), part.get_dtype()
        digest.update(f"{name}:{dtype}:{shape}".encode())
        rows = sorted({r * (shape[0] - 1) // (_SIGNATURE_ROWS - 1) for r in range(_SIGNATURE_ROWS)}) if shape else []
        for tensor in [part[r:r + 1] for r in rows] if shape and shape[0] else [opened[i].get_tensor(name)]:
            digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def input_identities(model: str, cache: str = "", quantizer: str = "") -> dict[str, str | None]:
    """What a run's or an init's values depend on beyond its flags, cheaply identified (no model load): the
    model's weights (weights_signature), the cache's manifest (it holds every shard's sha256) and the starting
    quantiser's bytes; None for what is not given or cannot be read. Runs and inits record them; a resume or a
    reuse on changed inputs is refused."""
    manifest = Path(cache) / "manifest.json" if cache else None
    return {"model": weights_signature(model),
            "cache": sha256_file(manifest) if manifest and manifest.is_file() else None,
            "quantizer": sha256_file(quantizer) if quantizer and Path(quantizer).is_file() else None}
