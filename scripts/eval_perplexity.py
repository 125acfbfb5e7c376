"""Held-out perplexity and KD metrics of a teacher, PTQ or recovered student. Same flags as `qat-lora eval` (see --help)."""
import sys

from qat_lora.cli import main

if __name__ == "__main__":
    sys.exit(main(script="eval_perplexity", argv=["eval", *sys.argv[1:]]))
