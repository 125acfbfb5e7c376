"""qat_lora.export."""
