#!/usr/bin/env bash
# The checkpoints of tests/models/test_hf_quant_tools.py, written by the field's tools (not committed: made here).
#
#   scripts/quant_fixtures.sh [OUT] [--all]     (make quant-fixtures [ALL=1]; OUT defaults to .quant-fixtures)
#
# Each tool gets its own virtualenv under OUT, because each pins a transformers of its own (llm-compressor
# 0.14: <= 5.17; GPTQModel 6.0.3: 5.4, with kernels 0.12) and GPTQModel's newest release wants a CUDA torch 2.14:
# both take the CPU torch 2.13.0 first. By default (CI's budget): every recipe on the small random Llama, and
# GPTQModel's act-order GPTQ of the bundled SmolLM2's float copy (the greedy-agreement, codes and serving tests;
# ~4 min; llm-compressor's GPTQ of it took ~9 min on a fresh 2-core machine, so it is --all's), calibrated as
# little as a loader test needs (see Settings in scripts/quant_checkpoints.py): llm-compressor in batches of 16,
# AWQ on 16 samples and llm-compressor's AWQ on 5 grid points. --all adds SmolLM2's other recipes and calibrates
# as the tools do by default (64 samples one at a time, 20 grid points: ~an hour of CPU for llm-compressor's
# AWQ on SmolLM2). A folder already holding its reference.pt is kept.
#
# Nothing outside the checkout is read or written but pip's own cache: the tools run with HOME under OUT, so
# GPTQModel's compiled CPU packing kernel (~/.cache/gptqmodel) is built here, as on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.quant-fixtures}
ALL=${2:-}
PY=${PY:-.venv/bin/python}
QUICK=(--batch-size 16 --awq-samples 16 --awq-grid 5)
LLMC="ct-gptq-w4a16-g64 ct-gptq-w4a16-asym-channel ct-gptq-w8a16-channel ct-awq-w4a16-asym-g32"
GPTQMODEL="gptq-4b-g32-actorder-asym gptq-4b-g128-sym gptq-4b-channel-sym gptq-8b-g64-actorder-sym gptq-8b-g32-asym
    awq-gemm-4b-g64 smollm2-gptq-4b-g32-actorder"
if [ "$ALL" = "--all" ]; then
    QUICK=()
    LLMC="$LLMC smollm2-ct-gptq-w4a16-g32 smollm2-ct-awq-w4a16-asym-g32"
    GPTQMODEL="$GPTQMODEL smollm2-awq-gemm-4b-g32"
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$SECONDS
stage() { echo "quant-fixtures: $1 ($((SECONDS - START)) s)" >&2; }

[ -f "$OUT/smollm2-hf/config.json" ] || "$PY" -m tokenfactory.models.hf_export "$OUT/smollm2-hf"
stage "the bundled model's float copy"

make_venv() {  # $1: folder, then pip requirements
    local venv=$1; shift
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q --upgrade pip
        "$venv/bin/pip" install -q torch==2.13.0
    fi
    "$venv/bin/pip" install -q "$@"
}

# A home of its own, no hub, and no torch.compile: GPTQModel's torch kernel compiles its dequantization per layer
# (128 recompiles, then eager; minutes of inductor for SmolLM2's reference forward, cached in /tmp).
tool() {  # $1: venv, then quant_checkpoints.py's arguments
    local venv=$1; shift
    mkdir -p "$OUT/home"
    HOME="$OUT/home" XDG_CACHE_HOME="$OUT/home/.cache" HF_HUB_OFFLINE=1 TORCHDYNAMO_DISABLE=1 \
        "$venv/bin/python" scripts/quant_checkpoints.py --base "$OUT/smollm2-hf" --out "$OUT" "${QUICK[@]}" "$@"
}

make_venv "$OUT/venv-llmcompressor" "llmcompressor==0.14.0.1"
# tokenfactory itself too, as a user installs the calibrate extra: tests/quality/test_calibrate.py runs
# `tokenfactory quantize --method gptq|awq` with this venv's python.
"$OUT/venv-llmcompressor/bin/pip" install -q -e ".[calibrate]" "llmcompressor==0.14.0.1" \
    || echo "WARNING: tokenfactory did not install into $OUT/venv-llmcompressor; test_calibrate.py's runs skip" >&2
stage "llm-compressor's virtualenv"
tool "$OUT/venv-llmcompressor" --tool llmcompressor --only $LLMC
stage "llm-compressor's checkpoints"

# GPTQModel 6.0.3 builds from source against the torch already there (no CUDA extensions on a CPU machine). It
# imports requests (gptqmodel/utils/image.py) without declaring it.
make_venv "$OUT/venv-gptqmodel" setuptools wheel PyPcre requests "transformers==5.4.0" "kernels==0.12.2"
BUILD_CUDA_EXT=0 "$OUT/venv-gptqmodel/bin/pip" install -q --no-build-isolation "gptqmodel==6.0.3" \
    "transformers==5.4.0" "kernels==0.12.2"
stage "GPTQModel's virtualenv"
tool "$OUT/venv-gptqmodel" --tool gptqmodel --only $GPTQMODEL
stage "GPTQModel's checkpoints"
touch "$OUT/.made"
