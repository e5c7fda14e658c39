#!/usr/bin/env bash
# The checkpoints of tests/models/test_hf_quant_tools.py, written by the field's tools (not committed: made here).
#
#   scripts/quant_fixtures.sh [OUT] [--all]     (make quant-fixtures; OUT defaults to .quant-fixtures)
#
# Each tool gets its own virtualenv under OUT, because each pins a transformers of its own (llm-compressor
# 0.14: <= 5.17; GPTQModel 6.0.3: 5.4, with kernels 0.12) and GPTQModel's newest release wants a CUDA torch 2.14:
# both take the CPU torch 2.13.0 first. By default only the small random Llama's recipes run (minutes); --all
# adds the bundled SmolLM2's (the greedy-agreement and serving tests; ~an hour of CPU for GPTQModel's and AWQ's).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.quant-fixtures}
ALL=${2:-}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
[ -f "$OUT/smollm2-hf/config.json" ] || "$PY" -m tokenfactory.models.hf_export "$OUT/smollm2-hf"

make_venv() {  # $1: folder, then pip requirements
    local venv=$1; shift
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q --upgrade pip
        "$venv/bin/pip" install -q torch==2.13.0
    fi
    "$venv/bin/pip" install -q "$@"
}

TINY_LLMC="ct-gptq-w4a16-g64 ct-gptq-w4a16-asym-channel ct-gptq-w8a16-channel ct-awq-w4a16-asym-g32"
TINY_GPTQMODEL="gptq-4b-g32-actorder-asym gptq-4b-g128-sym gptq-4b-channel-sym gptq-8b-g64-actorder-sym gptq-8b-g32-asym awq-gemm-4b-g64"
SMOLLM2_LLMC="smollm2-ct-gptq-w4a16-g32 smollm2-ct-awq-w4a16-asym-g32"
SMOLLM2_GPTQMODEL="smollm2-gptq-4b-g32-actorder smollm2-awq-gemm-4b-g32"
[ "$ALL" = "--all" ] || { SMOLLM2_LLMC=""; SMOLLM2_GPTQMODEL=""; }

make_venv "$OUT/venv-llmcompressor" "llmcompressor==0.14.0.1"
"$OUT/venv-llmcompressor/bin/python" scripts/quant_checkpoints.py --tool llmcompressor --base "$OUT/smollm2-hf" \
    --out "$OUT" --only $TINY_LLMC $SMOLLM2_LLMC

# GPTQModel 6.0.3 builds from source against the torch already there (no CUDA extensions on a CPU machine).
make_venv "$OUT/venv-gptqmodel" setuptools wheel PyPcre "transformers==5.4.0" "kernels==0.12.2"
BUILD_CUDA_EXT=0 "$OUT/venv-gptqmodel/bin/pip" install -q --no-build-isolation "gptqmodel==6.0.3" \
    "transformers==5.4.0" "kernels==0.12.2"
"$OUT/venv-gptqmodel/bin/python" scripts/quant_checkpoints.py --tool gptqmodel --base "$OUT/smollm2-hf" \
    --out "$OUT" --only $TINY_GPTQMODEL $SMOLLM2_GPTQMODEL
touch "$OUT/.made"
