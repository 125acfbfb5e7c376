"""Export the quantised student: the packed low-bit artefact and a dense transformers folder (DESIGN §4, §5).

    qat-lora export --model M --quant w3g64 [--adapter runs/w3g64/adapter] --out exports/w3g64 [--format both]
    qat-lora export --model M --quant w3g64 --quantizer runs/qat/quantizer.safetensors --out exports/qat

`packed/` holds `model.safetensors` with, per quantised linear, the integer codes packed to their bit width
(`<name>.qweight`, uint8), an integer zero point packed the same way at the codes' width (`<name>.zero`, the
integer the forward uses minus qmin; none for a grid without one; format version 1 stored it fp16), and the fp16
`scale` / float offset `zero` / `codebook` / `scale_a` / `scale_b` (fp8 scales: `scale` in float8_e4m3fn and
`<name>.scale_exp`, the layer's power-of-two exponent in int8; format version 3); every other tensor as in the model; a JSON
header in the safetensors metadata (key `qat_lora`); the tokenizer; a `config.json` whose model_type
`qat-lora-packed` transformers refuses with an error naming it (the model's own config sits inside, under
`base_config`).
`load_packed(dir)` rebuilds the fake-quant student, whose Wq equals the exported one bit for bit.
`dense/` is a plain `save_pretrained` folder of the dequantised weights: transformers loads it without qat_lora.
`--format gguf` writes `gguf/model.gguf` instead (gguf/writer.py): llama.cpp's types, bit-exact for q8_0 / q4_0 / q4_1.
`--device` is where the held-out report's forwards (--cache) and the re-snap's steps run; everything the files hold is
computed and written on the host, so they are the same bytes on every device.
"""
from __future__ import annotations

import copy
import json
import math
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from qat_lora.data import identities, models
from qat_lora.runtime import device as dev, precision
from qat_lora.train.config import StudentSpec, TrainConfig
from qat_lora.export.config import ExportConfig
from qat_lora.export.merge import (HOST, KEEP_THRESHOLD, heldout_metrics, merge_full_, merge_lora_, recovery_verdict,
                           student_and_base_metrics)
from qat_lora.export.compressed_tensors import CT_DIR, save_compressed_tensors
from qat_lora.runtime.files import (OWNER_KEY, FolderLock, atomic_write_json, check_out_apart_from_inputs, first_line,
                    owned_by, owner_stamp, read_record, require_folder, save_pretrained, save_safetensors)
from qat_lora.export.gguf.writer import GGUF_DIR, save_gguf, warn_if_lossy
from qat_lora.export.gguf.lora import save_gguf_lora
from qat_lora.export.tensors import full_precision_tensors, pack_codes, unpack_codes
from qat_lora.train.student import build_student, load_student, resolve_attn, save_adapter
from qat_lora.train.trainer import train
from qat_lora.quant.fake_quant import (QUANT_PARAMETERS, FakeQuantLinear, QuantConfig, get_preset, quant_config_dict,
                    quant_config_from_dict, quantised_layers)
from qat_lora.quant.state import bits_per_weight, layer_bits, save_quantizer_state

HEADER_KEY = "qat_lora"
FORMAT_NAME = "qat-lora-packed"
FORMAT_VERSION = 3  # 2: integer zero points packed at the codes' width; 3: fp8 scales (QuantConfig.scale_bits 8)
WEIGHTS_FILE = "model.safetensors"
REPORT_FILE = "export.json"
PACKED_DIR, DENSE_DIR, ADAPTER_DIR, MERGED_FP_DIR, RESNAP_DIR = "packed", "dense", "adapter", "merged-fp", "resnap"
# The re-snap's weights learn at 4x --resnap-lr: recover's QAT defaults (--weight-lr 2e-3 over --qat-lr 5e-4).
RESNAP_WEIGHT_LR_RATIO = 4.0
EXPORT_ENTRIES = (PACKED_DIR, DENSE_DIR, ADAPTER_DIR, MERGED_FP_DIR, RESNAP_DIR, GGUF_DIR, CT_DIR, REPORT_FILE,
                  REPORT_FILE + ".tmp")
