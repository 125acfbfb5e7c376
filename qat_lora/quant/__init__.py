"""qat_lora.quant."""
