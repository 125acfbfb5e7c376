"""The commands users type, each a thin recipe over the stages below: the CLI (the only place that reads argv;
it imports a command's module only when that command runs), quantize (the init stage), recover (init ->
block-wise -> optional QAT -> LoRA) and its --budget-bits choice (budget), evaluate, generate and chat, the
demo, and plot (no torch runtime).

May import every stage: runtime, data, cache, quant, train, export.
"""
