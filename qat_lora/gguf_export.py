"""GGUF export: one file that llama.cpp, Ollama and transformers (`gguf_file=`) load (issue 18).

    qat-lora export --model M --quant q4_0 [--adapter A --merge-adapter] --format gguf --out exports/q4_0

The container is written by the `gguf` package's GGUFWriter; only the blocks of llama.cpp's types are laid out
here (ggml-common.h): Q8_0 = fp16 d + 32 int8 q (w = d * q); Q4_0 = fp16 d + 16 bytes of nibbles
(w = d * (c - 8)); Q4_1 = fp16 d + fp16 m + 16 bytes (w = d * c + m); nibble j holds code j (low) and code
j + 16 (high). A quantised linear whose grid IS one of these types (the q8_0 / q4_0 / q4_1 presets) is written
from its own codes and fp16 scales, and a K-quant layer (q2_k / q3_k / q4_k / q6_k) from its codes, integer
sub-block scales and mins and fp16 super-block scales (gguf_kquant.py), so gguf's dequantiser returns the
student's Wq bit for bit; any other grid is re-quantised (to Q4_1 keeping the codes for 4-bit int groups of
32, else to Q8_0 by gguf's quantiser) and the summary reports each layer's relative error. Every layer is
checked by dequantising what was written. Metadata: copied from the teacher's GGUF when the model came from
one (the quantisation keys are ours); otherwise as llama.cpp's convert_hf_to_gguf writes them for Llama- and
Qwen-family models (GGUF_ARCHITECTURES): `<arch>.*` hyper-parameters, a gpt2-style BPE vocabulary with its
pre-tokenizer name, and for Llama q/k rows permuted the way llama.cpp's rotary embedding expects (Qwen2/Qwen3 use
the NEOX rope, whose pairs are transformers' own, so their rows stay; their q/k/v biases and q/k norms are written
under llama.cpp's names); 1-D tensors (norms, biases) F32, other full-precision matrices (embeddings, head) F16.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .gguf_kquant import kquant_blocks
from .quant import FakeQuantLinear
from .quant_init import snap_fp16

GGUF_DIR, GGUF_FILE = "gguf", "model.gguf"
BLOCK = 32  # weights per block of Q8_0 / Q4_0 / Q4_1

# transformers model_type -> (llama.cpp architecture, q/k rows permuted). llama.cpp's Llama rope pairs neighbouring
# dimensions, so its converter reorders q/k rows; Qwen2 and Qwen3 run the NEOX rope (halves paired, as in
# transformers), so theirs stay.
GGUF_ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}


def _gguf():
    try:
        import gguf
    except ImportError as e:  # an optional extra: say how to get it
        raise ValueError("--format gguf needs the gguf package: pip install 'qat-lora[gguf]'") from e
    return gguf


def exact_type(layer: FakeQuantLinear) -> str | None:
    """The llama.cpp type whose grid is exactly this layer's (Q8_0, Q4_0, Q4_1), or None.

    Symmetric int layers qualify only while every zero rounds to 0 (zero_domain none keeps it 0 by design).
    """
    cfg = layer.cfg
    if cfg.scheme != "int" or cfg.scale_rank or layer.group_size != BLOCK or cfg.bits not in (4, 8):
        return None
    if cfg.zero_domain == "float":
        return "Q4_1" if cfg.bits == 4 else None
    if cfg.symmetric and (cfg.zero_domain == "none" or not torch.round(layer.zero).any()):
        return "Q8_0" if cfg.bits == 8 else "Q4_0"
    return None


def pack_blocks(codes: np.ndarray, d: np.ndarray, qtype: str, m: np.ndarray | None = None) -> np.ndarray:
    """Lay out llama.cpp blocks of 32 weights.

    Args:
        codes: [rows, cols] integers: Q8_0 the signed q in [-128, 127]; Q4_0 / Q4_1 the nibble c in [0, 15].
        d: [rows, cols / 32] scales; m: [rows, cols / 32] offsets (Q4_1 only); both stored as fp16.
    Returns:
        [rows, bytes per row] uint8, what GGUFWriter.add_tensor takes with raw_dtype set.
    """
    rows, cols = codes.shape
    c = codes.reshape(rows, cols // BLOCK, BLOCK)
    parts = [d.astype(np.float16).reshape(rows, -1, 1).view(np.uint8)]  # [rows, blocks, 2], little-endian
    if qtype == "Q4_1":
        parts.append(m.astype(np.float16).reshape(rows, -1, 1).view(np.uint8))
    if qtype == "Q8_0":
        parts.append(c.astype(np.int8).view(np.uint8))
    else:
        c = c.astype(np.uint8)
        parts.append(c[..., :BLOCK // 2] | (c[..., BLOCK // 2:] << 4))
    return np.ascontiguousarray(np.concatenate(parts, -1).reshape(rows, -1))


def _layer_blocks(layer: FakeQuantLinear) -> tuple[str, np.ndarray]:
    """(type, blocks [out, bytes]) for one quantised linear: exact for llama.cpp grids, else re-quantised."""
    gguf = _gguf()
    if layer.cfg.scheme == "kquant":  # Q2_K / Q3_K / Q4_K / Q6_K: always exact (gguf_kquant.py)
        return kquant_blocks(layer)
    qtype = exact_type(layer)
    codes = layer.codes().numpy().astype(np.int16) + layer.cfg.qmin  # [out, in]: the integer q of the grid
    if qtype is not None:
        d = layer.scale.detach().float().numpy()
        m = layer.zero.detach().float().numpy() if qtype == "Q4_1" else None
        return qtype, pack_blocks(codes if qtype == "Q8_0" else codes - layer.cfg.qmin, d, qtype, m)
    cfg = layer.cfg
    if cfg.scheme == "int" and cfg.zero_domain == "int" and not cfg.scale_rank and cfg.bits == 4 \
            and layer.group_size == BLOCK:
        # Same codes c = q - qmin: Wq = d * (q - z) = d * c - d * (z - qmin); only that offset m is rounded to fp16.
        d = snap_fp16(layer.scale.detach().float())
        z = torch.round(layer.zero.detach()).float()
        return "Q4_1", pack_blocks(codes - cfg.qmin, d.numpy(), "Q4_1", (-d * (z - cfg.qmin)).numpy())
    wq = layer.quantized_weight().detach().float().numpy()
    if wq.shape[1] % BLOCK:
        return "F16", wq.astype(np.float16)
    return "Q8_0", gguf.quants.quantize(wq, gguf.GGMLQuantizationType.Q8_0)


def _permute_rows(x: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, the two rotary halves interleaved (its rope pairs
    neighbours, HF's pairs halves). Rows only, so whole quantisation blocks move unchanged.
    [out, ...] -> [out, ...]."""
    rows = x.shape[0]
    order = np.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(-1)
    return x[order]


