"""The quantised + LoRA student: build it from a `StudentSpec`, choose what trains, save and load what trained.

    spec = StudentSpec(model="path/to/model", quant="w3g64")
    student = build_student(spec)                       # fake-quantised, initialised as the preset says
    model = make_trainable_(student, "recovery-lora")   # PEFT LoRA over the frozen quantised base
    save_artifacts(model, "recovery-lora", run_dir)     # adapter/ (PEFT files) and/or quantizer.safetensors
    model = load_student(spec, adapter="run/adapter")   # what eval and export use

Train, eval, export, the demo and the benchmarks all build students here, never through the trainer. The
quantiser's own file (quantizer.safetensors) is written and read by quant/state.py; the adapter's here.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch

from qat_lora.runtime import device as dev

from qat_lora.data import models
from qat_lora.train.adapter import (ADAPTER_CARD, ADAPTER_RECORD, BASE_KEY, adapter_card, base_record, check_made_from,
                                   resolve_adapter_base)
from qat_lora.train.config import TRAIN_PRESETS, StudentSpec
from qat_lora.runtime.files import apply_umask, atomic_write_json, atomic_write_text, owner_stamp
from qat_lora.train.lora import add_recovery_lora_, load_recovery_lora
from qat_lora.quant.blocks import decoder_layers
from qat_lora.quant.fake_quant import FakeQuantLinear, get_preset, latent_weights, quantize_, quantizer_parameters
from qat_lora.quant.state import (MODEL_SIGNATURE_KEY, load_quantizer_state_, norm_parameters, quantised_weight_count,
                                  save_quantizer_state)
from qat_lora.runtime.runs import ADAPTER_DIR, QUANTIZER_FILE
from qat_lora.runtime.writes import writing

# Set on every student build_student makes: (--quant, the --quantizer file's absolute path or ""), the base its
# adapters record (adapter.base_record) when they are saved.
BASE_ATTR = "qat_lora_base"


def resolve_attn(attn_implementation: str, device: torch.device) -> str:
    """The attention kernel for `device`: sdpa calls .item() and recompiles on XLA (DESIGN §6), so auto
    means eager there and sdpa elsewhere."""
    if attn_implementation == "auto":
        return "eager" if dev.is_xla(device) else "sdpa"
    return attn_implementation


def build_student(spec: StudentSpec, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """Load the full-precision model and fake-quantise it with the spec's preset (initialised as the preset
    says), then load the spec's trained quantiser, if any. An empty `spec.quant` gives the model unquantised."""
    if spec.quant:
        check_made_from(spec.model, {"--quantizer": spec.quantizer})
    model = models.load_causal_lm(spec.model, attn_implementation=attn_implementation)
    if not spec.quant:
        return model
    config = get_preset(spec.quant)
    if spec.quantizer:  # every quantiser tensor is overwritten: skip the preset's (possibly slow) init search
        config = replace(config, init="rtn")
    student = quantize_(model, config)
    if spec.quantizer:
        load_quantizer_state_(student, spec.quantizer)
    setattr(student, BASE_ATTR, (spec.quant, str(Path(spec.quantizer).resolve()) if spec.quantizer else ""))
    return student


def load_student(spec: StudentSpec, adapter: str = "", attn_implementation: str = "sdpa") -> torch.nn.Module:
    """Teacher (no quant), PTQ student (quant), or trained student (quant + a qat run's quantizer and/or a
    recovery adapter), in eval mode: what eval, export and the benchmarks evaluate. The adapter brings the base it
    was trained over: a --quantizer left out is its base's, another one is refused (adapter.resolve_adapter_base)."""
    if spec.quant and adapter:  # an adapter over an export (--model packed/ or dense/, no --quant) is not a student's
        quantizer = resolve_adapter_base("--adapter", adapter, spec.model, spec.quant, spec.quantizer)[1]
        spec = spec if quantizer == spec.quantizer else replace(spec, quantizer=quantizer)
    student = build_student(spec, attn_implementation)
    if adapter:
        student = load_recovery_lora(student, adapter)
    return student.eval()


def make_trainable_(student: torch.nn.Module, preset: str, lora_r: int = 16, lora_alpha: float = 32.0,
                    norms: bool = False):
    """Freeze everything but what `preset` trains (and, with `norms`, the normalisation weights); returns the
    model to train (a PeftModel with LoRA).

    Raises:
        ValueError: an unknown preset.
    """
    if preset not in TRAIN_PRESETS:
        raise ValueError(f"--preset {preset!r}: choose one of {', '.join(TRAIN_PRESETS)}")
    parts = TRAIN_PRESETS[preset]
    if "lora" in parts:
        model = add_recovery_lora_(student, r=lora_r, alpha=lora_alpha)  # PEFT freezes the base
    else:
        model = student.requires_grad_(False)
    if "quantizer" in parts:
        for p in quantizer_parameters(model):
            p.requires_grad_(True)
    if "weights" in parts:  # the latent weights: the STE lets their codes move (fp32 + grad + 2 Adam states)
        for p in latent_weights(model):
            p.requires_grad_(True)
    if norms:
        for p in norm_parameters(model).values():
            p.requires_grad_(True)
    return model


STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # keys: config.STORAGE_DTYPES


def resolve_storage_dtype(storage: str, preset: str, amp_dtype: torch.dtype | None) -> str:
    """--storage-dtype auto: bf16 when only LoRA trains and the step computes in bf16 (autocast would cast every
    frozen weight to bf16 anyway: storing it so saves the fp32 copies and the casts), fp32 otherwise."""
    if storage != "auto":
        return storage
    return "bf16" if TRAIN_PRESETS[preset] == ("lora",) and amp_dtype == torch.bfloat16 else "fp32"


def check_compile(mode: str, device: torch.device) -> None:
    """--compile on / graphs are refused on XLA (the trainer asks before anything is written).

    Raises:
        ValueError: one line naming the flag and the fix.
    """
    if mode in ("on", "graphs") and dev.is_xla(device):
        raise ValueError(f"--compile {mode}: on XLA the step is already one compiled graph (torch.compile would "
                         "trace it again); drop --compile or pass --compile auto")


def compile_decoder_layers_(model: torch.nn.Module, mode: str, device: torch.device, storage: str,
                            checkpointing: bool = False) -> int:
    """--compile: torch.compile each decoder layer in place (`Module.compile`: parameter names, saved files and the
    optimizer's view unchanged), after placement. auto compiles on CUDA when the frozen student is stored in bf16
    (`storage`, resolved): each Wq is then a plain parameter and a layer is one graph, shared by every layer;
    a cached or trained Wq's bookkeeping would break the graph at every linear. XLA traces the step into one graph
    already; on the CPU the compile time outweighs the gain at the sizes trained there; with activation
    checkpointing (not measured compiled) auto stays eager. graphs compiles with Inductor's CUDA graphs
    (mode "reduce-overhead"): on one H200 the compiled step spent 54 of its 86 ms in kernels, the rest launching
    them from the host (docs/BENCHMARKS.md); the trainer then marks each step's start (`begin_step`). Inductor
    uses CUDA graphs on CUDA tensors only: elsewhere graphs is on. Returns the number of layers compiled (0: eager)."""
    check_compile(mode, device)
    if mode == "off" or (mode == "auto" and (device.type != "cuda" or storage != "bf16" or checkpointing)):
        return 0
    layers = decoder_layers(model)
    options = {"mode": "reduce-overhead"} if mode == "graphs" else {}
    for layer in layers:
        layer.register_forward_pre_hook(_without_kv_cache, with_kwargs=True)
        layer.compile(dynamic=False, **options)  # fixed batch and sequence shapes: one graph per layer signature
    return len(layers)


def begin_step(mode: str) -> None:
    """Before each optimizer step under --compile graphs: tells the CUDA-graph runtime that the previous step's
    graph outputs are no longer read, so its replays may reuse their memory (no-op for the other modes)."""
    if mode == "graphs":
        torch.compiler.cudagraph_mark_step_begin()


KV_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")  # the name differs between transformers versions


