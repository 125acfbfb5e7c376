"""The model families `--format gguf` writes, as llama.cpp's converter (convert_hf_to_gguf.py) lays them out
(issue 28): which llama.cpp architecture each transformers model_type becomes, its `<arch>.*` hyper-parameter
keys, the names of its tensors, and what the converter does to them on the way:

    llama, mistral  -> llama:  q/k rows permuted (llama.cpp's rope pairs neighbouring dimensions, HF's halves);
                       no sliding window (a Mistral whose window is shorter than its context is refused);
                       Llama 3.1+ rope scaling (rope_type llama3) as llama.cpp's `rope_freqs.weight`: head_dim / 2
                       F32 factors it divides each rope frequency by, and no rope scaling keys
    qwen2, qwen3    -> qwen2 / qwen3: NEOX rope, rows as they are; q/k/v biases, q/k norms
    gemma3_text     -> gemma3: every RMSNorm weight stored as 1 + w (HF's Gemma3RMSNorm computes x * (1 + w));
                       the embedding scale sqrt(hidden) and the tied head are llama.cpp's own; sliding-window
                       layers with their own rope base
    phi3            -> phi3:   fused qkv_proj and gate_up_proj, which HF already stores fused: the same matrices;
                       llama.cpp runs it without a sliding window (a shorter window than the context is refused)

Permuting rows moves whole rows, so every quantisation block (a run of columns of one row) lands intact, and a
+1 on a norm touches only full-precision vectors: the quantised linears stay bit-exact in every family.
Anything llama.cpp would compute differently (rope scaling other than linear, or than linear and llama3 on the
llama architecture; Gemma's attention scale other than 1/sqrt(head_dim), Qwen2's sliding window, ...) is refused in
one line that names the formats that work.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

OTHER_FORMATS = "use --format packed, dense or compressed-tensors"


def _gguf():
    try:
        import gguf
    except ImportError as e:  # an optional extra: say how to get it
        raise ValueError("--format gguf needs the gguf package: pip install 'qat-lora[gguf]'") from e
    return gguf


class GGUFFamily(NamedTuple):
    """How one transformers model_type is written for llama.cpp."""
    arch: str  # llama.cpp's architecture name (general.architecture, the `<arch>.` key prefix)
    permute_qk: bool  # q/k rows (and biases, and a LoRA B) reordered for llama.cpp's non-NEOX rope
    norm_shift: float  # added to every `*norm.weight` (Gemma: llama.cpp multiplies by the stored weight)
    keys: Callable  # (writer, config) -> None: the architecture's own hyper-parameter keys


def _rope(config) -> tuple[dict, dict | None]:
    """(global rope parameters, sliding-window layers' rope parameters or None), from transformers' v5
    `rope_parameters` (per layer type for Gemma 3) or an older config.json's rope_theta / rope_scaling."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    full, sliding = params, None
    if "full_attention" in params:
        full, sliding = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    full.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    if sliding is None and getattr(config, "rope_local_base_freq", None):  # Gemma 3 before rope_parameters
        sliding = {"rope_theta": config.rope_local_base_freq}
    return full, sliding


def _rope_kind(params: dict) -> str:
    return params.get("rope_type", params.get("type")) or "default"


# rope_type values written per llama.cpp architecture (others: default, linear). Phi-3's scaled ropes (longrope)
# need llama.cpp's long / short factor tensors, not written here.
ROPE_TYPES: dict[str, tuple[str, ...]] = {"llama": ("default", "linear", "llama3"), "phi3": ("default",)}


def _check_rope(config, arch: str) -> None:
    allowed = ROPE_TYPES.get(arch, ("default", "linear"))
    full, sliding = _rope(config)
    for params in (full, sliding or {}):
        if _rope_kind(params) not in allowed:
            raise ValueError(f"--format gguf: rope_type {_rope_kind(params)!r} (rope scaling) is not written for "
                             f"{config.model_type} (only {', '.join(allowed)}); {OTHER_FORMATS}")
    if sliding and _rope_kind(sliding) != "default":  # llama.cpp scales only the global layers' positions
        raise ValueError(f"--format gguf: scaled rope on sliding-window layers is not in llama.cpp; {OTHER_FORMATS}")
    if _rope_kind(full) == "llama3":
        _llama3_params(config, full)  # refuses incomplete parameters here, before anything is written


def _llama3_params(config, params: dict) -> tuple[float, float, float, int]:
    """(factor, low_freq_factor, high_freq_factor, original context) of a llama3 rope, where transformers reads
    them: the original context from the rope parameters, else the config, else max_position_embeddings."""
    factor, low, high = (params.get(k) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    context = next((c for c in (params.get("original_max_position_embeddings"),
                                getattr(config, "original_max_position_embeddings", None),
                                getattr(config, "max_position_embeddings", None)) if c), None)
    if None in (factor, low, high, context) or not high > low:
        raise ValueError(f"--format gguf: rope_type 'llama3' needs factor, low_freq_factor < high_freq_factor and "
                         f"original_max_position_embeddings (got {factor}, {low}, {high}, {context}); {OTHER_FORMATS}")
    return float(factor), float(low), float(high), int(context)


def llama3_rope_factors(config) -> np.ndarray | None:
    """What llama.cpp divides each rope frequency by for a llama3 rope ([head_dim / 2] float32), None for another
    rope. transformers' _compute_llama3_parameters keeps frequencies whose wavelength is under context /
    high_freq_factor, divides those over context / low_freq_factor by `factor`, and in between blends the two:
    inv * ((1 - s) / factor + s), s = (context / wavelength - low) / (high - low). Clipping s to [0, 1] gives all
    three cases from that one expression (s = 1: kept, s = 0: / factor), so the factor is its reciprocal."""
    full, _ = _rope(config)
    if _rope_kind(full) != "llama3":
        return None
    factor, low, high, context = _llama3_params(config, full)
    head_dim = _heads(config)[2]
    inv_freq = float(full["rope_theta"]) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = np.clip((context * inv_freq / (2 * np.pi) - low) / (high - low), 0.0, 1.0)
    return (1.0 / ((1.0 - smooth) / factor + smooth)).astype(np.float32)


def generated_tensors(config) -> dict[str, np.ndarray]:
    """{llama.cpp tensor name: F32 array} for what its converter generates beside the model's own tensors: a
    llama3 rope's `rope_freqs.weight` (llama.cpp reads it on every layer; with it no rope scaling key is written)."""
    factors = llama3_rope_factors(config)
    if factors is None:
        return {}
    return {f"{_gguf().TENSOR_NAMES[_gguf().MODEL_TENSOR.ROPE_FREQS]}.weight": factors}


def _heads(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv, getattr(config, "head_dim", None) or config.hidden_size // heads


def _common_keys(writer, config) -> None:
    """What TextModel.set_gguf_parameters writes for every family: sizes, heads, rope base and linear scaling,
    the sliding layers' rope base, the norm epsilon, and the head size where the config states one."""
    full, sliding = _rope(config)
    heads, kv, _ = _heads(config)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    if _rope_kind(full) == "linear":  # llama3: no key, its factors are a tensor (generated_tensors)
        writer.add_rope_scaling_type(_gguf().RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))
    writer.add_rope_freq_base(float(full["rope_theta"]))
    if sliding and sliding.get("rope_theta") is not None:
        writer.add_rope_freq_base_swa(float(sliding["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "head_dim", None):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)


def _llama_keys(writer, config) -> None:
    """LlamaModel (Llama, Mistral): the common keys, the vocabulary size and the rotary dimensions."""
    _common_keys(writer, config)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(_heads(config)[2])


def _qwen_keys(writer, config) -> None:
    _common_keys(writer, config)
    if config.model_type == "qwen3" and not getattr(config, "head_dim", None):
        writer.add_key_length(_heads(config)[2])  # llama.cpp's qwen3 reads it; derived when unstated
        writer.add_value_length(_heads(config)[2])


def _is_sliding(config) -> list[bool]:
    """Per layer: sliding-window attention (Gemma 3's layer_types, else its 5-local-1-global pattern)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return [t == "sliding_attention" for t in types]
    pattern = getattr(config, "sliding_window_pattern", None) or 6
    return [i % pattern < pattern - 1 for i in range(n)]


def _gemma3_keys(writer, config) -> None:
    """Gemma3Model: the common keys (head size always), the final logit soft-cap if any, the sliding window.
    llama.cpp reads the local layers from a 6-layer pattern (5 local, 1 global) unless the file says otherwise:
    the per-layer list is written only when the model differs from that default."""
    _common_keys(writer, config)
    if not getattr(config, "head_dim", None):  # llama.cpp's gemma3 needs it; the converter's default is 256
        writer.add_key_length(256)
        writer.add_value_length(256)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    sliding = _is_sliding(config)
    if any(sliding):
        writer.add_sliding_window(config.sliding_window)
        if sliding != [i % 6 < 5 for i in range(len(sliding))]:
            writer.add_sliding_window_pattern(sliding)


def _phi3_keys(writer, config) -> None:
    """Phi3MiniModel writes its own set: the original context (rope scaling base), rotary dimensions from the
    partial rotary factor, and the sliding window (0 when none; llama.cpp runs Phi-3 without one)."""
    full, _ = _rope(config)
    heads, kv, _ = _heads(config)
    factor = full.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    writer.add_context_length(config.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(getattr(config, "original_max_position_embeddings", None)
                                         or config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(int(factor * config.hidden_size) // heads)
    writer.add_rope_freq_base(float(full["rope_theta"]))
    writer.add_sliding_window(getattr(config, "sliding_window", None) or 0)


# transformers model_type -> how llama.cpp's converter writes it. tests/test_families.py reads the keys to decide
# which families get a GGUF export.
GGUF_ARCHITECTURES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("llama", True, 0.0, _llama_keys),
    "mistral": GGUFFamily("llama", True, 0.0, _llama_keys),  # MistralForCausalLM is converted as LlamaModel
    "qwen2": GGUFFamily("qwen2", False, 0.0, _qwen_keys),
    "qwen3": GGUFFamily("qwen3", False, 0.0, _qwen_keys),
    "gemma3_text": GGUFFamily("gemma3", False, 1.0, _gemma3_keys),
    "phi3": GGUFFamily("phi3", False, 0.0, _phi3_keys),
}


def _check_gemma3(config) -> None:
    _, _, head_dim = _heads(config)
    scalar = getattr(config, "query_pre_attn_scalar", None) or head_dim
    if scalar != head_dim:  # llama.cpp scales queries by 1/sqrt(head_dim) (1/sqrt(hidden/heads) for a 27B)
        raise ValueError(f"--format gguf: query_pre_attn_scalar {scalar} != head_dim {head_dim} is not llama.cpp's "
                         f"gemma3 attention scale; {OTHER_FORMATS}")
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"--format gguf: attention soft-capping or bidirectional attention is not in llama.cpp's "
                         f"gemma3 graph; {OTHER_FORMATS}")
    if getattr(config, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"--format gguf: hidden_activation {config.hidden_activation!r} (llama.cpp's gemma3 runs "
                         f"the tanh GELU); {OTHER_FORMATS}")


def gguf_architecture(config) -> GGUFFamily:
    """How a transformers config is written for llama.cpp (works on a config object or config.json's fields).

    Raises:
        ValueError: a model type llama.cpp's converter has no layout for here, or a setting its graph would
            compute differently, naming the formats that work.
    """
    family = GGUF_ARCHITECTURES.get(getattr(config, "model_type", None))
    if family is None:
        raise ValueError(f"--format gguf: model_type {getattr(config, 'model_type', None)!r} is not written yet "
                         f"(only {', '.join(GGUF_ARCHITECTURES)}); {OTHER_FORMATS}")
    if config.model_type == "qwen2" and getattr(config, "use_sliding_window", False):
        raise ValueError(f"--format gguf: sliding-window attention is not in llama.cpp's qwen2 graph; {OTHER_FORMATS}")
    window, context = getattr(config, "sliding_window", None), getattr(config, "max_position_embeddings", None)
    if config.model_type in ("mistral", "phi3") and window and context and window < context:
        # llama.cpp's llama graph has no window and its phi3 one turns it off: past `window` tokens every layer
        # would attend further than the model does
        raise ValueError(f"--format gguf: sliding_window {window} < context {context}: llama.cpp runs "
                         f"{config.model_type} without a window; {OTHER_FORMATS}")
    _check_rope(config, family.arch)
    if family.arch == "gemma3":
        _check_gemma3(config)
    return family


def _permute_rows(x: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, the two rotary halves interleaved (its rope pairs
    neighbours, HF's pairs halves). Rows only, so whole quantisation blocks move unchanged.
    [out, ...] -> [out, ...]."""
    rows = x.shape[0]
    order = np.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(-1)
    return x[order]


def tensor_naming(config):
    """(gguf_name(key), permuted(key, x)): llama.cpp's name of a transformers state-dict key
    (`model.layers.0.self_attn.q_proj.weight` -> `blk.0.attn_q.weight`), and, for the Llama layout, q/k rows
    reordered for its rope (any [out, ...] array of that layer: weights, their blocks, biases, a LoRA B). Shared
    with the GGUF LoRA writer."""
    family = gguf_architecture(config)
    names = _gguf().get_tensor_name_map(getattr(_gguf().MODEL_ARCH, family.arch.upper()), config.num_hidden_layers)
    heads, kv, _ = _heads(config)
    rows = {"q_proj": heads, "k_proj": kv} if family.permute_qk else {}

    def gguf_name(key: str) -> str:
        mapped = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"--format gguf: tensor {key} has no llama.cpp name; use --format packed or dense")
        return mapped

    def permuted(key: str, x: np.ndarray) -> np.ndarray:
        head = next((h for proj, h in rows.items() if f".{proj}." in f".{key}"), None)
        return x if head is None else _permute_rows(x, head)

    return gguf_name, permuted


def full_precision(config, key: str, x: np.ndarray) -> np.ndarray:
    """A full-precision tensor as the converter stores it: 1 + w for Gemma's norms; q/k rows as llama.cpp's rope
    wants them (tensor_naming)."""
    family = gguf_architecture(config)
    if family.norm_shift and key.endswith("norm.weight"):
        x = x + np.float32(family.norm_shift)  # fp32, as HF's (1.0 + weight.float())
    return tensor_naming(config)[1](key, x)


def add_metadata(writer, config, name: str) -> None:
    """general.name and the `<arch>.*` hyper-parameters of the model's family."""
    writer.add_name(name)
    gguf_architecture(config).keys(writer, config)
