"""Multi-chip recovery LoRA: `--num-chips N` plus every flag of `qat-lora train`.

    python scripts/train_recovery_lora_multi.py --num-chips 4 --model M --cache caches/kd --quant w3g64

N = 1 runs the single-device trainer. N > 1 (TPU processes, XLA SPMD, torch.distributed) lands with the
trainers issue; until then it stops with a one-line error instead of training on one chip silently.
"""
import argparse
import sys

from qat_lora.cli import main


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    parser.add_argument("--num-chips", type=int, default=1, help="devices to train on (TPU chips, GPUs, processes)")
    parser.add_argument("--parallel", choices=("auto", "processes", "spmd"), default="auto",
                        help="one process per chip, or one SPMD process over a data mesh")
    return parser.parse_known_args(argv)


if __name__ == "__main__":
    args, rest = _parse(sys.argv[1:])
    if args.num_chips < 1:
        print(f"train_recovery_lora_multi: error: --num-chips {args.num_chips}: must be >= 1", file=sys.stderr)
        sys.exit(2)
    if args.num_chips > 1:
        print(f"train_recovery_lora_multi: error: --num-chips {args.num_chips}: multi-chip training is not "
              "available yet (trainers issue); run with --num-chips 1", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(["train", *rest]))
