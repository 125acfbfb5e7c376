"""GGUF files for llama.cpp: the writer (tensors in llama.cpp's block layouts from the student's own codes,
metadata), the architecture table (names, hyper-parameter keys, q/k row order, refusals), the tokenizer
vocabulary, the K-quant super-block byte layout, and GGUF LoRA adapters.

May import what export may: runtime, data, cache, quant, train.
"""
