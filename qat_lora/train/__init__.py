"""Recovery training: the student (quantised base + PEFT LoRA: built, loaded, what trains), the KD losses
(top-K + tail, sampled, full; chunked over the lm_head), the optimizer and schedule, the trainer (one loop,
QAT and LoRA are presets of it) with its checkpoints, held-out metrics and reporters, and how a run's ranks
start.

May import: runtime, data, cache, quant.
"""
