"""What per-token work on the server's event loop costs a single stream, by kind: the bundled model's async
engine (its own thread, as `serve` runs it) streamed to a coroutine on uvloop, with no HTTP, and the same with
a fixed amount of CPU spent on the loop after each token, either holding the GIL (pure Python, as the
gateway's per-token work is) or not (hashing a buffer, which releases it). Rounds interleave the three, in one
process. Writes JSON.

    python scripts/loop_work_probe.py --work-us 250 --out results/loop-work-probe.json

"none" is the engine's single stream with its outputs handed to an event loop; the served figure's gap to it
is what the HTTP path costs. "gil" against "nogil" says how much of a per-token cost the GIL adds to the CPU
itself: the share an event loop in another process than the engine's would save.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import time
from collections.abc import Callable

import uvloop

from tokenfactory.config import EngineConfig
from tokenfactory.engine.async_engine import AsyncEngine
from tokenfactory.engine.client import AddRequest
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.tuning import cpu_identity
from tokenfactory.models.loader import load_model
from tokenfactory.types import SamplingParams

PARAMS = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
BUFFER = bytes(1 << 20)


def holding_gil(us: float) -> None:
    """`us` of this thread's CPU in the interpreter."""
    end = time.thread_time() + us * 1e-6
    while time.thread_time() < end:
        pass


def hashing_rate() -> float:
    """Bytes sha256 hashes per microsecond of CPU here (it releases the GIL for buffers over 2 KiB)."""
    start = time.thread_time()
    for _ in range(8):
        hashlib.sha256(BUFFER).digest()
    return 8 * len(BUFFER) / ((time.thread_time() - start) * 1e6)


def releasing_gil(rate: float) -> Callable[[float], None]:
    def work(us: float) -> None:
        hashlib.sha256(memoryview(BUFFER)[:int(us * rate)]).digest()
    return work


async def tpot_ms(engine: AsyncEngine, index: int, work: Callable[[float], None] | None, us: float) -> float:
    """One 128-token stream's median gap between outputs, with `work` done on the loop after each."""
    prompt = [1 + (index * 131 + i * 7) % 1000 for i in range(130)]
    request = AddRequest(f"probe-{index}", prompt, None, PARAMS, time.time(), "probe", 0)
    times: list[float] = []
    async for _ in engine.generate(request):
        times.append(time.perf_counter())
        if work is not None:
            work(us)
    return 1e3 * statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


async def probe(engine: AsyncEngine, us: float, rounds: int) -> dict[str, list[float]]:
    kinds: dict[str, Callable[[float], None] | None] = {
        "none": None, "gil": holding_gil, "nogil": releasing_gil(hashing_rate())}
    await tpot_ms(engine, 0, None, 0.0)  # warm-up
    results: dict[str, list[float]] = {name: [] for name in kinds}
    for r in range(rounds):
        for i, (name, work) in enumerate(kinds.items()):
            results[name].append(round(await tpot_ms(engine, 1 + r * len(kinds) + i, work, us), 3))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-us", type=float, default=250.0, help="CPU spent on the loop after each token")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="results/loop-work-probe.json")
    args = parser.parse_args()
    engine = AsyncEngine.launch(lambda: LLMEngine(EngineConfig(max_model_len=2048), load_model(None)))
    try:
        results = uvloop.run(probe(engine, args.work_us, args.rounds))
    finally:
        engine.shutdown()
    medians = {name: round(statistics.median(v), 3) for name, v in results.items()}
    report = {"cpu": cpu_identity()[0], "python": platform.python_version(), "work_us": args.work_us,
              "tpot_ms": results, "tpot_p50_ms": medians,
              "added_ms": {k: round(medians[k] - medians["none"], 3) for k in ("gil", "nogil")}}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