def gguf_architecture(config) -> tuple[str, bool]:
    """(llama.cpp architecture name, q/k rows permuted) of a transformers config.

    Raises:
        ValueError: a model type without a llama.cpp layout here, or a Qwen2 with sliding-window attention.
    """
    if config.model_type not in GGUF_ARCHITECTURES:
        raise ValueError(f"--format gguf: model_type {config.model_type!r} is not written yet (only "
                         f"{', '.join(GGUF_ARCHITECTURES)}); use --format packed, dense or compressed-tensors")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("--format gguf: sliding-window attention is not in llama.cpp's qwen2 graph; use --format "
                         "packed, dense or compressed-tensors")
    return GGUF_ARCHITECTURES[config.model_type]


def tensor_naming(config):
    """(gguf_name(key), permuted(key, x)): llama.cpp's name of a transformers state-dict key
    (`model.layers.0.self_attn.q_proj.weight` -> `blk.0.attn_q.weight`), and, for Llama, q/k rows reordered for
    its rope (any [out, ...] array of that layer: weights, their blocks, biases, a LoRA B). Shared with the GGUF
    LoRA writer."""
    arch, permute = gguf_architecture(config)
    names = _gguf().get_tensor_name_map(getattr(_gguf().MODEL_ARCH, arch.upper()), config.num_hidden_layers)
    heads = {"q_proj": config.num_attention_heads,
             "k_proj": getattr(config, "num_key_value_heads", None) or config.num_attention_heads} if permute else {}

    def gguf_name(key: str) -> str:
        mapped = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"--format gguf: tensor {key} has no llama.cpp name; use --format packed or dense")
        return mapped

    def permuted(key: str, x: np.ndarray) -> np.ndarray:
        head = next((h for proj, h in heads.items() if f".{proj}." in f".{key}"), None)
        return x if head is None else _permute_rows(x, head)

    return gguf_name, permuted


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"--format gguf: rope_type {kind!r} (rope scaling) is not written yet; use --format packed "
                         "or dense")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _add_metadata(writer, config, name: str) -> None:
    """`<arch>.*` hyper-parameters as convert_hf_to_gguf writes them: the common set, Llama's vocab size and rope
    dimensions, and the head size where the config states one llama.cpp would not derive (Qwen3 always)."""
    arch, _ = gguf_architecture(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // heads or arch == "qwen3":  # llama.cpp derives it otherwise
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def pre_tokenizer_name(tokenizer) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer (tokenizer.ggml.pre), read from its definition:
    byte-level with GPT-2's regex is `gpt-2`; single digits split first, then that, is `smollm`; Qwen2's split
    regex, then byte-level without its own regex, is `qwen2` (Qwen2, Qwen2.5, Qwen3).

    Raises:
        ValueError: any other pre-tokenizer (llama.cpp would split the text differently).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()).get("pre_tokenizer") if backend is not None else None
    steps = (spec or {}).get("pretokenizers", [spec]) if (spec or {}).get("type") == "Sequence" else [spec]
    kinds = [(s or {}).get("type") for s in steps]
    byte_level = bool(steps) and kinds[-1] == "ByteLevel" and steps[-1].get("use_regex", True)
    if byte_level and len(steps) == 1:
        return "gpt-2"
    if byte_level and kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True) and \
            steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT
        if (steps[0].get("pattern") or {}).get("Regex") == QWEN2_SPLIT:
            return "qwen2"
    raise ValueError(f"--format gguf: pre-tokenizer {kinds} has no llama.cpp equivalent written yet (byte-level BPE "
                     "as GPT-2, SmolLM or Qwen2 only); use --format packed or dense")


