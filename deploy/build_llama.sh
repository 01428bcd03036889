#!/usr/bin/env bash
# Build llama.cpp's server and RPC server (the `llamacpp` engine of the worker) into $1, and
# its quantizer (the tests make K-quant models with it, as llama.cpp's users do). Beside them,
# what the build runs, read from the source it was built from: architectures.txt (the names
# of src/llama-arch.cpp's LLM_ARCH_NAMES table) and tensor_types.txt (ggml/include/ggml.h's
# enum ggml_type); libs/models/engine_support.py declares the llamacpp engine's by them.
#
# The source comes from PyPI (llama-cpp-python's sdist vendors llama.cpp; LLAMA_SOURCE=FILE
# takes that sdist from a file instead); the build is cached
# under ~/.cache/tessera/llama.cpp/<version>, so a fresh clone on the same host reuses it.
# -march=native dies with SIGILL on some VMs (AMX advertised, not enabled): the CPU's own
# AVX-512/AVX2 flags are named instead (docs/getting-started.md).
set -euo pipefail

DEST=${1:?usage: build_llama.sh DEST}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PYTHON=${PYTHON:-python3}
CACHE=${TESSERA_CACHE:-$HOME/.cache/tessera}/llama.cpp/$VERSION
BINS=(llama-server ggml-rpc-server llama-quantize)
LISTS=(architectures.txt tensor_types.txt)

# $1: a llama.cpp source folder; $2: where the lists go. The "(unknown)" entry and the dummy
# ones (clip: "only used by llama-quantize") are no architecture a model runs as.
write_lists() {
  awk '/LLM_ARCH_NAMES = \{/ {f = 1; next} f && /^\};/ {exit} f && !/\/\/ dummy/' \
    "$1/src/llama-arch.cpp" |
    sed -n 's/.*{ *LLM_ARCH_[A-Z0-9_]*, *"\([^"(][^"]*\)".*/\1/p' >"$2/architectures.txt.tmp"
  sed -n 's/^ *GGML_TYPE_\([A-Z0-9_]*\) *= *[0-9]*,.*/\1/p' "$1/ggml/include/ggml.h" |
    { grep -vx COUNT || true; } >"$2/tensor_types.txt.tmp"
  for list in "${LISTS[@]}"; do  # a source whose tables moved: say so, declare nothing
    [ -s "$2/$list.tmp" ] || { echo "no names parsed for $list from $1" >&2; exit 1; }
    mv "$2/$list.tmp" "$2/$list"
  done
}

# The source into $work: the sdist's file LLAMA_SOURCE names (a host that cannot reach PyPI:
# copy the file over), or pip from a throwaway virtualenv (the build need not wait for the
# project's to install).
fetch_source() {
  if [ -n "${LLAMA_SOURCE:-}" ]; then
    [ -f "$LLAMA_SOURCE" ] || { echo "LLAMA_SOURCE=$LLAMA_SOURCE: no such file" >&2; exit 1; }
    cp "$LLAMA_SOURCE" "$work/llama_cpp_python-$VERSION.tar.gz"
    return
  fi
  "$PYTHON" -m venv "$work/venv"
  "$work/venv/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" \
    -d "$work" 2>&1 |
    grep -v -e "^WARNING: Location" || true
}

flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
for flag in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
  avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
  if grep -qw "${flag%%:*}" /proc/cpuinfo; then flags+=("-DGGML_${flag##*:}=ON"); fi
done
# With the CUDA toolkit (nvcc on the PATH, in $CUDA_HOME or /usr/local/cuda) and an NVIDIA
# driver that lists a GPU (nvidia-smi -L), the build is CUDA's, for this host's GPUs: the layers
# a placement gives a GPU device go to its VRAM, its RPC server serves from the GPU. A toolkit
# without a driver builds for the CPU (a CUDA binary does not start without the driver's
# libcuda), as does a host without the toolkit. LLAMA_BACKEND=cpu|cuda overrides. The stamp's
# third field says which (libs/cluster/engine_choice.py).
nvcc=${CUDACXX:-$(command -v nvcc || true)}
for home in "${CUDA_HOME:-}" /usr/local/cuda; do
  if [ -z "$nvcc" ] && [ -n "$home" ] && [ -x "$home/bin/nvcc" ]; then nvcc=$home/bin/nvcc; fi
done
gpu=$(nvidia-smi -L 2>/dev/null | head -1 || true)
backend=${LLAMA_BACKEND:-$([ -n "$nvcc" ] && [ -n "$gpu" ] && echo cuda || echo cpu)}
why="no CUDA toolkit (nvcc)"
[ -z "$nvcc" ] || why="the CUDA toolkit ($nvcc) but no NVIDIA driver listing a GPU"
[ -z "$nvcc" ] || [ -z "$gpu" ] || why="the CUDA toolkit ($nvcc) and $gpu"
[ -z "${LLAMA_BACKEND:-}" ] || why="LLAMA_BACKEND=$LLAMA_BACKEND"
if [ "$backend" = cuda ]; then
  [ -n "$nvcc" ] || { echo "LLAMA_BACKEND=cuda: no nvcc found (PATH, CUDA_HOME, /usr/local/cuda)" >&2; exit 1; }
  flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc")
  if [ -n "$gpu" ]; then flags+=(-DCMAKE_CUDA_ARCHITECTURES=native); fi
fi
if [ -n "${BUILD_LLAMA_SHOW:-}" ]; then  # what would be built, and nothing else
  echo "backend=$backend ($why) flags=${flags[*]}"
  exit 0
fi
key=$(echo "${flags[*]}" | md5sum | cut -c1-8)
out=$CACHE/$key

missing=0
for bin in "${BINS[@]}"; do [ -x "$out/bin/$bin" ] || missing=1; done
if [ "$missing" = 1 ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "building llama.cpp for $backend: $why (llama-cpp-python $VERSION's source; the CPU build ~4 min on 2 cores) into $out"
  fetch_source
  tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
  src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
  cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_RPC=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    "${flags[@]}" >"$work/configure.log" || { tail -30 "$work/configure.log"; exit 1; }
  cmake --build "$work/build" --target "${BINS[@]}" -j "$(nproc)" >"$work/build.log" ||
    { tail -30 "$work/build.log"; exit 1; }
  mkdir -p "$out/bin"
  for bin in "${BINS[@]}"; do install -m 0755 "$work/build/bin/$bin" "$out/bin/$bin"; done
  write_lists "$src" "$out"
elif [ ! -s "$out/architectures.txt" ] || [ ! -s "$out/tensor_types.txt" ]; then
  # A build cached before the lists were written: read them from its source, no rebuild.
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  fetch_source
  top="llama_cpp_python-$VERSION/vendor/llama.cpp"
  tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work" \
    "$top/src/llama-arch.cpp" "$top/ggml/include/ggml.h"
  write_lists "$work/$top" "$out"
  echo "llama.cpp's architectures and tensor types read from its source into $out"
fi
mkdir -p "$DEST"
for bin in "${BINS[@]}"; do ln -sf "$out/bin/$bin" "$DEST/$bin"; done
for list in "${LISTS[@]}"; do ln -sf "$out/$list" "$DEST/$list"; done
echo "$VERSION $key $backend" >"$DEST/.installed"
