#!/usr/bin/env bash
# tau against training data: the default recipe on 25% and 50% of its conversations, reusing the
# full run's regenerated chunks (a prefix of the same seeded order). Resumable like the recipe.
#   recipes/smollm2_head_fractions.sh [FULL_RUN] [N...]
set -euo pipefail
FULL=${1:-out/smollm2_head}
shift || true
for N in "${@:-768 1536}"; do
  for n in $N; do
    OUT="${FULL}_$n"
    mkdir -p "$OUT/data"
    for ((c = 0; c < n / 256; c++)); do
      f=$(printf "regen-%05d.pt" "$c")
      [ -f "$OUT/data/$f" ] || cp "$FULL/data/$f" "$OUT/data/$f"
    done
    recipes/smollm2_head.sh "$n" "$OUT"
  done
done
