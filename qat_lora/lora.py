"""Recovery LoRA over the quantised linears (DESIGN §5), through PEFT.

FakeQuantLinear is an nn.Linear subclass, so PEFT wraps it (as `base_layer`) like any Linear. B starts at
zero, so the adapted student equals the quantised student at step 0. Nothing on the base path is detached:
gradients flow through the frozen quantised weights to earlier adapters.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from .quant import FakeQuantLinear


def quantized_module_names(model: nn.Module) -> list[str]:
    """Full names of every FakeQuantLinear in `model`."""
    return [name for name, module in model.named_modules() if isinstance(module, FakeQuantLinear)]


def add_recovery_lora_(model: nn.Module, r: int = 16, alpha: float = 32.0, dropout: float = 0.0):
    """Wrap `model` in a PEFT model with LoRA adapters on every quantised linear; the base is frozen.

    Returns:
        the PeftModel (PEFT returns a new wrapper; the underlying modules are changed in place).
    Raises:
        ValueError: no quantised linear (call quantize_ first) or a non-positive rank.
    """
    from peft import LoraConfig, get_peft_model

    if r <= 0:
        raise ValueError(f"--lora-r {r}: must be positive")
    names = quantized_module_names(model)
    if not names:
        raise ValueError("add_recovery_lora_: the model has no quantised linear; call quantize_(model, preset) first")
    # Short leaf names ("q_proj", ...) keep adapter_config.json portable; fall back to full names when a
    # leaf name also belongs to a module left in full precision.
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
    clash = any(name.rsplit(".", 1)[-1] in leaves and not isinstance(module, FakeQuantLinear)
                for name, module in model.named_modules() if name)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=names if clash else leaves,
                        bias="none",
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def load_recovery_lora(model: nn.Module, adapter_dir: str | Path):
    """Attach saved PEFT adapters (a run's `adapter/` folder or a checkpoint's) to a quantised student."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").exists():
        raise ValueError(f"--adapter {adapter_dir}: no adapter_config.json; pass a run's adapter/ folder")
    from safetensors import SafetensorError

    try:
        return PeftModel.from_pretrained(model, str(adapter_dir))
    except SafetensorError as e:
        raise ValueError(f"--adapter {adapter_dir}: its weights are damaged or truncated ({e}); use the run's intact "
                         "adapter/ or a checkpoint's") from None
    except RuntimeError as e:  # load_state_dict's size mismatch: the adapter was trained on another model
        mismatch = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), None)
        if mismatch is None:
            raise
        detail = mismatch.removeprefix("size mismatch for ").rstrip(".")
        raise ValueError(f"--adapter {adapter_dir}: made for another model ({detail}); pass the --model its run "
                         "trained") from None
