"""qat_lora.commands."""
