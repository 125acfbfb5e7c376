"""qat-lora: recover the quality of low-bit LLMs by knowledge distillation into LoRA adapters.

The stages, in the order data flows (docs/ARCHITECTURE.md): `data` (text and models in) -> `cache` (the
teacher's targets, once) -> `quant` (`quantize_`: the fake-quantised base) -> `train` (`add_recovery_lora_`, the
KD trainer) -> `export`; `runtime` under all of them, `commands` (the CLI) above. The names below are the public
API, each imported from its stage on first use, so `import qat_lora` loads no model code, torch_xla or PEFT.
The five calls of a recovery, each a function of a config dataclass whose fields are its command's flags
(docs/API.md): `build_cache`, `quantize`, `recover`, `evaluate`, `export_student`.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "load_causal_lm": "qat_lora.data.models", "load_tokenizer": "qat_lora.data.models",
    "CacheBuildConfig": "qat_lora.cache.config", "build_cache": "qat_lora.cache.builder",
    "KDCache": "qat_lora.cache.reader",
    "QuantConfig": "qat_lora.quant.config", "PRESETS": "qat_lora.quant.config", "get_preset": "qat_lora.quant.config",
    "FakeQuantLinear": "qat_lora.quant.fake_quant", "quantize_": "qat_lora.quant.fake_quant",
    "add_recovery_lora_": "qat_lora.train.lora", "load_recovery_lora": "qat_lora.train.lora",
    "KDLossConfig": "qat_lora.train.loss", "kd_loss": "qat_lora.train.loss",
    "StudentSpec": "qat_lora.train.config", "TrainConfig": "qat_lora.train.config",
    "build_student": "qat_lora.train.student", "load_student": "qat_lora.train.student",
    "perplexity": "qat_lora.train.metrics", "kd_metrics": "qat_lora.train.metrics",
    # the commands as functions: config dataclass in, report dict out (docs/API.md)
    "QuantizeConfig": "qat_lora.commands.config", "quantize": "qat_lora.commands.quantize",
    "RecoverConfig": "qat_lora.commands.config", "recover": "qat_lora.commands.recover",
    "EvalConfig": "qat_lora.commands.config", "evaluate": "qat_lora.commands.evaluate",
    # export_student, not export: qat_lora.export is the stage's package
    "ExportConfig": "qat_lora.export.config", "export_student": "qat_lora.export.exporter",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'qat_lora' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
