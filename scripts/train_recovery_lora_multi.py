"""Multi-chip training: `--num-chips N` plus every flag of `qat-lora train`.

    python scripts/train_recovery_lora_multi.py --num-chips 2 --device cpu --model M --cache caches/kd --out runs/x
    python scripts/train_recovery_lora_multi.py --num-chips 4 --device tpu --model M --cache caches/kd --out runs/x
    torchrun --nproc-per-node 8 scripts/train_recovery_lora_multi.py --device cuda ...   # ranks from torchrun

CUDA/CPU: N local processes through torch.distributed (NCCL/gloo); a rank that fails stops the others.
TPU: torch_xla replicas (xm.reduce_gradients + plain optimizer.step). Each rank reads its own part of the
cache; the global batch is N x --batch-size. --parallel spmd (one process, a sharded batch) is not built yet.
"""
import argparse
import sys

from qat_lora.distributed import run_multi


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    parser.add_argument("--num-chips", type=int, default=1, help="devices to train on (TPU chips, GPUs, processes)")
    parser.add_argument("--parallel", choices=("auto", "processes", "spmd"), default="auto",
                        help="one process per chip, or one SPMD process over a data mesh")
    return parser.parse_known_args(argv)


if __name__ == "__main__":
    args, rest = _parse(sys.argv[1:])
    try:
        sys.exit(run_multi(args.num_chips, args.parallel, rest))
    except ValueError as e:
        print(f"train_recovery_lora_multi: error: {e}", file=sys.stderr)
        sys.exit(2)
