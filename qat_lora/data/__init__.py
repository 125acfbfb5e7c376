"""qat_lora.data."""
