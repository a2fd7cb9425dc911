#!/usr/bin/env bash
# Issue 17's table: the default as a user gets it (`--quantize auto` = the GGUF's own codes,
# eager) against llama.cpp and vLLM in the same interleaved run: plain and EAGLE-3 with the
# same head, held-out ShareGPT prompts, batch 1, greedy, 2 threads. llama.cpp rows need
# `make llama.cpp`, vLLM rows recipes/vllm/setup.sh (each skipped with a note otherwise).
#   recipes/bench_peers.sh [LIMIT] [NEW_TOKENS] [REPEATS]
set -euo pipefail
LIMIT=${1:-8}
NEW=${2:-64}
REPEATS=${3:-2}
mkdir -p docs/bench
.venv/bin/eagle3 bench --prompts sharegpt-heldout --limit "$LIMIT" --max-new-tokens "$NEW" \
  --num-draft-tokens auto,2,3 --tree default --peers llama.cpp,vllm --repeats "$REPEATS" \
  --threads 2 --json docs/bench/peers.json | tee docs/bench/peers.md
