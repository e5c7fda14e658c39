"""The plain load generator (bench/plain.py) against a small real HTTP server on loopback that streams
completions as OpenAI-compatible servers do, usage in the last chunk."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tokenfactory.bench import plain


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    bodies: list[dict] = []

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._send(200, json.dumps({"data": [{"id": "tiny"}]}).encode(), "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.bodies.append(body)
        if body["prompt"] == "fail":
            self._send(400, b'{"error": "no"}', "application/json")
            return
        n = body["max_tokens"]
        chunks = [{"choices": [{"text": "x", "index": 0}]} for _ in range(n)]
        chunks.append({"choices": [], "usage": {"completion_tokens": n}})
        stream = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        self._send(200, stream, "text/event-stream")

    def _send(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Handler.bodies = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_closed_loop_counts_the_servers_usage(server) -> None:
    assert plain.served_model(server) == "tiny"
    run = plain.closed_loop(server, "tiny", ["a", "b", "fail", "c"], 7, clients=2)
    assert run["completed"] == 3 and run["output_tokens"] == 21 and run["errors"] == ["RuntimeError: HTTP 400: "
                                                                                        "b'{\"error\": \"no\"}'"]
    elapsed = run["elapsed_s"]  # rounded to the millisecond: the throughput was computed before rounding
    assert 21 / (elapsed + 0.0005) - 0.01 <= run["output_throughput"] <= 21 / max(elapsed - 0.0005, 1e-9) + 0.01
    assert {b["prompt"] for b in Handler.bodies} == {"a", "b", "fail", "c"}
    assert all(b["stream"] and b["ignore_eos"] and b["stream_options"] == {"include_usage": True}
               for b in Handler.bodies)


def test_harness_check_is_within_five_percent_or_not() -> None:
    assert plain.harness_check(97.0, [{"output_throughput": 100.0}])["met"]
    off = plain.harness_check(90.0, [{"output_throughput": 100.0}])
    assert off["ratio"] == 0.9 and not off["met"]
    assert not plain.harness_check(None, [{"output_throughput": 100.0}])["met"]
    assert not plain.harness_check(97.0, [{"output_throughput": 100.0}, {"output_throughput": None}])["met"]


def test_harness_check_takes_the_mean_of_the_plain_runs_around_it() -> None:
    # A host slowing steadily: 104 before the harness, 96 after; the harness's 100 in between is within 5% of their
    # mean, where against the run after alone it was 1.04 and against the one before 0.96.
    check = plain.harness_check(100.0, [{"output_throughput": 104.0}, {"output_throughput": 96.0}])
    assert check["plain_tok_s"] == 100.0 and check["ratio"] == 1.0 and check["met"]
    assert check["plain_tok_s_each"] == [104.0, 96.0] and len(check["plain"]) == 2
    off = plain.harness_check(90.0, [{"output_throughput": 104.0}, {"output_throughput": 96.0}])
    assert off["ratio"] == 0.9 and not off["met"]
