"""Decode step time by batch size on the bundled model (issue 29): N streams of 128-token prompts decoding together,
the median of the engine's pure decode steps at each N, as `serve` builds the engine by default (its prepacked dense
path, the machine profile). `--decode-step eager` runs the Python forward instead of the compiled plan. Writes JSON.

    python scripts/decode_step_rows.py --rows 1,8,12,16,24,32 --out results/decode-step-rows.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from tokenfactory.config import EngineConfig, dense_path
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.tuning import cpu_identity
from tokenfactory.types import SamplingParams


def step_ms(engine: LLMEngine, rows: int, rng: random.Random, tokens: int = 48) -> float:
    """Median ms of the decode steps while all `rows` streams run (the prompts' steps and the last two left out)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    for _ in range(rows):
        engine.add_request([rng.randrange(100, 49000) for _ in range(128)], params)
    while engine.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    times = []
    while engine.has_unfinished_requests:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[:-2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,12,16,24,32", help="batch sizes, comma-separated")
    parser.add_argument("--decode-step", default="auto", choices=["auto", "eager"])
    parser.add_argument("--quantization-dense", default=dense_path("auto"), help="serve's default")
    parser.add_argument("--out", default="results/decode-step-rows.json")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(decode_step=args.decode_step, quantization_dense=args.quantization_dense))
    engine.warmup()
    rng = random.Random(1)
    rows = [int(r) for r in args.rows.split(",")]
    result = {"cpu": cpu_identity()[0], "python": platform.python_version(), "decode_step": args.decode_step,
              "quantization_dense": args.quantization_dense,
              "packed_step_rows": engine.runner.packed_rows(),
              "step_ms_by_rows": {str(r): round(step_ms(engine, r, rng), 3) for r in rows}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
