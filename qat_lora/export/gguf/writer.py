"""GGUF export: one file that llama.cpp, Ollama and transformers (`gguf_file=`) load (issue 18).

    qat-lora export --model M --quant q4_0 [--adapter A --merge-adapter] --format gguf --out exports/q4_0

The container is written by the `gguf` package's GGUFWriter; only the blocks of llama.cpp's types are laid out
here (ggml-common.h): Q8_0 = fp16 d + 32 int8 q (w = d * q); Q4_0 = fp16 d + 16 bytes of nibbles
(w = d * (c - 8)); Q4_1 = fp16 d + fp16 m + 16 bytes (w = d * c + m); nibble j holds code j (low) and code
j + 16 (high). A quantised linear whose grid IS one of these types (the q8_0 / q4_0 / q4_1 presets) is written
from its own codes and fp16 scales, and a K-quant layer (q2_k / q3_k / q4_k / q6_k) from its codes, integer
sub-block scales and mins and fp16 super-block scales (kquant.py), so gguf's dequantiser returns the
student's Wq bit for bit; any other grid is re-quantised (to Q4_1 keeping the codes for 4-bit int groups of
32, else to Q8_0 by gguf's quantiser) and the summary reports each layer's relative error. Every layer is
checked by dequantising what was written. Metadata: copied from the teacher's GGUF when the model came from
one (the quantisation keys are ours); otherwise as llama.cpp's convert_hf_to_gguf writes them for each family of
GGUF_ARCHITECTURES (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3: `<arch>.*` hyper-parameters, tensor names and
transforms in arch.py) with the tokenizer as it writes it (byte-level BPE or SentencePiece: vocab.py);
1-D tensors (norms, biases) F32, other full-precision matrices (embeddings, an untied head) F16, and what the
converter generates from the config (a Llama 3 rope's `rope_freqs.weight` factors, arch.generated_tensors) F32.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import nn

# The family table, naming and tokenizer live in arch.py / vocab.py; re-exported here, where the export
# and tests/test_families.py look for them.
from qat_lora.export.gguf.arch import (  # noqa: F401
    GGUF_ARCHITECTURES, GGUFFamily, _gguf, add_metadata, full_precision, generated_tensors, gguf_architecture,
    tensor_naming)
from qat_lora.export.gguf.kquant import PACKERS as KQUANT_PACKERS, pack_kquant
from qat_lora.export.gguf.vocab import add_tokenizer, pre_tokenizer_name  # noqa: F401
from qat_lora.export.tensors import full_precision_tensors
from qat_lora.quant.config import PRESETS, QuantConfig
from qat_lora.quant.fake_quant import FakeQuantLinear, quantised_layers
from qat_lora.quant.quantizer import quantizer_for
from qat_lora.runtime.writes import writing

GGUF_DIR, GGUF_FILE = "gguf", "model.gguf"
BLOCK = 32  # weights per block of Q8_0 / Q4_0 / Q4_1
BLOCK_BITS = {"Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5.0}  # bits per weight as stored: fp16 d (+ fp16 m) + 32 codes


def requantised_type(cfg: QuantConfig) -> str | None:
    """The llama.cpp type the layers of preset `cfg` (or of one of its overrides) are re-quantised to by value,
    losing the trained grid, or None when the file keeps every grid: the exact presets (EXACT_PRESETS) and 4-bit
    int groups of 32, written as Q4_1 from their own codes (only the offset d * (z - qmin) is rounded to fp16)."""
    if any(quantizer_for(c).gguf_type is None for c in (cfg, *(o for _, o in cfg.overrides))):
        return "Q8_0"
    return None


EXACT_PRESETS = tuple(name for name, cfg in PRESETS.items() if quantizer_for(cfg).gguf_exact)  # q8_0, q4_0, q4_1, q2_k, ...


def warn_if_lossy(report: dict) -> None:
    """One line on stderr when save_gguf's file is not the student bit for bit: its types, bits per weight and
    largest relative error (the export went ahead because --gguf-requantize asked for it, or kept the codes)."""
    lossy = {name: v for name, v in report["layers"].items() if not v["exact"]}
    if lossy:
        types = ", ".join(sorted({v["type"] for v in lossy.values()}))
        print(f"qat-lora export: warning: {report['file']} is lossy: {len(lossy)} of {len(report['layers'])} "
              f"quantised layers re-quantised to {types}, {report['bits_per_weight']:.2f} bits per weight, relative "
              f"error up to {report['max_rel_error']:.2%}", file=sys.stderr)


@contextmanager
def gguf_file(out_dir: str | Path, file_name: str, arch: str) -> Iterator[tuple[object, Path]]:
    """A GGUFWriter for `out_dir/file_name` (the folder made if missing) and that path: what the block adds is
    written under a temporary name, then renamed into place, so the path never holds a half-written file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path, tmp = out_dir / file_name, out_dir / (file_name + ".tmp")
    with writing(path, tmp):  # a failure (a full disk: numpy's short write) leaves no .tmp; one line names the path
        writer = _gguf().GGUFWriter(str(tmp), arch)
        yield writer, path
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)


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
    """(type, blocks [out, bytes]) for one quantised linear: from its own codes where a llama.cpp type holds its
    grid (quantizer.gguf_fields), else re-quantised by value."""
    params = {k: p.detach() for k, p in layer.quant_parameters().items()}
    fields = layer.quantizer.gguf_fields(layer.weight.detach(), params)
    if fields is not None:
        qtype = fields.pop("type")
        arrays = {k: v.cpu().numpy() for k, v in fields.items()}
        if qtype in KQUANT_PACKERS:
            return qtype, pack_kquant(qtype, **arrays)
        return qtype, pack_blocks(arrays["q"], arrays["d"], qtype, arrays.get("m"))
    wq = layer.quantized_weight().detach().float().numpy()
    if wq.shape[1] % BLOCK:
        return "F16", wq.astype(np.float16)
    return "Q8_0", _gguf().quants.quantize(wq, _gguf().GGMLQuantizationType.Q8_0)


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
    expected = gguf_architecture(config).arch
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
    """Write `out_dir/model.gguf` for a fake-quant student of a GGUF_ARCHITECTURES family (no PEFT wrapper); atomic
    (temporary name, then rename). With `teacher_gguf` (the .gguf the model was loaded from) its metadata are copied
    (tokenizer, chat template, hyper-parameters), and only the quantisation keys are this export's own.

    Returns:
        {"file", "arch" (llama.cpp's), "bytes", "file_type", "types": {type: count}, "exact_layers",
         "bits_per_weight", "max_rel_error",
         "layers": {name: {"type", "exact" (gguf dequantises to Wq bit for bit), "rel_error": ||deq - Wq|| / ||Wq||}}}.
    Raises:
        ValueError: another architecture or a setting llama.cpp computes differently (arch.gguf_architecture),
            a tokenizer llama.cpp would split differently, no gguf.
    """
    gguf = _gguf()
    config = model.config
    arch = gguf_architecture(config).arch
    gguf_name, permuted = tensor_naming(config)
    with gguf_file(out_dir, GGUF_FILE, arch) as (writer, path):
        if teacher_gguf:
            _copy_teacher_metadata(writer, teacher_gguf, config)
        else:
            add_metadata(writer, config, name)
            add_tokenizer(writer, tokenizer, config.vocab_size)
        for key, x in generated_tensors(config).items():  # a Llama 3 rope's factors (F32), first as the converter
            writer.add_tensor(key, x)
        layers = quantised_layers(model)
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
        for key, tensor in full_precision_tensors(model, layers).items():  # 1-D F32, matrices F16; a tied head: none
            x = full_precision(config, key, tensor.float().numpy())
            writer.add_tensor(gguf_name(key), x.astype(np.float32 if x.ndim == 1 else np.float16))
        types = Counter(v["type"] for v in report["layers"].values())
        file_type = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q2_K": "MOSTLY_Q2_K",
                     "Q3_K": "MOSTLY_Q3_K_S", "Q4_K": "MOSTLY_Q4_K_S", "Q6_K": "MOSTLY_Q6_K"}.get(
            types.most_common(1)[0][0] if types else "F16", "MOSTLY_F16")
        writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    report.update(file=str(path), arch=arch, bytes=path.stat().st_size, file_type=file_type, types=dict(types),
                  exact_layers=sum(v["exact"] for v in report["layers"].values()),
                  bits_per_weight=stored_bits / max(weights, 1),
                  max_rel_error=max((v["rel_error"] for v in report["layers"].values()), default=0.0))
    return report
