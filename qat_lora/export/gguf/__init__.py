"""qat_lora.export.gguf."""
