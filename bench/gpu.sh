#!/usr/bin/env bash
# The roofline benchmark and `bench paper --quick` on a random-weight model shaped like
# Qwen2.5-1.5B (bench/qwen2.5-1.5b.json: its config, no hub), on a CUDA machine:
#
#   bench/gpu.sh                 # writes bench-gpu/{model,roofline.json,paper.json}
#
# Everything can be overridden from the environment (the test suite runs this script on
# the CPU with a tiny config): CONFIG, OUT, DEVICE, DTYPE, PYTHON, MARLAAS,
# ROOFLINE_ARGS, PAPER_ARGS.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
MARLAAS=${MARLAAS:-marlaas}
CONFIG=${CONFIG:-$here/qwen2.5-1.5b.json}
OUT=${OUT:-bench-gpu}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
ROOFLINE_ARGS=${ROOFLINE_ARGS:-}
PAPER_ARGS=${PAPER_ARGS:-}

if [ "$DEVICE" = cuda ]; then
  $PYTHON -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: set DEVICE=cpu")'
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi
mkdir -p "$OUT"
start=$SECONDS
echo "== random-weight model from $CONFIG ($DTYPE, $DEVICE)"
$PYTHON -m marlaas.bench.random_model "$CONFIG" "$OUT/model" --dtype "$DTYPE" --device "$DEVICE"
echo "== roofline"
# shellcheck disable=SC2086  # the extra arguments are meant to split
$MARLAAS bench roofline --model "$OUT/model" --device "$DEVICE" --dtype "$DTYPE" \
  --json "$OUT/roofline.json" $ROOFLINE_ARGS
echo "== bench paper --quick"
# shellcheck disable=SC2086
$MARLAAS bench paper --quick --model "$OUT/model" --json "$OUT/paper.json" $PAPER_ARGS
echo "== done in $((SECONDS - start)) s: $OUT/roofline.json, $OUT/paper.json"