# What each folder holds and how to load it: the export's summary prints this for every folder it wrote.
FOLDER_HELP = {
    PACKED_DIR: "the low-bit base, codes at their bit width + fp16 (or fp8) scales; qat-lora only: "
                "qat_lora.export.exporter.load_packed(dir)",
    DENSE_DIR: "the low-bit base dequantised to full precision (same size as the original model); plain "
               "transformers: AutoModelForCausalLM.from_pretrained(dir)",
    ADAPTER_DIR: "the recovery LoRA, unmerged, in PEFT's format over the base's module names: "
                 "PeftModel.from_pretrained(<the exported base, loaded>, dir)",
    MERGED_FP_DIR: "base + adapter merged in full precision: exact, a plain transformers folder, NOT smaller than "
                   "the original model; AutoModelForCausalLM.from_pretrained(dir)",
    CT_DIR: "the low-bit base as compressed-tensors pack-quantized ints: vLLM (vllm serve dir) and transformers "
            "with the compressed-tensors package (AutoModelForCausalLM.from_pretrained(dir, quantization_config="
            "CompressedTensorsConfig(dequantize=True)); symmetric presets load plainly too); qat-lora eval / generate "
            "--model dir",
    RESNAP_DIR: "the re-snap training run (--resnap-steps): metrics and the re-snapped quantizer.safetensors",
    GGUF_DIR: "llama.cpp / Ollama: llama-cli -m gguf/model.gguf [--lora gguf/adapter.gguf: the unmerged adapter]; "
              "transformers: from_pretrained(dir, gguf_file='model.gguf')",
}
# packed/config.json carries a model_type transformers rejects, naming the format (issue 18, item 4): a plain
# config there made AutoModelForCausalLM.from_pretrained(packed/) build a RANDOM model with only a warning.
PACKED_MODEL_TYPE = models.PACKED_MODEL_TYPE
QUANT_TENSORS = QUANT_PARAMETERS
PACKED_TENSORS = (*QUANT_TENSORS, "scale_exp")  # + fp8 scales' exponent