def _add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """A gpt2-style BPE vocabulary as llama.cpp's converter writes it: tokens by id ([PADi] UNUSED for gaps),
    added special tokens CONTROL, other added tokens USER_DEFINED; merges, special ids and the chat template
    through gguf.SpecialVocab over the saved tokenizer files."""
    gguf = _gguf()
    if getattr(tokenizer, "backend_tokenizer", None) is None or \
            json.loads(tokenizer.backend_tokenizer.to_str())["model"]["type"] != "BPE":
        raise ValueError("--format gguf: the tokenizer is not a fast BPE tokenizer; only gpt2-style vocabularies "
                         "are written yet")
    pre = pre_tokenizer_name(tokenizer)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder  # {id: AddedToken}
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        special = i in added and (added[i].special or (token.startswith("<|") and token.endswith("|>")))
        types.append(gguf.TokenType.CONTROL if special else
                     gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        special = gguf.SpecialVocab(tmp, load_merges=True, n_vocab=vocab_size)
    if "bos" not in special.add_special_token:  # say what the HF tokenizer does, not llama.cpp's per-vocab default
        bos = tokenizer.bos_token_id
        special.add_special_token["bos"] = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    special.add_to_gguf(writer, quiet=True)


# Keys the writer owns (the container's, and what depends on how the tensors are quantised): never copied from a
# teacher's GGUF.
OWN_KEYS = ("general.architecture", "general.alignment", "general.file_type", "general.quantization_version")


def _copy_teacher_metadata(writer, path: str | Path, config) -> None:
    """Every key-value pair of the teacher's GGUF (tokenizer, chat template, hyper-parameters, provenance) but
    the container's and OWN_KEYS, which this export writes itself.

    Raises:
        ValueError: the file is no GGUF of this model's architecture and depth.
    """
    gguf = _gguf()
    expected, _ = gguf_architecture(config)
    fields = gguf.GGUFReader(str(path)).fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    blocks = fields.get(f"{arch}.block_count")
    if arch != expected or blocks is None or int(blocks.contents()) != config.num_hidden_layers:
        raise ValueError(f"{path}: a {arch} GGUF with {None if blocks is None else blocks.contents()} blocks, not the "
                         f"{expected} model of {config.num_hidden_layers} blocks being exported; pass the GGUF it "
                         "came from")
    for key, field in fields.items():
        if key.startswith("GGUF.") or key in OWN_KEYS:
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if array else None)


