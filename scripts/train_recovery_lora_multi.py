"""Multi-chip training: `--num-chips N` plus every flag of `qat-lora train` (the same as `qat-lora train --num-chips N`).

    python scripts/train_recovery_lora_multi.py --num-chips 2 --device cpu --model M --cache caches/kd --out runs/x
    python scripts/train_recovery_lora_multi.py --num-chips 4 --device tpu --model M --cache caches/kd --out runs/x
    python scripts/train_recovery_lora_multi.py --num-chips 4 --device tpu --parallel spmd ...  # one SPMD process
    torchrun --nproc-per-node 8 scripts/train_recovery_lora_multi.py --device cuda ...   # ranks from torchrun

CUDA/CPU: N local processes through torch.distributed (NCCL/gloo); a rank that fails stops the others.
TPU: torch_xla replicas (xm.reduce_gradients + plain optimizer.step), or `--parallel spmd`: one process with
the batch sharded over the chips. XLA on a CPU host always runs SPMD. Each rank reads its own part of the
cache; the global batch is N x --batch-size x --accumulation-steps. See qat_lora/train/launch.py.
"""
import os
import sys

from qat_lora.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(script=os.path.basename(__file__), argv=["train", *sys.argv[1:]]))