@torch.no_grad()
def save_packed(model: nn.Module, out_dir: str | Path, quant: QuantConfig, tokenizer=None) -> dict:
    """Write the packed artefact of a fake-quant student (no PEFT wrapper) to `out_dir`.

    Returns:
        the JSON header (layers, bits per weight, file size).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors, layers = {}, {}
    quantised = quantised_layers(model)
    for name, layer in quantised.items():
        tensors[f"{name}.qweight"] = pack_codes(layer.codes().cpu(), layer.cfg.bits)
        integers = layer.quantizer.integer_parameters()
        # what the forward uses, exact in fp16 (fp8 scales: E4M3 bytes and an int8 exponent)
        for key, value in layer.quantizer.packed_parameters(layer.stored_quant_parameters()).items():
            if key in integers:  # an integer zero: packed at its width, as storage_bits counts it
                low, bits = integers[key]
                if bits:
                    tensors[f"{name}.{key}"] = pack_codes((value.cpu() - low).to(torch.uint8), bits)
            elif value.dtype in (torch.float8_e4m3fn, torch.int8):
                tensors[f"{name}.{key}"] = value.cpu().contiguous()
            else:
                tensors[f"{name}.{key}"] = value.cpu().to(torch.float16).contiguous()
        layers[name] = {"config": quant_config_dict(layer.cfg), "group_size": layer.group_size,
                        "out_features": layer.out_features, "in_features": layer.in_features}
    tensors.update(full_precision_tensors(model, quantised))
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "quant_config": quant_config_dict(quant),
              "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "layers": layers,
              "bits_per_weight": bits_per_weight(model)}
    save_safetensors(tensors, out_dir / WEIGHTS_FILE, metadata={HEADER_KEY: json.dumps(header)})
    atomic_write_json(out_dir / "config.json", {
        "model_type": PACKED_MODEL_TYPE, "load_with": "qat_lora.export.exporter.load_packed (transformers: the dense/ folder)",
        "base_config": model.config.to_dict()})
    if tokenizer is not None:
        save_pretrained(tokenizer, out_dir)
    header["bytes"] = (out_dir / WEIGHTS_FILE).stat().st_size
    return header


def read_packed_header(path: str | Path) -> dict:
    """The JSON header of a packed artefact folder.

    Raises:
        ValueError: not a qat-lora packed folder, a damaged one, or a newer format version.
    """
    from safetensors import SafetensorError, safe_open

    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise ValueError(f"{path}: no {WEIGHTS_FILE} file; pass the packed/ folder written by `qat-lora export`")
    try:
        with safe_open(str(file), "pt") as f:
            metadata = f.metadata() or {}
    except SafetensorError as e:  # cut short by a full disk or an interrupted copy: its message names no file
        raise ValueError(f"{file}: damaged or truncated ({first_line(e)}); export it again") from None
    if HEADER_KEY not in metadata:
        raise ValueError(f"{file}: no qat-lora header; it is not a packed export (load it with transformers)")
    header = json.loads(metadata[HEADER_KEY])
    if header.get("format") != FORMAT_NAME or header.get("version", 0) > FORMAT_VERSION:
        raise ValueError(f"{file}: format {header.get('format')} v{header.get('version')}; upgrade qat-lora")
    return header


@torch.no_grad()
def load_packed(path: str | Path) -> nn.Module:
    """Rebuild the fake-quant student from a packed artefact: each quantised linear's latent weight is the
    dequantised Wq, so its forward (and further training or LoRA) starts from exactly the exported weights."""
    from safetensors.torch import load_file
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    header = read_packed_header(path)
    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    saved = json.loads((Path(path) / "config.json").read_text())
    if saved.get("model_type") == PACKED_MODEL_TYPE:
        base = saved["base_config"]
        config = CONFIG_MAPPING[base["model_type"]].from_dict(base)
    else:  # packed folders written before the format got its own model_type
        config = AutoConfig.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, header["dtype"]))
    for name, info in header["layers"].items():
        cfg = quant_config_from_dict(info["config"])
        old = model.get_submodule(name)
        layer = FakeQuantLinear(info["in_features"], info["out_features"], old.bias is not None, cfg,
                                info["group_size"], dtype=old.weight.dtype)
        parts = layer.quantizer.unpacked_parameters(
            {k: tensors.pop(f"{name}.{k}") for k in PACKED_TENSORS if f"{name}.{k}" in tensors})
        if header["version"] >= 2:  # integer parameters packed at their width (version 1: every one fp16)
            shapes = layer.quantizer.parameter_shapes(layer.out_features, layer.in_features)
            for key, (low, bits) in layer.quantizer.integer_parameters().items():
                numel = math.prod(shapes[key])
                codes = unpack_codes(parts[key], bits, numel) if bits else torch.zeros(numel, dtype=torch.uint8)
                parts[key] = (codes.float() + low).reshape(shapes[key])
        codes = unpack_codes(tensors.pop(f"{name}.qweight"), cfg.bits, layer.weight.numel())
        wq = layer.quantizer.dequantize(codes.reshape(layer.out_features, layer.in_features), parts)
        layer.weight = nn.Parameter(wq.to(layer.weight.dtype), requires_grad=False)
        for key, value in parts.items():
            setattr(layer, key, nn.Parameter(value.float(), requires_grad=False))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    quantised = {f"{n}.{k}" for n in header["layers"] for k in ("weight", *PACKED_TENSORS)}
    tied = {k for k in missing if k not in quantised and k.endswith("lm_head.weight")
            and getattr(config, "tie_word_embeddings", False)}
    if unexpected or set(missing) - quantised - tied:
        raise ValueError(f"{path}: tensors do not match the model (missing {sorted(set(missing) - quantised - tied)[:3]}, "
                         f"unexpected {unexpected[:3]}); re-export with this qat-lora version")
    model.tie_weights()
    return model.eval()


def dequantize_(model: nn.Module) -> nn.Module:
    """Replace every FakeQuantLinear by a plain nn.Linear holding its Wq, in place (the dense export)."""
    for name, layer in quantised_layers(model).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer.to_linear())
    return model


def save_dense(model: nn.Module, out_dir: str | Path, tokenizer=None) -> None:
    """Dequantise `model` in place and `save_pretrained` it: loadable by plain transformers."""
    out_dir = Path(out_dir)
    save_pretrained(dequantize_(model), out_dir)  # with the umask's modes (safetensors' temp files are 0600)
    if tokenizer is not None:
        save_pretrained(tokenizer, out_dir)


EXPORT_KIND, EXPORT_LEGACY_KEYS = "export", ("config", "quant_config")  # export.json, the ownership record


def _check_out(cfg: ExportConfig) -> None:
    """--out must be a folder apart from every input: checked before the export's lock creates it."""
    require_folder(cfg.out, "the export")
    check_out_apart_from_inputs(cfg.out, {"--model": cfg.model, "--adapter": cfg.adapter,
                                          "--quantizer": cfg.quantizer, "--cache": cfg.cache})


