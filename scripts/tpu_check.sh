#!/usr/bin/env bash
# Prove the TPU path on this host in one run (docs/TPU.md): the pinned install, a KD cache built on every chip,
# 20 training steps on 1 chip and on all N (one SPMD process), a run stopped by SIGTERM after its first step and
# resumed to 3 x 20 steps, then one line per run
# with the graphs compiled, step time, tokens/s and MFU against the chip's bf16 peak. Run it on a v6e host:
#
#     bash scripts/tpu_check.sh                    # SmolLM2-135M from fetch-assets, every chip
#     MODEL=path/to/model DATA=path/to/text bash scripts/tpu_check.sh
#
# Environment (all optional): MODEL, DATA (default: the fetch-assets teacher and its training text), WORK
# (default: runs/tpu_check; the script's own folder, replaced), STEPS (20), BATCH (8), SEQ_LEN (512),
# DEVICE (tpu; xla on XLA:CPU, how the tests run it), CHIPS (0 = every chip), PEAK_TFLOPS (918: v6e bf16),
# INSTALL (1: pip install the `tpu` extra first; 0 to skip), PYTHON (python3).
set -euo pipefail

PYTHON=${PYTHON:-python3}
WORK=${WORK:-runs/tpu_check}
STEPS=${STEPS:-20}
BATCH=${BATCH:-8}
SEQ_LEN=${SEQ_LEN:-512}
DEVICE=${DEVICE:-tpu}
CHIPS=${CHIPS:-0}
PEAK_TFLOPS=${PEAK_TFLOPS:-918}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
QAT=("$PYTHON" -m qat_lora)

step() { echo; echo "== $*"; }

if [[ ${INSTALL:-1} == 1 ]]; then
  step "install: torch, torch-xla and libtpu at the versions pyproject pins"
  "$PYTHON" -m pip install -q -e "$ROOT[tpu]"
fi
"$PYTHON" -c "import torch, torch_xla; print('torch', torch.__version__, '| torch_xla', torch_xla.__version__)"

if [[ -z ${MODEL:-} || -z ${DATA:-} ]]; then
  step "assets: SmolLM2-135M-Instruct and its training text (qat-lora fetch-assets)"
  "${QAT[@]}" fetch-assets
  ASSETS=$("$PYTHON" -c "from qat_lora.data.assets import default_assets_dir; print(default_assets_dir())")
  MODEL=${MODEL:-smollm2-135m}
  DATA=${DATA:-$ASSETS/text/train}
fi
rm -rf "$WORK"
mkdir -p "$WORK"

step "cache: every chip at once ($DEVICE, --num-chips $CHIPS: one SPMD process on XLA)"
"${QAT[@]}" build-cache --teacher "$MODEL" --data "$DATA" --out "$WORK/cache" --seq-len "$SEQ_LEN" \
  --max-tokens $((SEQ_LEN * BATCH * 16)) --device "$DEVICE" --num-chips "$CHIPS"

train_command() {  # train_command OUT CHIPS STEPS [extra flags]: sets TRAIN to that training command line
  local out=$1 chips=$2 steps=$3
  shift 3
  TRAIN=("${QAT[@]}" train --model "$MODEL" --cache "$WORK/cache" --out "$out" --quant w4g64 --max-steps "$steps"
         --batch-size "$BATCH" --device "$DEVICE" --num-chips "$chips" --xla-cache-dir "$WORK/xla-cache" "$@")
}
train() { train_command "$@"; "${TRAIN[@]}"; }

step "train: $STEPS steps on 1 chip"
train "$WORK/one" 1 "$STEPS" --log-steps 5
step "train: $STEPS steps on every chip (one SPMD process, --parallel auto)"
train "$WORK/all" "$CHIPS" "$STEPS" --log-steps 5

step "stop and resume: SIGTERM after the first logged step, then --resume auto"
train_command "$WORK/stopped" 1 $((STEPS * 3)) --log-steps 1
"${TRAIN[@]}" &  # the training process itself, so that the signal reaches it
pid=$!
until [[ -s $WORK/stopped/metrics.jsonl ]] || ! kill -0 "$pid" 2>/dev/null; do sleep 1; done
kill -TERM "$pid" 2>/dev/null || true
code=0
wait "$pid" || code=$?
[[ $code == 143 ]] || { echo "tpu_check: the stopped run exited $code (expected 143: SIGTERM, saved)" >&2; exit 1; }
train "$WORK/stopped" 1 $((STEPS * 3)) --log-steps 1 --resume auto

step "report"
"$PYTHON" - "$WORK" "$PEAK_TFLOPS" "$MODEL" <<'EOF'
import json, statistics, sys
from pathlib import Path

from qat_lora.runtime.runs import read_metrics

work, peak, model = Path(sys.argv[1]), float(sys.argv[2]) * 1e12, sys.argv[3]
rows = {}
for name in ("one", "all", "stopped"):
    run = work / name
    summary = json.loads((run / "summary.json").read_text())
    compile_report = summary.get("compile", {})
    records = [r for r in read_metrics(run)[0] if "tokens_per_s" in r]
    steady = [r["tokens_per_s"] for r in records[1:]] or [summary["tokens_per_s"]]  # the first includes compiles
    tokens_per_s = statistics.median(steady)
    params = summary.get("model_parameters")
    chips = summary["world_size"]
    step_tokens = summary["tokens"] / max(summary["steps"], 1)
    row = {"chips": chips, "steps": summary["steps"], "steps_this_process": summary["steps_this_process"], "graphs_compiled": compile_report.get("graphs_compiled"),
           "graphs_after_step_2": compile_report.get("graphs_compiled_after_step_2"),
           "cpu_fallback_ops": compile_report.get("cpu_fallback_ops"), "tokens_per_s": round(tokens_per_s, 1),
           "step_s": round(step_tokens / tokens_per_s, 4)}
    if params:  # LoRA on a frozen base: forward 2N + input gradients 2N FLOPs per token (no weight gradients)
        row["mfu"] = float(f"{4 * params * tokens_per_s / (peak * chips):.3g}")
    rows[name] = row
    print(f"{name:8s} " + " ".join(f"{k}={v}" for k, v in row.items()))
(work / "tpu_check.json").write_text(json.dumps({"model": model, "peak_tflops": peak / 1e12, "runs": rows}, indent=1))
print(f"written {work / 'tpu_check.json'}")
EOF
