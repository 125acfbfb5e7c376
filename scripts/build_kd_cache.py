"""Run the teacher once over a corpus and write the KD cache. Same flags as `qat-lora build-cache` (see --help)."""
import os
import sys

from qat_lora.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(script=os.path.basename(__file__), argv=["build-cache", *sys.argv[1:]]))
