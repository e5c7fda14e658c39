#!/usr/bin/env bash
# Every published figure in one command, on a quiet machine; JSON under results/.
#   bash scripts/bench_all.sh            (after `make install`)
set -euo pipefail
cd "$(dirname "$0")/.."
T=.venv/bin/tokenfactory
mkdir -p results

# 1. Engine: offline throughput (128 requests, prompts 32-512, outputs 32-256) and single-stream decode,
#    side by side with Hugging Face generate on the same weights.
$T bench offline --out results/bench-offline.json

# 2. Serving: ~130-token prompts, 128 output tokens, ignore_eos, streaming, at 1, 8 and 32 clients.
port=8100
$T serve --port $port --data-dir results/serve-ledger --log-level warning > results/serve.log 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
for spec in 1:8 8:32 32:96; do
  c=${spec%%:*}; n=${spec##*:}
  $T bench serve --base-url http://127.0.0.1:$port --num-prompts "$n" --input-len 130 --output-len 128 \
     --ignore-eos --concurrency "$c" --warmup 2 --no-progress --results-dir results --save "serve-c$c"
done
kill $pid; wait $pid 2>/dev/null || true
$T bench report serve-c1 serve-c8 serve-c32 --results-dir results --out results/report
