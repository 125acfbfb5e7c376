"""The quantised student's base: presets (QuantConfig, PRESETS), the grids (group-wise int-N, LUT,
llama.cpp K-quants) and their inits (RTN, MSE clipping, k-means, HQQ), FakeQuantLinear and `quantize_`, PEFT's
LoRA layer over it (QuantLoraLinear: its exact and grid merges), and the data-aware inits that move the base
before training: activation statistics, GPTQ, decoder-block capture and
block-wise reconstruction. The quantiser's state (quantizer.safetensors) is written and read here.

May import: runtime, data, cache (calibration batches come from the cache's training split).
"""
