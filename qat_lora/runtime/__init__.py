"""qat_lora.runtime."""
