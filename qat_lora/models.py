"""Loading teachers and students: a transformers directory, a GGUF file, or (when online) a hub name.

Also the identities the cache manifest records: a tokenizer hash and a teacher fingerprint.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from . import device as dev
from .files import first_line


def _looks_like_path(name: str) -> bool:
    # Hub names are "name" or "org/name"; anything else path-shaped is a path that must exist.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith(".gguf")


def _location(name_or_path: str | Path) -> tuple[str, dict]:
    """(what from_pretrained takes, extra kwargs); GGUF files are opened through their folder + gguf_file."""
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model {name}: folder has no config.json; pass a transformers model folder or a .gguf file")
        return str(path), {}
    if path.is_file():
        raise ValueError(f"model {name}: a file, not a model; pass a transformers model folder or a .gguf file")
    if path.exists() or _looks_like_path(name):
        raise ValueError(f"model {name}: no such model folder or .gguf file")
    return name, {}  # a hub name


def load_tokenizer(name_or_path: str | Path):
    dev.keep_torch_xla_unloaded()  # importing transformers imports accelerate, which imports torch_xla
    from transformers import AutoTokenizer

    location, kwargs = _location(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(location, **kwargs)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exception on a damaged file
        raise ValueError(f"tokenizer of {name_or_path}: cannot load ({first_line(e)}); is the file complete?") from None


def load_causal_lm(name_or_path: str | Path, *, dtype: torch.dtype = torch.float32,
                   attn_implementation: str | None = None) -> nn.Module:
    """A transformers causal LM in eval mode on the CPU, fp32 by default.

    Raises:
        ValueError: missing path or unloadable model, in one line naming it.
    """
    dev.keep_torch_xla_unloaded()
    from transformers import AutoModelForCausalLM

    location, kwargs = _location(name_or_path)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    from safetensors import SafetensorError

    try:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs)
    except SafetensorError as e:  # a weights file cut short by a full disk or an interrupted copy
        raise ValueError(f"model {name_or_path}: a weights file is damaged or truncated ({first_line(e)}); copy or "
                         "download the model again") from None
    except OSError as e:
        raise ValueError(f"model {name_or_path}: cannot load ({first_line(e)})") from None
    return model.eval()


def max_positions(model: nn.Module) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def vocab_size(model: nn.Module) -> int:
    """Width of the logits (may exceed len(tokenizer) when the embedding is padded)."""
    return model.get_output_embeddings().weight.shape[0]


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


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the decoder stack returning final normed hidden states, the output projection) of a causal LM,
    PEFT-wrapped or not, so the loss can run lm_head itself, chunk by chunk.

    Raises:
        ValueError: models whose logits are not a plain projection of the hidden states (soft-capping, scaling).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", 1.0) not in (None, 1.0):
        raise ValueError(f"{config.model_type}: logits are soft-capped or scaled; use --loss-chunk-size 0")
    return base.get_decoder(), base.get_output_embeddings()


def head_weight_and_bias(head: nn.Module) -> tuple["torch.Tensor", "torch.Tensor | None"]:
    """The effective output-projection weight (fake-quantised if the head was quantised) and bias."""
    weight = head.quantized_weight() if hasattr(head, "quantized_weight") else head.weight
    return weight, head.bias
