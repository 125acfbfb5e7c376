"""Loading teachers and students: a transformers directory, a GGUF file, or (when online) a hub name.

What identifies them (hashes, signatures) is in identities.py.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from qat_lora.runtime import xla
from qat_lora.runtime.files import first_line, register_named_folder


# The model families the toolkit is tested on (tests/test_families.py: cache, GPTQ and block-wise init, training,
# eval, generation and every export format), by transformers model_type. What differs between them and matters
# here is read from the config where it is used: a final-logit soft-cap (`logit_softcap`), tied embeddings
# (the model's own get_output_embeddings), sliding-window or hybrid layers (each layer's own kwargs,
# blocks.capture_block_inputs), fused linears (Phi-3's qkv_proj / gate_up_proj: quantised and adapted whole).
FAMILIES = {"llama": ("llama",), "qwen2": ("qwen2",), "qwen3": ("qwen3",), "gemma3": ("gemma3_text",),
            "mistral": ("mistral",), "phi3": ("phi3",)}


def family_of(name_or_path: str | Path) -> str | None:
    """The tested family (a FAMILIES key) of a model folder, from its config.json; None for another model type,
    a .gguf file or a hub name."""
    config = read_model_config(name_or_path) or {}
    return next((family for family, types in FAMILIES.items() if config.get("model_type") in types), None)


def logit_softcap(config) -> float | None:
    """The final-logit soft-cap c of a transformers config (Gemma 2: logits = c * tanh(logits / c)), or None
    (Gemma 3, Llama, Qwen, Mistral, Phi-3)."""
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def sequence_prefix(tokenizer) -> list[int]:
    """The token(s) every sequence must open with: [BOS] for tokenizers that put it before any text themselves
    (Gemma, Llama 3, Mistral: their models are trained only on sequences that start with it, and Gemma 3 270M's
    Wikipedia perplexity is 33.5 without it against 11.4 with it), else [] (SmolLM2, Qwen)."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a")["input_ids"] if bos is not None else []
    return [bos] if ids and ids[0] == bos else []


def _looks_like_path(name: str) -> bool:
    # Hub names are "name" or "org/name"; anything else path-shaped is a path that must exist.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith(".gguf")


def fetched_teacher(name: str) -> Path | None:
    """The folder of a `qat-lora fetch-assets` teacher named as such (smollm2-135m, gemma3-270m: every command's
    --model / --teacher takes the name), in the default asset folder; None for any other name.

    Raises:
        ValueError: the name of a teacher not fetched yet, with the command that fetches it.
    """
    from qat_lora.data.teachers import TEACHERS

    if name not in TEACHERS:
        return None
    from qat_lora.data.assets import Assets, assets_ready, default_assets_dir

    if not assets_ready(default_assets_dir(), name):
        raise ValueError(f"model {name}: a fetch-assets teacher, not fetched yet into {default_assets_dir()}; run "
                         f"`qat-lora fetch-assets --teacher {name}` (or pass a model folder)")
    return Assets.at(default_assets_dir(), name).teacher_dir


def _fetched_folder(name: str) -> Path | None:
    """A fetched teacher's folder for its name, or None (not a teacher's name, or not fetched: nothing on disk)."""
    try:
        return fetched_teacher(name)
    except ValueError:
        return None


register_named_folder(_fetched_folder)  # --out apart from --model smollm2-135m: its folder in the asset cache


def local_path(name_or_path: str | Path) -> Path:
    """Where a model named by the user lies: the path itself, or a fetched teacher's folder for its name."""
    path = Path(name_or_path).expanduser()
    return path if path.exists() else fetched_teacher(str(name_or_path)) or path


def _location(name_or_path: str | Path) -> tuple[str, dict]:
    """(what from_pretrained takes, extra kwargs); GGUF files are opened through their folder + gguf_file.

    Raises:
        ValueError: a path that is not a model, or whose config.json is damaged (read_model_config).
    """
    name = str(name_or_path)
    path = local_path(name)
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        read_model_config(path)  # a damaged config.json is named here, not in a message from deep inside transformers
        return str(path), {}
    if path.is_file():
        raise ValueError(f"model {name}: a file, not a model; pass a transformers model folder or a .gguf file")
    if path.exists() or _looks_like_path(name):
        raise ValueError(f"model {name}: no such model folder or .gguf file")
    return name, {}  # a hub name


_RECOPY = "copy or download the model again"


