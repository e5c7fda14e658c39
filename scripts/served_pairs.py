"""Served single stream, A/B in pairs inside one server (issue 29): one `tokenfactory serve` whose in-process engine
client changes its behaviour on alternate requests, one closed-loop client, each request's TPOT against its
neighbour's. On a shared VM whose speed drifts between server restarts by more than the effects looked for, pairs
in one server are what can tell a few percent apart. Writes JSON.

    python scripts/served_pairs.py --mode work --work-us 150 --num-prompts 50 --out results/served-pairs.json

Modes (B is the changed behaviour, on the server's even-numbered requests; A is the server as it is):
- `work`: the event loop spends `--work-us` more CPU on every output it receives (a busy wait in
  `OutputStream.put`): how much TPOT a microsecond of serving work costs.
- `wait`: after each step the engine thread waits (at most `--wait-ms`) until the event loop has run that step's
  outputs (two loop iterations), so the loop's work falls between steps rather than over the next one.
- `loop`: no direct writes (gateway/direct.py): every token's chunk goes through the event loop, as before them.
- `general`: decode steps take the general path (`model_runner.is_plain_decode` false: seven small input tensors,
  the embedding, final norm, LM head and greedy search outside the decode plan's region), as before stop 49.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def serve(mode: str, work_us: float, wait_ms: float, port: int, serve_args: list[str]) -> None:
    """The server, patched: requests counted as the engine thread takes them; even ones get mode B."""
    from tokenfactory.engine import async_engine, output_stream

    taken = {"n": 0}

    def is_b() -> bool:
        return taken["n"] % 2 == 0

    drain = async_engine.AsyncEngine._drain_inbox

    def counting_drain(self: async_engine.AsyncEngine, block: bool) -> bool:
        before = self.num_taken
        keep_going = drain(self, block)
        taken["n"] += self.num_taken - before
        return keep_going

    async_engine.AsyncEngine._drain_inbox = counting_drain  # type: ignore[method-assign]
    if mode == "loop":
        from tokenfactory.service.results import CompletionStream

        send_directly = CompletionStream.send_directly
        streams = {"n": 0}

        def alternate(self: CompletionStream, consumer: Any) -> bool:
            streams["n"] += 1  # one call per streamed request, as it is answered (one client): even ones are B
            return False if streams["n"] % 2 == 0 else send_directly(self, consumer)

        CompletionStream.send_directly = alternate  # type: ignore[method-assign]
    elif mode == "general":
        from tokenfactory.engine import model_runner

        plain = model_runner.is_plain_decode
        model_runner.is_plain_decode = lambda out: plain(out) and not is_b()
    elif mode == "work":
        put = output_stream.OutputStream.put

        def busy_put(self: output_stream.OutputStream, item: Any) -> None:
            if is_b():
                end = time.perf_counter() + work_us / 1e6
                while time.perf_counter() < end:
                    pass
            put(self, item)

        output_stream.OutputStream.put = busy_put  # type: ignore[method-assign]
    else:
        step = async_engine.AsyncEngine._step

        def waiting_step(self: async_engine.AsyncEngine) -> None:
            step(self)
            if is_b() and self.streams:
                loop = next(iter(self.streams.values()))[0]
                done = threading.Event()
                try:
                    loop.call_soon_threadsafe(lambda: loop.call_soon(done.set))
                except RuntimeError:
                    return
                done.wait(wait_ms / 1e3)

        async_engine.AsyncEngine._step = waiting_step  # type: ignore[method-assign]
    from tokenfactory.cli import main

    sys.argv = ["tokenfactory", "serve", "--port", str(port), *serve_args]
    main()


def drive(args: argparse.Namespace) -> dict[str, Any]:
    from tokenfactory.bench.compare import ServerProcess, free_port
    from tokenfactory.engine.tuning import cpu_identity

    port = free_port()
    server_cmd = [sys.executable, __file__, "--serve", "--mode", args.mode, "--work-us", str(args.work_us),
                  "--wait-ms", str(args.wait_ms), "--port", str(port)]
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess("tokenfactory", server_cmd, Path(tmp) / "serve.log")
        try:
            if (why := server.wait_ready(f"http://127.0.0.1:{port}", 300)) is not None:
                raise RuntimeError(why)
            bench_cmd = [sys.executable, "-m", "tokenfactory.cli", "bench", "serve", "--base-url",
                         f"http://127.0.0.1:{port}", "--num-prompts", str(args.num_prompts), "--input-len", "128",
                         "--output-len", "128", "--ignore-eos", "--concurrency", "1", "--warmup", "0",
                         "--no-progress", "--results-dir", tmp, "--save", "pairs"]
            subprocess.run(bench_cmd, check=True, capture_output=True)
            samples = json.loads((Path(tmp) / "pairs.json").read_text())["samples"]
        finally:
            server.stop()
    samples.sort(key=lambda s: s["start_s"])
    tpot_ms = [1e3 * s["tpot_s"] for s in samples]
    a = tpot_ms[0::2]  # the server's 1st, 3rd, ... request: odd, as it is
    b = tpot_ms[1::2]  # 2nd, 4th, ...: even, changed
    pairs = [y / x for x, y in zip(a, b, strict=False)]  # an odd count leaves one out
    return {"cpu": cpu_identity()[0], "python": platform.python_version(), "mode": args.mode,
            "work_us": args.work_us if args.mode == "work" else None,
            "wait_ms": args.wait_ms if args.mode == "wait" else None,
            "server_command": shlex.join(server_cmd), "client_command": shlex.join(["tokenfactory", *bench_cmd[3:]]),
            "tpot_ms": {"a_as_is": a, "b_changed": b},
            "median_tpot_ms": {"a_as_is": round(statistics.median(a), 3), "b_changed": round(statistics.median(b), 3)},
            "pairs": len(pairs), "median_b_over_a": round(statistics.median(pairs), 3),
            "pairs_b_faster": sum(p < 1 for p in pairs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["work", "wait", "loop", "general"], default="work")
    p.add_argument("--work-us", type=float, default=150.0)
    p.add_argument("--wait-ms", type=float, default=2.0)
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--out", type=Path)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.serve:
        serve(args.mode, args.work_us, args.wait_ms, args.port, rest)
        return
    result = drive(args)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "tpot_ms"}, indent=1))


if __name__ == "__main__":
    main()
