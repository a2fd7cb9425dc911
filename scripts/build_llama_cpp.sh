#!/usr/bin/env bash
# Build llama.cpp (the bench peer) from the sources vendored in llama-cpp-python's source
# distribution: nothing but that one PyPI download is fetched. About 15 minutes on 2 cores;
# rerunning continues an interrupted build. Binaries land in build/llama.cpp/bin, where
# `eagle3 bench --peers llama.cpp` looks (or set EAGLE3_LLAMA_CPP to another bin directory).
#
#   scripts/build_llama_cpp.sh            # or: make llama.cpp
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
cmake -S "$SRC" -B "$ROOT/cmake" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF \
  -DCMAKE_RUNTIME_OUTPUT_DIRECTORY="$PWD/$ROOT/bin" > "$ROOT/configure.log"
cmake --build "$ROOT/cmake" -j "$(nproc)" --target llama-bench llama-speculative-simple \
  llama-cli llama-server
ls "$ROOT/bin"
