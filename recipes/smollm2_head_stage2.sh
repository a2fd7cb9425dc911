#!/usr/bin/env bash
# Stage 2 of the default head: start from stage 1's head (recipes/smollm2_head.sh: its weights
# and draft vocabulary), 1.5x the conversations (stage 1's regenerated chunks are reused), the
# target's features captured once (offline), 4 TTT steps (chains of K <= 4 and the default tree's
# depth 3 use no deeper ones), a lower peak learning rate. Resumable: rerun the same command.
#   recipes/smollm2_head_stage2.sh [N_CONVERSATIONS] [OUT] [EPOCHS] [STAGE1]
set -euo pipefail
N=${1:-4608}
OUT=${2:-out/smollm2_head2}
EPOCHS=${3:-3}
STAGE1=${4:-out/smollm2_head}
mkdir -p "$OUT/data"
for f in "$STAGE1"/data/regen-*.pt; do [ -e "$OUT/data/$(basename "$f")" ] || cp "$f" "$OUT/data/"; done
RESUME=""
[ -f "$OUT/checkpoint.pt" ] && RESUME="--resume"
exec .venv/bin/eagle3 train-draft --target smollm2-135m-instruct --data "sharegpt:$N" --out "$OUT" \
  --init-from "$STAGE1/head" --features offline --ttt-steps 4 \
  --dtype bfloat16 --max-seq-len 448 --max-prompt-len 256 --response-len 160 --regen-batch 24 \
  --batch 8 --draft-vocab 8192 --epochs "$EPOCHS" --lr 4e-4 --warmup 20 --autocast --threads 2 \
  --ckpt-every 20 $RESUME
