"""From a trained student to the formats people run: packed codes and dense weights, compressed-tensors,
GGUF (llama.cpp's block layouts, vocabulary, architectures and LoRA adapters, in export/gguf/), the adapter
beside the base or merged into it (on the grid or in full precision), and the held-out report of what the export
kept.

May import: runtime, data, cache, quant, train (re-snapping a merged adapter trains a few steps).
"""