def read_model_config(name_or_path: str | Path) -> dict | None:
    """The config.json of a model folder, checked (None for a .gguf file or a hub name): what commands read
    before loading the model (its context length, its model_type), in milliseconds.

    Raises:
        ValueError: no config.json, or one that is not a JSON object with a model_type, naming the file.
    """
    name = str(name_or_path)
    path = local_path(name)
    if not path.is_dir():
        return None
    file = path / "config.json"
    if not file.is_file() and (file.exists() or file.is_symlink()):  # a folder, a broken or looping link
        raise ValueError(f"model {name}: cannot load: {file} is not a readable file; {_RECOPY}")
    if not file.is_file():
        raise ValueError(f"model {name}: folder has no config.json; pass a transformers model folder or a .gguf file")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"model {name}: cannot load: {file} is not valid JSON (truncated?); {_RECOPY}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        what = "has no model_type" if isinstance(config, dict) else "is not a JSON object"
        raise ValueError(f"model {name}: cannot load: {file} {what}, so it is no transformers config; {_RECOPY}")
    return config


PACKED_MODEL_TYPE = "qat-lora-packed"  # packed/config.json's model_type (export/exporter.py): no transformers type


def is_packed_export(name_or_path: str | Path) -> bool:
    """Whether a model folder is a packed export (a student holding its grid; export.exporter.load_packed loads it),
    also one written before the format had its own model_type (its base model's config inside)."""
    config = read_model_config(name_or_path) or {}
    return config.get("model_type") == PACKED_MODEL_TYPE or "base_config" in config


def check_model(name_or_path: str | Path) -> None:
    """What a config checks before anything loads: the model exists, its config.json is sound, and what loading it
    needs is installed."""
    _location(name_or_path)
    _dequantizing(name_or_path)


def model_context(model: str) -> int | None:
    """max_position_embeddings from the model's config.json (a packed export's inside base_config), if known."""
    config = read_model_config(model) or {}
    limit = config.get("base_config", config).get("max_position_embeddings")
    return limit if isinstance(limit, int) else None


def _damaged_json(name_or_path: str | Path) -> tuple[Path, str] | None:
    """The first .json file of a model folder that does not parse (a cut-short copy) or cannot be read (a
    folder or a looping link by that name), and what is wrong with it; None if there is none."""
    path = local_path(name_or_path)
    for file in sorted(path.glob("*.json")) if path.is_dir() else []:
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return file, "is not valid JSON (truncated?)"
        except OSError:
            return file, "is not a readable file"
    return None


def load_tokenizer(name_or_path: str | Path):
    xla.keep_torch_xla_unloaded()  # importing transformers imports accelerate, which imports torch_xla
    from transformers import AutoTokenizer

    location, kwargs = _location(name_or_path)
    folder = local_path(name_or_path)
    for file in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if not file.is_file():  # a folder or a looping link by that name: transformers would skip it silently
            raise ValueError(f"model {name_or_path}: cannot load: {file} is not a readable file; {_RECOPY}")
    if is_packed_export(name_or_path):  # its config.json names no transformers type: the base model's does
        from transformers import CONFIG_MAPPING

        base = read_model_config(name_or_path)["base_config"]
        kwargs["config"] = CONFIG_MAPPING[base["model_type"]].from_dict(base)
    try:
        return AutoTokenizer.from_pretrained(location, **kwargs)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exception on a damaged file
        damaged = _damaged_json(name_or_path)
        if damaged is not None:  # transformers' own message names no file (a JSONDecodeError's position only)
            file, problem = damaged
            raise ValueError(f"tokenizer of {name_or_path}: cannot load: {file} {problem}; {_RECOPY}") from None
        raise ValueError(f"tokenizer of {name_or_path}: cannot load ({first_line(e)}); is the file complete?") from None


def load_causal_lm(name_or_path: str | Path, *, dtype: torch.dtype = torch.float32,
                   attn_implementation: str | None = None) -> nn.Module:
    """A transformers causal LM in eval mode on the CPU, fp32 by default.

    Raises:
        ValueError: missing path or unloadable model, or a config.json that does not match the weights (edited,
            or weights of another model copied in: transformers would leave the missing weights random), in one
            line naming it.
    """
    xla.keep_torch_xla_unloaded()
    from transformers import AutoModelForCausalLM

    location, kwargs = _location(name_or_path)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    kwargs.update(_dequantizing(name_or_path))
    from safetensors import SafetensorError

    report = _HeldReport()
    loader_log = logging.getLogger("transformers.modeling_utils")
    loader_log.addFilter(report)
    try:  # mismatched shapes load (and are refused below) rather than raise after a table of every weight
        with warnings.catch_warnings():  # "the folder's quantization_config is used": ours only adds dequantize
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            # use_kernels=False: transformers 5.25 swaps in Hub kernels by default (downloaded code; model.train()
            # then raises on XLA devices)
            model, info = AutoModelForCausalLM.from_pretrained(
                location, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True, use_kernels=False,
                **kwargs)
    except SafetensorError as e:  # a weights file cut short by a full disk or an interrupted copy
        raise ValueError(f"model {name_or_path}: a weights file is damaged or truncated ({first_line(e)}); copy or "
                         "download the model again") from None
    except OSError as e:
        raise ValueError(f"model {name_or_path}: cannot load ({first_line(e)})") from None
    finally:
        loader_log.removeFilter(report)
    mismatch = None if "gguf_file" in kwargs else _config_mismatch(info)  # a .gguf holds its config with its tensors
    if mismatch:
        raise ValueError(f"model {name_or_path}: its config.json does not match its weights ({mismatch}); restore "
                         f"the config.json that came with the weights, or {_RECOPY}")
    for record in report.held:  # nothing refused: transformers' report (tied weights, ...) as it would have been
        loader_log.handle(record)
    return model.eval()


