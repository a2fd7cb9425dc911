#!/usr/bin/env bash
# The suffix-proposal measurements in docs/suffix.md beyond recipes/bench_default.sh: the engine at
# concurrency 1 and 8 on HumanEval and the rewrite set with the default proposer (hybrid) and the
# head alone (eagle), and the text alone with no head at all (--draft none --proposer suffix).
# The per-match-length table comes from recipes/suffix_gain.py.
#   recipes/bench_suffix.sh [LIMIT]
set -euo pipefail
LIMIT=${1:-10}
mkdir -p docs/bench
for SET in humaneval rewrite; do
  for P in hybrid eagle; do
    .venv/bin/eagle3 bench --concurrency 1,8 --prompts "$SET" --limit "$LIMIT" --max-new-tokens 64 \
      --repeats 2 --threads 2 --proposer "$P" --json "docs/bench/suffix-concurrency-$SET-$P.json" \
      | tee "docs/bench/suffix-concurrency-$SET-$P.md"
  done
done
.venv/bin/eagle3 bench --draft none --proposer suffix --prompts rewrite --limit "$LIMIT" --max-new-tokens 96 \
  --repeats 2 --threads 2 --peers none --json docs/bench/suffix-draft-none-rewrite.json \
  | tee docs/bench/suffix-draft-none-rewrite.md