def _existing_export(cfg: ExportConfig) -> list[str]:
    """What --out holds, once checked replaceable: an export never mixes with another; an earlier one is replaced
    only with --overwrite and only when its export.json proves it an export; a folder holding anything else is
    refused."""
    out = Path(cfg.out)
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    foreign = [name for name in entries if name not in EXPORT_ENTRIES]
    if foreign:
        raise ValueError(f"--out {out}: holds files an export did not write ({', '.join(foreign[:3])}); pass an "
                         "empty or new folder")
    if entries and not owned_by(out / REPORT_FILE, EXPORT_KIND, EXPORT_LEGACY_KEYS):
        if (out / REPORT_FILE).exists() and read_record(out / REPORT_FILE) is None:
            raise ValueError(f"--out {out}: its {REPORT_FILE} is damaged (cut short?), so nothing proves the folder "
                             "an export to replace; delete the folder yourself if it is one, or pass a new folder")
        raise ValueError(f"--out {out}: holds {', '.join(entries[:3])} but no export.json of a qat-lora export; "
                         "pass an empty or new folder")
    if entries and not cfg.overwrite:
        raise ValueError(f"--out {out}: holds an earlier export; pass --overwrite to replace it or choose another "
                         "folder")
    return entries


def _prepare_out(cfg: ExportConfig, entries: list[str]) -> Path:
    """Remove the earlier export's entries (its record last) and write the new record first, so that an
    interrupted export stays provably ours."""
    out = Path(cfg.out)
    for name in [e for e in entries if e != REPORT_FILE] + [REPORT_FILE] * (REPORT_FILE in entries):  # record last
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    atomic_write_json(out / REPORT_FILE, {**owner_stamp(EXPORT_KIND), "config": asdict(cfg), "complete": False})
    return out


def byte_breakdown(model: nn.Module) -> dict[str, int]:
    """Bytes of the low-bit student as the packed format stores them: quantised linears' codes, their quantiser
    tensors (fp16 scales, offsets and codebooks, integer zeros at the codes' width), the input embeddings, the
    head (0 when tied) and the rest."""
    layers = quantised_layers(model)
    sizes = {id(t): t.numel() * t.element_size() for t in full_precision_tensors(model, layers).values()}
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    embeddings = emb.numel() * emb.element_size()
    head_bytes = 0 if head.data_ptr() == emb.data_ptr() else head.numel() * head.element_size()
    return {"quantised_linears": sum(math.ceil(m.weight.numel() * m.cfg.bits / 8) for m in layers.values()),
            "scales": sum(math.ceil((layer_bits(m) - m.weight.numel() * m.cfg.bits) / 8) for m in layers.values()),
            "embeddings": embeddings, "head": head_bytes, "other": sum(sizes.values()) - embeddings - head_bytes}


