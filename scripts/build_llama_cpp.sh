#!/usr/bin/env bash
# Build llama.cpp (the bench peer) from the sources vendored in llama-cpp-python's source
# distribution: nothing but that one PyPI download is fetched (-DGGML_NATIVE; see below). About 15 minutes on 2 cores;
# rerunning continues an interrupted build. Binaries land in build/llama.cpp/cmake/bin, where
# `eagle3 bench --peers llama.cpp` looks (or set EAGLE3_LLAMA_CPP to another bin directory).
#
#   scripts/build_llama_cpp.sh            # or: make llama.cpp
#   scripts/build_llama_cpp.sh --sources  # only download and unpack (for `eagle3 convert --to gguf`)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=build/llama.cpp
PIP=${PIP:-.venv/bin/pip}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$ROOT"
SDIST="$ROOT/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  "$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT"
fi
SRC="$ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  tar -xzf "$SDIST" -C "$ROOT"
fi
if [ "${1:-}" = "--sources" ]; then
  exit 0
fi
# GGML_NATIVE, except on AMX CPUs: this llama.cpp's AMX matmul (ggml_backend_amx_mul_mat)
# segfaults on any batch of more than one token here (a prompt, llama-bench pp2, every
# speculative verify). There the same ISA is named without AMX, so its AVX-512 kernels
# (weight repacking included) run instead.
ISA=(-DGGML_NATIVE=ON)
if grep -q amx_int8 /proc/cpuinfo 2>/dev/null; then
  has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
  ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
       -DGGML_AVX512=ON "-DGGML_AVX512_VBMI=$(has avx512_vbmi)" "-DGGML_AVX512_VNNI=$(has avx512_vnni)"
       "-DGGML_AVX512_BF16=$(has avx512_bf16)" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
       -DGGML_AMX_BF16=OFF)
fi
cmake -S "$SRC" -B "$ROOT/cmake" -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF \
  > "$ROOT/configure.log"
cmake --build "$ROOT/cmake" -j "$(nproc)" --target llama-bench llama-speculative-simple \
  llama-completion llama-cli llama-server llama-perplexity
ls "$ROOT/cmake/bin"