def _state_tensors(model: nn.Module, layers: dict[str, FakeQuantLinear]) -> dict[str, torch.Tensor]:
    """Full-precision tensors (everything but the quantised linears' weights and quantisers), the tied head
    skipped as llama.cpp expects (no output.weight means: reuse token_embd)."""
    skip = {f"{n}.{k}" for n, layer in layers.items() for k in ("weight", *layer.quant_parameters())}
    tied = getattr(model.config, "tie_word_embeddings", False)
    return {k: v for k, v in model.state_dict().items()
            if k not in skip and not (tied and k.endswith("lm_head.weight"))}


def _check(written: np.ndarray, qtype: str, expected: torch.Tensor) -> tuple[bool, float]:
    """Dequantise what was written with gguf's own code: (equal to Wq bit for bit, ||deq - Wq|| / ||Wq||)."""
    gguf = _gguf()
    deq = torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(written, getattr(gguf.GGMLQuantizationType, qtype)))).reshape(expected.shape)
    expected = expected.float()
    return torch.equal(deq, expected), float((deq - expected).norm() / expected.norm().clamp(min=1e-30))


@torch.no_grad()
def save_gguf(model: nn.Module, out_dir: str | Path, tokenizer, name: str = "student",
              teacher_gguf: str | Path | None = None) -> dict:
    """Write `out_dir/model.gguf` for a fake-quant Llama, Qwen2 or Qwen3 student (no PEFT wrapper); atomic (temporary name,
    then rename). With `teacher_gguf` (the .gguf the model was loaded from) its metadata are copied (tokenizer,
    chat template, hyper-parameters), and only the quantisation keys are this export's own.

    Returns:
        {"file", "bytes", "file_type", "types": {type: count}, "exact_layers", "bits_per_weight", "max_rel_error",
         "layers": {name: {"type", "exact" (gguf dequantises to Wq bit for bit), "rel_error": ||deq - Wq|| / ||Wq||}}}.
    Raises:
        ValueError: another architecture, rope scaling, a tokenizer llama.cpp would split differently, no gguf.
    """
    gguf = _gguf()
    config = model.config
    arch, _ = gguf_architecture(config)
    gguf_name, permuted = tensor_naming(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path, tmp = out_dir / GGUF_FILE, out_dir / (GGUF_FILE + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    if teacher_gguf:
        _copy_teacher_metadata(writer, teacher_gguf, config)
    else:
        _add_metadata(writer, config, name)
        _add_tokenizer(writer, tokenizer, config.vocab_size)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)}
    report: dict = {"layers": {}}
    stored_bits = weights = 0  # the quantised linears' bits per weight as stored (Q4_0: 4.5, Q4_K: 4.5, ...)
    for layer_name, layer in layers.items():
        qtype, blocks = _layer_blocks(layer)
        blocks = permuted(f"{layer_name}.weight", blocks)
        exact, err = _check(blocks, qtype, torch.from_numpy(permuted(
            f"{layer_name}.weight", layer.quantized_weight().detach().float().numpy())))
        writer.add_tensor(gguf_name(f"{layer_name}.weight"), blocks,
                          raw_dtype=None if qtype == "F16" else getattr(gguf.GGMLQuantizationType, qtype))
        report["layers"][layer_name] = {"type": qtype, "exact": exact, "rel_error": err}
        stored_bits += blocks.nbytes * 8
        weights += layer.weight.numel()
    for key, tensor in _state_tensors(model, layers).items():
        x = permuted(key, tensor.detach().float().cpu().numpy())
        writer.add_tensor(gguf_name(key), x.astype(np.float32 if x.ndim == 1 else np.float16))
    types = Counter(v["type"] for v in report["layers"].values())
    file_type = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q2_K": "MOSTLY_Q2_K",
                 "Q3_K": "MOSTLY_Q3_K_S", "Q4_K": "MOSTLY_Q4_K_S", "Q6_K": "MOSTLY_Q6_K"}.get(
        types.most_common(1)[0][0] if types else "F16", "MOSTLY_F16")
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    report.update(file=str(path), bytes=path.stat().st_size, file_type=file_type, types=dict(types),
                  exact_layers=sum(v["exact"] for v in report["layers"].values()),
                  bits_per_weight=stored_bits / max(weights, 1), max_rel_error=max((v["rel_error"] for v in report["layers"].values()), default=0.0))
    return report