def _carry_adapter(cfg: ExportConfig, peft_model, out: Path, tokenizer, log: Callable[[str], None],
                   device: torch.device = HOST):
    """The adapter's way into the export (merge.py): beside the base (adapter/), merged into the grid,
    and/or merged in full precision (merged-fp/); held-out metrics and verdicts when --cache is given, their
    forwards on `device` (each model back on the host before it is merged or written).
    Returns (the student without PEFT wrappers, report)."""
    info: dict = {}
    amp_dtype = precision.autocast_dtype(device, cfg.precision)  # eval's and training's: the same loss values

    def measure(model) -> dict:
        return heldout_metrics(model, cfg.cache, cfg.batch_size, device, amp_dtype)

    measured = (student_and_base_metrics(peft_model, cfg.cache, cfg.batch_size, device, amp_dtype) if cfg.cache
                else None)
    if measured:
        info["heldout"] = measured
    if cfg.merge_fp:
        full = merge_full_(copy.deepcopy(peft_model))
        save_pretrained(full, out / MERGED_FP_DIR)
        save_pretrained(tokenizer, out / MERGED_FP_DIR)
        if measured:
            info["merge_fp"] = recovery_verdict(measured, measure(full), "--merge-fp")
    if not cfg.merge_adapter:
        # PEFT's own names over the base's module names; recorded as made over --model's weights
        save_adapter(peft_model, out / ADAPTER_DIR, identities.weights_signature(cfg.model))
        if cfg.format == "gguf":
            info["gguf"] = save_gguf_lora(peft_model, out / GGUF_DIR)
        return peft_model.unload(), info
    student, info["merge"] = merge_lora_(peft_model)
    if cfg.resnap_steps:
        student, info["merge"]["resnap"] = _resnap(cfg, student, out, tokenizer, log, device)
    if measured:
        info["merge"].update(recovery_verdict(measured, measure(student), "--merge-adapter"))
    elif info["merge"]["requant_rel_error"] > KEEP_THRESHOLD:
        info["merge"]["verdict"] = (f"WARNING --merge-adapter: re-quantisation moved the weights by "
                                    f"{info['merge']['requant_rel_error']:.0%} of the adapter's change, so most of "
                                    "the recovery may be lost; pass --cache to measure it")
    for key in ("merge_fp", "merge"):
        if "verdict" in info.get(key, {}):
            log(info[key]["verdict"])
    return student, info


