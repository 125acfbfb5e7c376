"""Quantisation-aware training of the quantiser's scales and zeros (no LoRA) from a KD cache.

Same flags as `qat-lora train` with `--preset qat` (pass `--preset qat+lora` to train adapters as well):

    python scripts/train_qat.py --model M --cache caches/kd --quant w3g64 --out runs/w3g64-qat
"""
import os
import sys

from qat_lora.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(script=os.path.basename(__file__), argv=["train", *sys.argv[1:]],
                  defaults={"preset": "qat"}))
