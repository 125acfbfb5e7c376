"""`python -m qat_lora ...` is the `qat-lora` command (what launchers and notebooks start)."""
import sys

from qat_lora.commands.cli import main

sys.exit(main())