def _resnap(cfg: ExportConfig, merged: nn.Module, out: Path, tokenizer, log: Callable[[str], None],
            device: torch.device = HOST):
    """Re-snap the grid-merged student: the trainer's weight-qat / qat preset, started from the merged latent
    weights Wq + dW (saved as a plain model) with the base's scales, trained against --cache on --device (with
    --precision) so the weights that land on the grid keep the adapter's recovery. Returns (the re-snapped student
    on its grid, on the host, built from the run's quantiser file; the run summary)."""
    work = out / RESNAP_DIR
    plain = copy.deepcopy(merged)
    for name, layer in quantised_layers(plain).items():  # the latent weights, not their grid values
        linear = layer.to_linear()
        linear.weight.data = layer.weight.detach().clone()
        parent, _, child = name.rpartition(".")
        setattr(plain.get_submodule(parent) if parent else plain, child, linear)
    save_pretrained(plain, work / "model")
    save_pretrained(tokenizer, work / "model")
    save_quantizer_state(merged, work / "start-quantizer.safetensors",  # the base's scales and zeros
                         model_signature=identities.weights_signature(work / "model"))
    spec = StudentSpec(str(work / "model"), cfg.quant, str(work / "start-quantizer.safetensors"))
    log(f"re-snap: {cfg.resnap_preset}, {cfg.resnap_steps} steps on {cfg.cache}")
    # --device and --precision passed on: the re-snap runs where the report did, not where the trainer would pick
    summary = train(TrainConfig(**asdict(spec), cache=cfg.cache, out=str(work / "run"), preset=cfg.resnap_preset,
                                max_steps=cfg.resnap_steps, lr=cfg.resnap_lr, batch_size=cfg.batch_size,
                                weight_lr_ratio=RESNAP_WEIGHT_LR_RATIO,
                                warmup_steps=max(1, cfg.resnap_steps // 20), overwrite=True,
                                device=cfg.device, precision=cfg.precision), log)
    student = build_student(replace(spec, quantizer=summary["quantizer"]), resolve_attn("auto", device)).eval()
    shutil.rmtree(work / "model")  # a full-precision copy: the export's own folders hold the result
    return student, {"preset": cfg.resnap_preset, "steps": cfg.resnap_steps, "quantizer": summary["quantizer"]}


def export_student(cfg: ExportConfig, log: Callable[[str], None] = print) -> dict:
    """Build the student (with its adapter), carry the adapter (beside or merged), write the artefacts;
    returns the report (also out/export.json) and logs what each folder holds and how to load it."""
    _check_out(cfg)
    with FolderLock(cfg.out):
        return _export(cfg, log)


# `qat-lora export`'s entry (commands/cli.py). The public name is qat_lora.export_student: `qat_lora.export` is the
# stage's package, which replaces a function of that name on the package as soon as one of its modules loads.
export = export_student


def _export(cfg: ExportConfig, log: Callable[[str], None]) -> dict:
    entries = _existing_export(cfg)
    # Only the held-out report and the re-snap run on the device (both need --cache): resolved before anything
    # loads or is removed, so a device this host lacks fails first.
    device = dev.resolve_device(cfg.device) if cfg.cache else HOST
    tokenizer = models.load_tokenizer(cfg.model)  # the inputs load before anything is removed
    student = load_student(cfg.student_spec(), cfg.adapter, resolve_attn("auto", device))  # eager on XLA, as eval
    out = _prepare_out(cfg, entries)
    report: dict = {**owner_stamp(EXPORT_KIND), "config": asdict(cfg), "complete": True,
                    "quant_config": quant_config_dict(get_preset(cfg.quant))}
    if cfg.adapter:
        student, report["adapter"] = _carry_adapter(cfg, student, out, tokenizer, log, device)
    report["bits_per_weight"] = bits_per_weight(student)
    report["bytes"] = byte_breakdown(student)
    if cfg.format in ("packed", "both"):
        header = save_packed(student, out / PACKED_DIR, get_preset(cfg.quant), tokenizer)
        report["packed"] = {"bits_per_weight": header["bits_per_weight"], "bytes": header["bytes"],
                            "layers": len(header["layers"])}
    if cfg.format == "gguf":
        teacher_gguf = cfg.model if Path(cfg.model).suffix == ".gguf" else None  # its metadata carry over
        report["gguf"] = save_gguf(student, out / GGUF_DIR, tokenizer, Path(cfg.model).name or "student", teacher_gguf)
        warn_if_lossy(report["gguf"])  # --gguf-requantize asked for it, or w4g32's Q4_1 rounded its offsets
    if cfg.format == "compressed-tensors":
        report["compressed_tensors"] = save_compressed_tensors(student, out / CT_DIR, get_preset(cfg.quant), cfg.quant,
                                                               tokenizer)
    if cfg.format in ("dense", "both"):
        save_dense(student, out / DENSE_DIR, tokenizer)
    report["folders"] = {name: FOLDER_HELP[name] for name in FOLDER_HELP if (out / name).exists()}
    atomic_write_json(out / REPORT_FILE, report)
    summary = {k: v for k, v in report.items() if k not in ("config", "folders", OWNER_KEY, "complete")}
    if "gguf" in summary:  # per-layer errors stay in export.json; the console gets the totals
        summary["gguf"] = {k: v for k, v in summary["gguf"].items() if k != "layers"}
    log(json.dumps(summary, indent=2))
    log("\n".join(f"{name}/: {text}" for name, text in report["folders"].items()))
    return report
