"""qat_lora.train."""