def _dequantizing(name_or_path: str | Path) -> dict:
    """from_pretrained's extra kwargs for a compressed-tensors folder (ours or llm-compressor's): its weights
    decompressed as they load, so every command sees plain Linear weights (transformers' default keeps the packed
    ints and trips on packed zero points). Needs the compressed-tensors package; its absence is one line.

    Raises:
        ValueError: a compressed-tensors folder without the compressed-tensors package.
    """
    config = read_model_config(name_or_path) or {}
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "compressed-tensors":
        return {}
    if importlib.util.find_spec("compressed_tensors") is None:
        raise ValueError(f"model {name_or_path}: a compressed-tensors folder needs the compressed-tensors package: "
                         "pip install 'qat-lora[ct]'")
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


def linear_shapes(name_or_path: str | Path) -> dict[str, tuple[int, int]]:
    """{module name: (out_features, in_features)} of every nn.Linear of the model, from its config alone: the model
    is built on the meta device, so no weight is read or allocated (an 8B model's shapes in about a second).

    Raises:
        ValueError: as load_causal_lm, for a path that is not a model or a config that does not load.
    """
    xla.keep_torch_xla_unloaded()
    from transformers import AutoConfig, AutoModelForCausalLM

    location, kwargs = _location(name_or_path)
    try:
        config = AutoConfig.from_pretrained(location, **kwargs)
    except OSError as e:
        raise ValueError(f"model {name_or_path}: cannot load its config ({first_line(e)})") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # type(...) is nn.Linear: what quantize_ replaces (not a subclass such as an already quantised layer)
    return {name: (m.out_features, m.in_features) for name, m in model.named_modules() if type(m) is nn.Linear}


class _HeldReport(logging.Filter):
    """Holds back transformers' load report (weights missing, unexpected or of another shape: a table of
    dozens of lines) while a model loads, so that a mismatch ends in one line."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.held.append(record)
            return False
        return True


def _config_mismatch(info: dict) -> str | None:
    """What a load's info (from_pretrained's output_loading_info) says config.json and the weights files
    disagree on, or None when every weight the config asks for was loaded, at its shape."""
    mismatched = sorted(info.get("mismatched_keys") or [], key=lambda m: m[0])
    missing, unexpected = sorted(info.get("missing_keys") or []), sorted(info.get("unexpected_keys") or [])

    def more(keys: list) -> str:
        return f", {len(keys) - 1} more" if len(keys) > 1 else ""

    if mismatched:
        key, stored, expected = mismatched[0]
        return f"{key} is {list(stored)} in the weights, {list(expected)} by config.json{more(mismatched)}"
    if missing:
        return f"config.json asks for {missing[0]}, which no weights file holds{more(missing)}"
    if unexpected:
        return f"the weights hold {unexpected[0]}, which config.json has no place for{more(unexpected)}"
    return None


def max_positions(model: nn.Module) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def vocab_size(model: nn.Module) -> int:
    """Width of the logits (may exceed len(tokenizer) when the embedding is padded)."""
    return model.get_output_embeddings().weight.shape[0]


def decoder_and_head(model: nn.Module, apply_softcap: bool = False) -> tuple[nn.Module, nn.Module]:
    """(the decoder stack returning final normed hidden states, the output projection) of a causal LM,
    PEFT-wrapped or not, so the loss can run lm_head itself, chunk by chunk (`apply_softcap`: the caller applies
    `logit_softcap` after the projection, as the student's chunked loss does).

    Raises:
        ValueError: models whose logits are not a plain projection of the hidden states (a soft-cap the caller
            does not apply, scaling).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if (logit_softcap(config) and not apply_softcap) or getattr(config, "logit_scale", 1.0) not in (None, 1.0):
        raise ValueError(f"{config.model_type}: logits are soft-capped or scaled; use --loss-chunk-size 0")
    return base.get_decoder(), base.get_output_embeddings()


def head_weight_and_bias(head: nn.Module) -> tuple["torch.Tensor", "torch.Tensor | None"]:
    """The effective output-projection weight (fake-quantised if the head was quantised) and bias."""
    weight = head.quantized_weight() if hasattr(head, "quantized_weight") else head.weight
    return weight, head.bias
