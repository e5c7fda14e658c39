"""Where a single stream's serving work could run on a 2-vCPU machine (issue 29): the bundled model's engine
stepped in a child process, each step's token sent over a pipe to a parent on uvloop that spends a fixed amount
of CPU a token (as a gateway in a process of its own would), against the engine's own steps. With `--pin`, the
engine's calling thread on CPU 0, its other threads and the parent on CPU 1 (the parent then runs while the
engine's OpenMP worker waits through the step's single-threaded Python). Writes JSON.

    python scripts/split_process_probe.py --work-us 0,250 --rounds 6 --out results/split-process-probe.json

The offline figure is the step loop alone in the child (median step of each 128-token stream); the others are the
median gap between the parent's arrivals, over the same streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import pickle
import platform
import statistics
import threading
import time
from typing import Any

PROMPT_TOKENS, OUTPUT_TOKENS = 128, 128


def engine_child(to_parent: int, from_parent: int, pin: bool) -> None:
    """Steps one stream per "G" from the parent, sending each step's last token; "O": one stream timed alone."""
    import random

    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.engine import LLMEngine
    from tokenfactory.types import SamplingParams

    engine = LLMEngine(EngineConfig())
    engine.warmup()
    if pin:  # this thread on CPU 0; the OpenMP team's other threads (started by the warm-up) on CPU 1
        me = threading.get_native_id()
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), {0} if int(tid) == me else {1})
    os.write(to_parent, b"R")
    rng = random.Random(1)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0)
    while (command := os.read(from_parent, 1)) in (b"G", b"O"):
        engine.add_request([rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)], params)
        steps = []
        while engine.has_unfinished_requests:
            start = time.perf_counter()
            outputs = engine.step()
            steps.append(time.perf_counter() - start)
            if command == b"G":
                message = pickle.dumps([(o.request_id, o.outputs[0].token_ids[-1:], o.finished) for o in outputs])
                os.write(to_parent, len(message).to_bytes(4, "little") + message)
        if command == b"O":
            message = pickle.dumps(1e3 * statistics.median(steps[1:]))
            os.write(to_parent, len(message).to_bytes(4, "little") + message)


def spend(us: float) -> None:
    end = time.thread_time() + us * 1e-6
    while time.thread_time() < end:
        pass


async def parent(from_child: int, to_child: int, work_us: list[float], rounds: int) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    buffer = bytearray()

    def readable() -> None:
        buffer.extend(os.read(from_child, 65536))
        while len(buffer) >= 4 and len(buffer) >= 4 + (n := int.from_bytes(buffer[:4], "little")):
            queue.put_nowait(pickle.loads(bytes(buffer[4:4 + n])))
            del buffer[:4 + n]

    loop.add_reader(from_child, readable)
    results: dict[str, list[float]] = {"offline": [], **{f"work_{w:g}us": [] for w in work_us}}
    for _ in range(rounds):
        os.write(to_child, b"O")
        results["offline"].append(round(await queue.get(), 3))
        for w in work_us:
            os.write(to_child, b"G")
            arrivals = []
            while True:
                outputs = await queue.get()
                arrivals.append(time.perf_counter())
                spend(w)
                if outputs and outputs[0][2]:
                    break
            gaps = [b - a for a, b in zip(arrivals[1:], arrivals[2:], strict=False)]
            results[f"work_{w:g}us"].append(round(1e3 * statistics.median(gaps), 3))
    return results


def main() -> None:
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-us", default="0,250", help="CPU the parent spends a token, comma-separated")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--pin", action="store_true", help="engine thread on CPU 0, the rest on CPU 1")
    parser.add_argument("--out", default="results/split-process-probe.json")
    args = parser.parse_args()
    work = [float(w) for w in args.work_us.split(",")]
    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()
    child = multiprocessing.get_context("fork").Process(target=engine_child, args=(to_parent_w, to_child_r, args.pin),
                                                         daemon=True)
    child.start()
    if os.read(to_parent_r, 1) != b"R":
        raise SystemExit("the engine process did not start")
    if args.pin:
        os.sched_setaffinity(0, {1})
    try:
        results = uvloop.run(parent(to_parent_r, to_child_w, work, args.rounds))
    finally:
        os.write(to_child_w, b"Q")
        child.join(30)
    from tokenfactory.engine.tuning import cpu_identity  # after the fork: the parent imports no torch before it

    medians = {k: round(statistics.median(v), 3) for k, v in results.items()}
    report = {"cpu": cpu_identity()[0], "python": platform.python_version(), "pin": args.pin, "rounds": args.rounds,
              "step_or_tpot_ms": results, "median_ms": medians,
              "ratio_to_offline": {k: round(medians["offline"] / v, 3) for k, v in medians.items() if k != "offline"}}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
