"""qat-lora: recover the quality of low-bit LLMs by knowledge distillation into LoRA adapters.

Pipeline: `build_cache` (teacher top-K targets) -> `quantize_` (fake-quant student) ->
`add_recovery_lora_` -> `train` -> `evaluate`. Torch_xla is only imported when an XLA device is asked for.
"""
__version__ = "0.1.0"

from qat_lora.quant.fake_quant import PRESETS, FakeQuantLinear, QuantConfig, get_preset, quantize_  # noqa: E402
from qat_lora.train.loss import KDLossConfig, kd_loss  # noqa: E402
from qat_lora.train.lora import add_recovery_lora_  # noqa: E402

__all__ = ["__version__", "PRESETS", "FakeQuantLinear", "QuantConfig", "get_preset", "quantize_",
           "KDLossConfig", "kd_loss", "add_recovery_lora_"]
