"""Train recovery LoRA adapters on one device from a KD cache. Same flags as `qat-lora train` (see --help)."""
import os
import sys

from qat_lora.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(script=os.path.basename(__file__), argv=["train", *sys.argv[1:]]))
