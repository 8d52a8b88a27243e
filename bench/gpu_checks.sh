#!/usr/bin/env bash
# One prepared GPU session (CUDA machine, no network): the CUDA tests, then the objectives' training-step cost
# (SDPA dense masks vs flex BlockMasks) and the decode forward cost by chunk shape, with random weights of the
# model's shape (the config and tokenizer folder is enough: --random-init). Logs and JSON go to $OUT.
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
timeout 270 python3 -m pytest -p no:cacheprovider -o addopts="" -q -m gpu tests/test_gpu.py tests/test_decode_static.py --timeout 200 -rA \
  2>&1 | grep -v "Warning\|warn(" | tee "$OUT/pytest_gpu.log" | tail -20
echo "tests: $((SECONDS - t0)) s"
t0=$SECONDS
timeout 110 python3 bench/objectives.py --model "$M" --random-init --device cuda --bf16 --batch-size 8 \
  --lengths 512,2048 --reps 5 --json "$OUT/objectives_sdpa.json" 2>&1 | grep -v "Warning\|warn(" | tee -a "$OUT/bench.log"
echo "objectives sdpa: $((SECONDS - t0)) s"
t0=$SECONDS
timeout 120 python3 bench/forward_cost.py --model "$M" --random-init --device cuda --dtype bf16 --batch-size 1,32 \
  --attn sdpa,dlm_sdpa \
  --repeats 30 2>&1 | grep -v "Warning\|warn(" | tee -a "$OUT/bench.log"
echo "forward cost: $((SECONDS - t0)) s"
t0=$SECONDS
timeout 150 python3 bench/static_step.py --model "$M" --random-init --device cuda --dtype bf16 --batch-sizes 1,8,32 \
  --decoders ar,isd3 --modes dynamic,static,graphs --max-new-tokens 32 --groups 2 --json "$OUT/static_step.json" \
  2>&1 | grep -v "Warning\|warn(" | tee -a "$OUT/bench.log"
echo "static step / CUDA graphs: $((SECONDS - t0)) s"
t0=$SECONDS
timeout 150 python3 bench/objectives.py --model "$M" --random-init --device cuda --bf16 --batch-size 8 \
  --lengths 2048 --reps 5 --attn-impl flex_attention --json "$OUT/objectives_flex.json" 2>&1 \
  | grep -v "Warning\|warn(" | tee -a "$OUT/bench.log"
echo "objectives flex: $((SECONDS - t0)) s"
