"""qat_lora.cache."""
