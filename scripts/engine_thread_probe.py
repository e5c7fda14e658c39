"""Why the server builds its engine on the engine thread: single-stream decode of the bundled model, stepped
on the thread that built it, and stepped on another thread after the building thread ran parallel regions
(libgomp's second team stalls against the first). Writes JSON.

    python scripts/engine_thread_probe.py --out results/engine-thread-probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.models.loader import load_model
from tokenfactory.types import SamplingParams

PARAMS = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
PROMPT = [1 + (i * 7) % 1000 for i in range(130)]


def decode(engine: LLMEngine, steps: list[float]) -> dict[str, float]:
    for _ in range(2):  # the second run is measured
        steps.clear()
        start = time.monotonic()
        rid = engine.add_request(PROMPT, PARAMS)
        engine.run_to_completion([rid])
        elapsed = time.monotonic() - start
    return {"tok_s": round(PARAMS.max_tokens / elapsed, 1), "median_step_ms": round(statistics.median(steps) * 1e3, 2)}


def build(loaded: object, steps: list[float]) -> LLMEngine:
    engine = LLMEngine(EngineConfig(kv_cache_memory=256 << 20, max_model_len=2048), loaded,  # type: ignore[arg-type]
                       step_listeners=[lambda s: steps.append(s.duration_s)])
    engine.warmup()
    return engine


def on_thread(fn: object) -> dict[str, float]:
    out: list[dict[str, float]] = []
    t = threading.Thread(target=lambda: out.append(fn()))  # type: ignore[operator]
    t.start()
    t.join()
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    loaded = load_model(None)
    steps: list[float] = []
    # Order matters: the first case must run before the main thread has run any parallel region.
    same = on_thread(lambda: decode(build(loaded, steps), steps))
    built_in_main = build(loaded, steps)
    other = on_thread(lambda: decode(built_in_main, steps))
    result = {"threads": torch.get_num_threads(), "torch": torch.__version__,
              "built_and_stepped_on_one_thread": same, "built_in_main_stepped_on_another": other}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
