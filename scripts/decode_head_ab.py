"""The plain-decode path (issue 29: prepare's one-tensor inputs, then the LM head and the greedy tokens inside the
decode plan's region) against the general path the same steps took before (seven small tensors, the plan's hidden
states, then `compute_logits` and the sampler's `first_max` in PyTorch), in one process on the bundled model as served
by default. The two alternate every two steps of the same streams, so a host whose speed drifts moves both alike;
each step's time is compared with its neighbour's. Writes JSON.

    python scripts/decode_head_ab.py --rounds 6 --streams 1,4 --out results/decode-head-ab.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from typing import Any

import torch

from tokenfactory.config import EngineConfig
from tokenfactory.engine import model_runner
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.tuning import cpu_identity
from tokenfactory.types import SamplingParams


def paired_steps(engine: LLMEngine, streams: int, rounds: int, max_tokens: int) -> dict[str, Any]:
    """Step times (ms) of `streams` greedy streams of ~130-token prompts, the path switched every two steps."""
    plain = model_runner.is_plain_decode
    rng = random.Random(streams)
    times: dict[str, list[float]] = {"plain_path": [], "general_path": []}
    diffs: list[float] = []
    try:
        for rnd in range(rounds):
            for _ in range(streams):
                prompt = [rng.randrange(100, 49000) for _ in range(130)]
                engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
            engine.step()  # the prefill
            step, last = 0, {}
            while engine.has_unfinished_requests:
                on = (step // 2 + rnd) % 2 == 0
                model_runner.is_plain_decode = plain if on else (lambda _: False)
                start = time.perf_counter()
                engine.step()
                ms = (time.perf_counter() - start) * 1e3
                name = "plain_path" if on else "general_path"
                times[name].append(ms)
                last[name] = ms
                if step % 4 == 3 and len(last) == 2:  # two of each: the later of each pair against the other's
                    diffs.append(last["general_path"] - last["plain_path"])
                step += 1
    finally:
        model_runner.is_plain_decode = plain
    p50 = {k: round(statistics.median(v), 3) for k, v in times.items()}
    return {"streams": streams, "steps": {k: len(v) for k, v in times.items()}, "step_ms_p50": p50,
            "saved_ms_p50_paired": round(statistics.median(diffs), 3), "pairs": len(diffs),
            "decode_tok_s": {k: round(1e3 * streams / v, 1) for k, v in p50.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--streams", default="1,4")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="results/decode-head-ab.json")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig())
    engine.warmup()
    head_rows = getattr(engine.runner.decode_step, "head_rows", 0)
    rows = [paired_steps(engine, int(s), args.rounds, args.max_tokens) for s in args.streams.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"cpu": cpu_identity()[0], "threads": torch.get_num_threads(), "python": platform.python_version(),
              "torch": torch.__version__, "commit": commit, "head_in_plan_up_to_rows": head_rows,
              "command": f"python scripts/decode_head_ab.py --rounds {args.rounds} --streams {args.streams} "
                         f"--max-tokens {args.max_tokens}", "by_streams": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
