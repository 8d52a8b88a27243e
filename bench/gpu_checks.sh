#!/usr/bin/env bash
# One prepared GPU session (CUDA machine, no network), about 8 minutes: the CUDA tests; the training-step cost of
# every objective against an AR step on a 0.5B-class body (SDPA dense masks, then flex BlockMasks); the AR step and
# the ISD N=3 step with gated adapters active, captured (their gate sync-free) and not, at batch 1 / 8; the growing
# cache vs the static step vs CUDA graphs at batch 1 / 8 / 32 without adapters; and `ar` against `isd` end to end
# on a 1B-class body with the drafts forced to set acceptance rates (bench/forced_acceptance.py). Random weights of the model's shape or of a named larger body on its
# vocabulary (bench/shapes.py), so the config and tokenizer folder is enough. Logs and JSON go to $OUT.
#
#   OUT=/tmp/gpu bash bench/gpu_checks.sh [MODEL_FOLDER_OR_ALIAS]
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/dlm_gpu}
mkdir -p "$OUT"
M=${1:-smollm2-135m}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
t0=$SECONDS
timeout 150 python3 -m pytest -p no:cacheprovider -o addopts="" -q -m gpu tests/test_gpu.py tests/test_decode_static.py --timeout 120 -rA \
  2>&1 | grep -v "Warning\|warn(" | tee "$OUT/pytest_gpu.log" | tail -20
echo "tests: $((SECONDS - t0)) s"
t0=$SECONDS
timeout 75 python3 bench/objectives.py --model "$M" --random-init --shape 0.5b --device cuda --bf16 --batch-size 8 \
  --lengths 2048 --reps 5 --json "$OUT/objectives_sdpa.json" 2>&1 | grep -v "Warning\|warn(" | tee -a "$OUT/bench.log"
echo "objectives sdpa: $((SECONDS - t0)) s"
t0=$SECONDS
timeout 50 python3 bench/static_step.py --model "$M" --random-init --device cuda --dtype bf16 --batch-sizes 1,8 \
  --decoders ar,isd3 --modes static,graphs --max-new-tokens 24 --groups 1 --adapters \
  --json "$OUT/static_step_adapters.json" 2>&1 | grep -v "Warning\|warn(" | tee -a "$OUT/bench.log"
echo "static step / CUDA graphs, gated adapters: $((SECONDS - t0)) s"
t0=$SECONDS
timeout 110 python3 bench/static_step.py --model "$M" --random-init --device cuda --dtype bf16 --batch-sizes 1,8,32 \
  --decoders ar,isd3 --modes dynamic,static,graphs --max-new-tokens 32 --groups 2 --json "$OUT/static_step.json" \
  2>&1 | grep -v "Warning\|warn(" | tee -a "$OUT/bench.log"
echo "static step / CUDA graphs: $((SECONDS - t0)) s"
t0=$SECONDS
timeout 90 python3 bench/objectives.py --model "$M" --random-init --shape 0.5b --device cuda --bf16 --batch-size 8 \
  --lengths 2048 --reps 5 --attn-impl flex_attention --json "$OUT/objectives_flex.json" 2>&1 \
  | grep -v "Warning\|warn(" | tee -a "$OUT/bench.log"
echo "objectives flex: $((SECONDS - t0)) s"
t0=$SECONDS
timeout 90 python3 bench/forced_acceptance.py --model "$M" --shape 1b --device cuda --dtype bf16 --batch-size 1,8 \
  --stride 3 --acceptance 0,0.6,0.9 --new-tokens 64 2>&1 | grep -v "Warning\|warn(" | tee -a "$OUT/bench.log"
echo "forced acceptance (1b): $((SECONDS - t0)) s"
echo "all: ${SECONDS} s"
