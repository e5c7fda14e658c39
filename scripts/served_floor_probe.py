"""The floor of a served single stream (issue 29): the bundled model's engine stepped on this process's main
thread, each token's SSE chunk written by that thread straight to the client's socket (no event loop, no ASGI, no
request service), read by the benchmark harness's own client (bench/client.py: aiohttp on uvloop) in a child
process; against the same engine's offline single stream, rounds interleaved. Writes JSON.

    python scripts/served_floor_probe.py --rounds 10 --out results/served-floor-probe.json

What no server design can beat on this machine with this client: the gap between `offline_ms` and
`floor_tpot_ms` is the socket write and the client's own CPU on the same cores. `tokenfactory serve`'s direct
stream writes (gateway/direct.py) are this shape plus the request service's and the chunk's Python.

`--pairs`: the same floor as a server of its own process, measured as `bench machine` measures ours (bench/pairs.py:
an offline worker process, one request a round, the order alternating), then `tokenfactory serve` the same way,
and again, alternating: the floor and our server held against offline the same way, minutes apart.

    python scripts/served_floor_probe.py --pairs --rounds 8 --out results/served-floor-pairs.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from tokenfactory.gateway.direct import frame  # h11's chunk framing, as the server writes it

PROMPT_TOKENS, OUTPUT_TOKENS = 128, 128


def client(port: int, rounds: int) -> None:
    """The harness's client: `rounds` streamed requests, one at a time; their TPOTs as JSON on stdout."""
    from tokenfactory.bench.client import SamplingOptions, Target, run_async, send_request, stream_session
    from tokenfactory.bench.datasets import BenchRequest

    async def run() -> list[float]:
        tpots = []
        async with stream_session(600) as session:
            for i in range(rounds):
                request = BenchRequest(index=i, prompt="hello " * 120, prompt_len=PROMPT_TOKENS,
                                       output_len=OUTPUT_TOKENS)
                sample = await send_request(session, Target(f"http://127.0.0.1:{port}", "m"), request,
                                            SamplingOptions(ignore_eos=True), time.perf_counter())
                if sample.tpot_s is None:
                    raise RuntimeError(f"request {i} failed: {sample.error}")
                tpots.append(1e3 * sample.tpot_s)
        return tpots

    print(json.dumps(run_async(run())), flush=True)


def raw_client(port: int, rounds: int) -> None:
    """The lightest reader: a blocking socket, an arrival time per read that holds a token chunk, no parsing."""
    body = b'{"prompt": "hi"}'
    tpots = []
    for _ in range(rounds):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b"
                         % (len(body), body))
            times, data = [], b""
            while chunk_data := sock.recv(65536):
                if b'"text"' in chunk_data:
                    times.append(time.perf_counter())
                data = chunk_data
            assert data.endswith(b"0\r\n\r\n")
        tpots.append(1e3 * (times[-1] - times[0]) / (len(times) - 1))
    print(json.dumps(tpots), flush=True)


def read_request(conn: socket.socket) -> bytes:
    """One HTTP request's head (returned) and body (by its Content-Length, if any; discarded)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return head


def chunk(event: dict) -> bytes:
    return frame(b"data: " + orjson.dumps(event) + b"\n\n")


def serve_floor(port: int) -> None:
    """The floor as a server on `port`: each POST answered with a new random prompt's stream, as `main`'s rounds
    answer theirs (the body is read and ignored); a GET (the readiness check's /health) with 200."""
    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.engine import LLMEngine
    from tokenfactory.types import SamplingParams

    listener = socket.create_server(("127.0.0.1", port))
    engine = LLMEngine(EngineConfig())
    engine.warmup()
    rng = random.Random(1)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0)
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if read_request(conn).startswith(b"GET"):
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                continue
            stream_one(engine, conn, engine.add_request([rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)],
                                                        params))


def stream_one(engine: Any, conn: socket.socket, rid: str) -> None:
    """One request's stream, each token's chunk written by this (the engine's) thread."""
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                 b"connection: close\r\n\r\n")
    count = 0
    while engine.has_unfinished_requests:
        for out in engine.step():
            c = out.outputs[0]
            count += len(c.token_ids_delta)
            conn.sendall(chunk({"id": rid, "object": "text_completion", "created": 0, "model": "m",
                                "choices": [{"index": 0, "text": c.text_delta, "logprobs": None,
                                             "finish_reason": c.finish_reason}]}))
    conn.sendall(chunk({"id": rid, "choices": [], "usage": {"completion_tokens": count}})
                 + frame(b"data: [DONE]\n\n") + b"0\r\n\r\n")


