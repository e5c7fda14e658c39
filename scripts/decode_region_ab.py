"""The decode plan's step in one parallel region against op by op (issue 29), on the bundled model as served by
default, in one process: the same bits (checked on a one-row and a three-row step), then the plan's time at one
row, rounds interleaved. Writes JSON.

    python scripts/decode_region_ab.py --rounds 5 --out results/decode-region-ab.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from typing import Any

import torch

from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.tuning import cpu_identity
from tokenfactory.models.llama import DecodePlan
from tokenfactory.types import SamplingParams


def captured_steps(engine: LLMEngine, plan: DecodePlan) -> dict[int, tuple[Any, ...]]:
    """Real decode steps' inputs, by rows: one stream, then three of different lengths."""
    steps: dict[int, tuple[Any, ...]] = {}
    call = type(plan).__call__

    def spy(self: DecodePlan, ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
        steps.setdefault(len(ids), (ids.clone(), pos.clone(), meta))
        return call(self, ids, pos, meta)

    type(plan).__call__ = spy  # type: ignore[method-assign]
    rng = random.Random(1)
    try:
        for streams in (1, 3):
            for _ in range(streams):
                prompt = [rng.randrange(100, 49000) for _ in range(rng.randrange(60, 300))]
                engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
            while engine.has_unfinished_requests:
                engine.step()
    finally:
        type(plan).__call__ = call  # type: ignore[method-assign]
    return steps


def median_ms(plan: DecodePlan, args: tuple[Any, ...], calls: int) -> float:
    times = []
    with torch.inference_mode():
        for _ in range(calls):
            start = time.perf_counter()
            plan(*args)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300, help="plan calls a round and path")
    parser.add_argument("--out", default="results/decode-region-ab.json")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(max_num_seqs=8, machine_profile="off"))
    engine.warmup()
    plan = engine.runner.decode_step
    assert isinstance(plan, DecodePlan) and plan.set_one_region(True), "the bundled model's plan takes one region"
    steps = captured_steps(engine, plan)
    same_bits = {}
    for rows, step in sorted(steps.items()):
        outs = []
        for on in (True, False):
            plan.set_one_region(on)
            with torch.inference_mode():
                outs.append(plan(*step).clone())
        same_bits[rows] = torch.equal(outs[0], outs[1])
    times: dict[str, list[float]] = {"op_by_op": [], "one_region": []}
    for _ in range(args.rounds):
        for name, on in (("op_by_op", False), ("one_region", True)):
            plan.set_one_region(on)
            times[name].append(round(median_ms(plan, steps[1], args.calls), 3))
    result = {"cpu": cpu_identity()[0], "threads": torch.get_num_threads(), "python": platform.python_version(),
              "torch": torch.__version__, "command": f"python scripts/decode_region_ab.py --rounds {args.rounds} "
              f"--calls {args.calls}", "same_bits_by_rows": same_bits, "plan_ms_p50_by_round": times,
              "plan_ms_p50": {k: round(statistics.median(v), 3) for k, v in times.items()}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