def _without_kv_cache(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A compiled decoder layer gets no KV cache. The model builds one (without it transformers checks the
    positions for packed sequences, a host read per forward); a layer would index it by its own layer_idx, a
    constant that makes every layer a graph of its own (past dynamo's limit of 8, the rest run eager). Training
    never reads the cache back."""
    return args, {**kwargs, **{k: None for k in KV_CACHE_KWARGS if k in kwargs}}



@torch.no_grad()
def set_storage_dtype_(model: torch.nn.Module, storage: str) -> torch.nn.Module:
    """--storage-dtype: store the frozen student in `storage` (call after make_trainable_, before placing it).

    With bf16, every frozen fake-quantised linear keeps only its Wq, in bf16 (no fp32 latent weight), and the
    other frozen floating parameters (embeddings, norms, lm_head) become bf16. Trainable parameters (LoRA, made
    fp32 by PEFT), the quantisers' own parameters (small; they define the grid) and buffers (rotary frequencies:
    bf16 would shift every position's angle) stay fp32. fp32 changes nothing.
    """
    dtype = STORAGE_DTYPES[storage]
    if dtype == torch.float32:
        return model
    quantizer = {id(p) for p in quantizer_parameters(model)}
    for module in model.modules():
        if isinstance(module, FakeQuantLinear):
            module.store_quantized_weight_(dtype)
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and id(p) not in quantizer:
            p.data = p.data.to(dtype)
    return model


def enable_activation_checkpointing_(model: torch.nn.Module, device: torch.device) -> None:
    """Recompute each decoder layer in backward with the checkpoint that really recomputes on `device`
    (XLA would merge a plain recomputation with the forward; DESIGN §6)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=dev.checkpoint_fn(device))
    base.enable_input_require_grads()  # a reentrant checkpoint passes gradients only to inputs that need them


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Trainable parameters by name, in module order (the optimizer's and the checkpoint's order)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def student_base(model, adapter_dir: Path, quantizer: str | None = None) -> dict | None:
    """The base an adapter of `model` saved in `adapter_dir` was trained over (adapter.base_record), from the
    student's BASE_ATTR: over `quantizer` instead when the run trained its own; None for a model that
    build_student did not make (nothing to record)."""
    built = getattr(model, BASE_ATTR, None)
    if built is None:
        return None
    quant, start = built
    return base_record(quant, start if quantizer is None else quantizer, adapter_dir)


def save_adapter(model, path: Path, model_signature: str | None = None, base: dict | None = None) -> None:
    """Write the LoRA adapters as standard PEFT files, atomically (temp folder, then rename), with their record:
    the signature of the model their base was made from and that base (`base`: student_base), so that whatever
    loads them loads it. Every file gets the umask's mode."""
    from peft import get_peft_model_state_dict

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    state = dev.state_dict_to_cpu(get_peft_model_state_dict(model))
    record = {**({MODEL_SIGNATURE_KEY: model_signature} if model_signature else {}),
              **({BASE_KEY: base} if base else {})}
    with writing(path, tmp):  # a full disk: no adapter.tmp left, one line naming the folder
        model.save_pretrained(str(tmp), state_dict=state)
        peft_config = model.peft_config[model.active_adapter]
        atomic_write_text(tmp / ADAPTER_CARD, adapter_card(peft_config.base_model_name_or_path, base, peft_config.r,
                                                           sum(t.numel() for t in state.values())))
        if record:
            atomic_write_json(tmp / ADAPTER_RECORD, {**owner_stamp("adapter"), **record})
        apply_umask(tmp)  # PEFT saves through safetensors, whose files are 0600 whatever the umask
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)


def save_artifacts(model, preset: str, folder: Path, codes: bool = False,
                   model_signature: str | None = None, norms: bool = False) -> dict[str, str | None]:
    """What the preset trained, in standard files: `adapter/` (PEFT) and/or `quantizer.safetensors`, whose codes
    are written when the weights trained or (`codes`) had moved before training (a GPTQ or weight-qat start);
    both record `model_signature`, the base model's, and the adapter its base: the quantiser the run started
    from, or the one written beside it when the preset trained it (written first, for its checksum). With `norms`
    (they trained, or the run started from a quantiser that carried them) the norms ride in the quantiser's file."""
    folder.mkdir(parents=True, exist_ok=True)
    paths: dict[str, str | None] = {"adapter": None, "quantizer": None}
    if "quantizer" in TRAIN_PRESETS[preset] or "weights" in TRAIN_PRESETS[preset]:
        save_quantizer_state(model, folder / QUANTIZER_FILE, codes=codes or "weights" in TRAIN_PRESETS[preset],
                             model_signature=model_signature, norms=norms)
        paths["quantizer"] = str(folder / QUANTIZER_FILE)
    if "lora" in TRAIN_PRESETS[preset]:
        save_adapter(model, folder / ADAPTER_DIR, model_signature,
                     student_base(model, folder / ADAPTER_DIR, paths["quantizer"]))
        paths["adapter"] = str(folder / ADAPTER_DIR)
    return paths


LORA_ENTRY_BITS = 16  # an unmerged adapter ships beside the low-bit base in fp16 (PEFT's files, GGUF's LoRA)


def lora_bits_per_weight(shapes: Iterable[tuple[int, int]], r: int) -> float:
    """What a rank-r LoRA adapter over linears of these (out, in) shapes adds to the base's bits per weight when it
    ships unmerged: A [r, in] and B [out, r], r (m + n) fp16 entries on an m x n layer, per quantised weight. From
    the shapes alone (recover --budget-bits chooses a rank before any weight loads); adapter_bits_per_weight
    counts the same on a built student."""
    shapes = list(shapes)
    return LORA_ENTRY_BITS * r * sum(m + n for m, n in shapes) / max(1, sum(m * n for m, n in shapes))


def adapter_bits_per_weight(model: torch.nn.Module) -> float:
    """What an unmerged LoRA adapter adds to the base's bits per weight (quant.state.bits_per_weight) when it ships
    beside the low-bit base: its fp16 entries per quantised weight (0 without one); rank r over the model's
    quantised linears: lora_bits_per_weight(their shapes, r)."""
    entries = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return LORA_ENTRY_BITS * entries / quantised_weight_count(model)