def pairs_against(name: str, rounds: int, work: Path) -> dict[str, Any]:
    """The floor's server or `tokenfactory serve` (`name`), started afresh, in bench/pairs.py's pairs against the
    offline worker; the server's model as `bench machine` asks for it (the floor takes any)."""
    from tokenfactory.bench import pairs
    from tokenfactory.bench.compare import ServerProcess, free_port
    from tokenfactory.bench.datasets import DatasetConfig, build_dataset, load_tokenizer
    from tokenfactory.bench.plain import served_model

    port = free_port()
    command = ([sys.executable, __file__, "--floor-server", str(port)] if name == "floor" else
               [sys.executable, "-m", "tokenfactory.cli", "serve", "--port", str(port)])
    base_url = f"http://127.0.0.1:{port}"
    server = ServerProcess(name, command, work / f"{name}.log")
    try:
        if (why := server.wait_ready(base_url, 300)) is not None:
            raise RuntimeError(why)
        requests = build_dataset(DatasetConfig(num_prompts=rounds, input_len=130, output_len=OUTPUT_TOKENS,
                                               seed=7), load_tokenizer(None))
        model = "m" if name == "floor" else served_model(base_url)
        return pairs.measure(["--single-prompt-len", "130", "--single-output-len", str(OUTPUT_TOKENS)], base_url,
                             model, requests, work / f"{name}-worker.log")
    finally:
        server.stop()


def main_pairs(rounds: int, out: Path) -> None:
    """The floor's server and ours, each in pairs against offline, twice, alternating."""
    import tempfile

    from tokenfactory.engine.tuning import cpu_identity

    runs: dict[str, list[dict[str, Any]]] = {"floor": [], "serve": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(2):
            for name, results in runs.items():
                results.append(pairs_against(name, rounds, Path(tmp)))
    report = {"cpu": cpu_identity()[0], "python": platform.python_version(), "rounds": rounds,
              "command": "python scripts/served_floor_probe.py " + " ".join(sys.argv[1:]), "runs": runs,
              "ratios": {name: [r["ratio"] for r in results] for name, results in runs.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("cpu", "rounds", "ratios")}, indent=1))


def main() -> None:
    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.engine import LLMEngine
    from tokenfactory.engine.tuning import cpu_identity
    from tokenfactory.types import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reader", choices=["harness", "raw"], default="harness",
                        help="the harness's client, or a bare socket that parses nothing")
    parser.add_argument("--out", type=Path, default=Path("results/served-floor-probe.json"))
    parser.add_argument("--pairs", action="store_true",
                        help="the floor as a server and `tokenfactory serve`, each in bench machine's pairs")
    args = parser.parse_args()
    if args.pairs:
        main_pairs(args.rounds, args.out)
        return
    engine = LLMEngine(EngineConfig())
    engine.warmup()
    rng = random.Random(1)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0)
    listener = socket.create_server(("127.0.0.1", 0))
    reader = subprocess.Popen([sys.executable, __file__, f"--{args.reader}-client", str(listener.getsockname()[1]),
                               str(args.rounds)], stdout=subprocess.PIPE, text=True)
    offline = []
    for _ in range(args.rounds):
        engine.add_request([rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)], params)
        times = []
        while engine.has_unfinished_requests:
            engine.step()
            times.append(time.perf_counter())
        offline.append(1e3 * (times[-1] - times[0]) / (len(times) - 1))
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            read_request(conn)
            stream_one(engine, conn, engine.add_request([rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)],
                                                        params))
    floor = json.loads(reader.communicate()[0])
    report = {"cpu": cpu_identity()[0], "python": platform.python_version(), "rounds": args.rounds,
              "reader": args.reader,
              "command": "python scripts/served_floor_probe.py " + " ".join(sys.argv[1:]),
              "offline_ms": [round(x, 3) for x in offline], "floor_tpot_ms": [round(x, 3) for x in floor],
              "median_offline_ms": round(statistics.median(offline), 3),
              "median_floor_tpot_ms": round(statistics.median(floor), 3),
              "ratio": round(statistics.median(offline) / statistics.median(floor), 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("_ms")}, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--floor-server"]:
        serve_floor(int(sys.argv[2]))
    elif sys.argv[1:2] == ["--harness-client"]:
        client(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1:2] == ["--raw-client"]:
        raw_client(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
