"""Held-out perplexity and KD metrics of a teacher, PTQ or recovered student. Same flags as `qat-lora eval` (see --help)."""
import os
import sys

from qat_lora.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(script=os.path.basename(__file__), argv=["eval", *sys.argv[1:]]))
