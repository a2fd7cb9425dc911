#!/usr/bin/env bash
# The benchmark tables in docs/default-model.md for the default (SmolLM2-135M-Instruct + models/default/head):
# held-out ShareGPT, HumanEval and the rewrite set, chain K and the default tree, each drafted by the
# head alone (eagle), by head + text (hybrid, the default) and by the text alone (suffix), greedy and
# temperature 0.7.
# The weights as a user gets them (`--quantize auto`: the GGUF's own Q4_1 / Q8_0 codes on the
# row-invariant kernels, eager); recipes/bench_formats.sh measures every format side by side.
#   recipes/bench_default.sh [LIMIT] [NEW_TOKENS] [REPEATS]
set -euo pipefail
LIMIT=${1:-10}
NEW=${2:-96}
REPEATS=${3:-2}
mkdir -p docs/bench
for SET in sharegpt-heldout humaneval rewrite; do
  .venv/bin/eagle3 bench --prompts "$SET" --limit "$LIMIT" --max-new-tokens "$NEW" \
    --num-draft-tokens auto,2,3,4 --tree default --temperature 0.7 --peers none \
    --proposer eagle,hybrid,suffix \
    --repeats "$REPEATS" --threads 2 --json "docs/bench/default-$SET.json" \
    --plots "docs/bench/default-$SET" | tee "docs/bench/default-$SET.md"
done
# The serving table: the engine at concurrency 1, 4, 8 (speculation off vs on, and generate), with
# the default proposer (hybrid) and with the head alone.
.venv/bin/eagle3 bench --concurrency 1,4,8 --limit "$LIMIT" --max-new-tokens 64 --repeats 3 \
  --threads 2 --json docs/bench/default-concurrency.json | tee docs/bench/default-concurrency.md
.venv/bin/eagle3 bench --concurrency 1,4,8 --limit "$LIMIT" --max-new-tokens 64 --repeats 3 \
  --threads 2 --proposer eagle --json docs/bench/default-concurrency-eagle.json \
  | tee docs/bench/default-concurrency-eagle.md
