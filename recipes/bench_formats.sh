#!/usr/bin/env bash
# Issue 17's tables: the default (SmolLM2-135M-Instruct + models/default/head) in each weight
# format side by side, with llama.cpp on the same GGUF file (plain and EAGLE-3 with this head,
# converted by llama.cpp's converter), held-out ShareGPT prompts, batch 1, greedy, 2 threads.
# Needs `make llama.cpp` for the llama.cpp rows and recipes/vllm/setup.sh for the vLLM rows
# (each skipped with a note otherwise).
#   recipes/bench_formats.sh [LIMIT] [NEW_TOKENS] [REPEATS] [peers]   # peers: only the last run
set -euo pipefail
LIMIT=${1:-8}
NEW=${2:-64}
REPEATS=${3:-2}
mkdir -p docs/bench
if [ "${4:-}" != peers ]; then
# Eager: every format, stock PyTorch (none) included, and llama.cpp.
.venv/bin/eagle3 bench --prompts sharegpt-heldout --limit "$LIMIT" --max-new-tokens "$NEW" \
  --quantize fp32,none,bf16,int8,int4,gguf --num-draft-tokens auto,3 --tree none \
  --peers llama.cpp --repeats "$REPEATS" --threads 2 --json docs/bench/formats-eager.json \
  | tee docs/bench/formats-eager.md
# Compiled: the 4-bit format that keeps the GGUF's own codes (the llama.cpp comparison).
.venv/bin/eagle3 bench --prompts sharegpt-heldout --limit "$LIMIT" --max-new-tokens "$NEW" \
  --quantize gguf --compile --num-draft-tokens auto,2,3 --tree default --peers llama.cpp \
  --repeats "$REPEATS" --threads 2 --json docs/bench/formats-compiled.json \
  | tee docs/bench/formats-compiled.md
fi
# The default as a user gets it (`--quantize auto` = the GGUF's own codes, eager) against
# llama.cpp and vLLM in the same interleaved run: plain and EAGLE-3 with the same head.
.venv/bin/eagle3 bench --prompts sharegpt-heldout --limit "$LIMIT" --max-new-tokens "$NEW" \
  --num-draft-tokens auto,2,3 --tree default --peers llama.cpp,vllm --repeats "$REPEATS" \
  --threads 2 --json docs/bench/peers.json | tee docs/bench/peers.md
