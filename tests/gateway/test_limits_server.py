"""Connection limits against a real `tokenfactory serve`, with raw sockets on loopback (issue #13).

Slowloris (a head trickled a byte at a time), a trickled body, a body left unread, an oversized head and a
connection flood: each is cut off by the server on time, answered in OpenAI's error shape where an
answer is possible, while a normal client is served, and the server is healthy afterwards. Timeouts are
set short (3 s) so the file runs in seconds after the server's start.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server_util import Server, start_server

pytestmark = pytest.mark.slow

HEAD_S = 3.0  # --header-timeout
BODY_S = 3.0  # --body-timeout
LIMIT = 16  # --limit-concurrency
SLACK_S = 2.0  # how late after its deadline a close may come on a busy 2-core machine
TRICKLE_S = 0.25  # one byte per socket this often


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("limits"), "--header-timeout", str(HEAD_S), "--body-timeout",
                     str(BODY_S), "--limit-concurrency", str(LIMIT), "--max-header-bytes", "8KiB")
    yield s
    s.stop()
    assert "Traceback" not in s.log(), s.log()


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def trickle_until_closed(socks: list[socket.socket], start: float, give_up_s: float,
                         trickled: set[int] | None = None) -> dict[int, tuple[float, bytes]]:
    """Send one byte to each socket in `trickled` (default: all) every TRICKLE_S until the server closes
    every socket; returns, per socket index, when it closed (seconds after `start`) and what it answered."""
    trickled = set(range(len(socks))) if trickled is None else trickled
    received = {i: b"" for i in range(len(socks))}
    closed: dict[int, tuple[float, bytes]] = {}
    while len(closed) < len(socks) and time.monotonic() - start < give_up_s:
        for i in trickled - closed.keys():
            try:
                socks[i].send(b"X")
            except OSError:  # reset by the server: closed; the read below records it
                pass
        open_socks = [s for i, s in enumerate(socks) if i not in closed]
        readable, _, _ = select.select(open_socks, [], [], TRICKLE_S)
        for s in readable:
            i = socks.index(s)
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            received[i] += data
            if not data:
                closed[i] = (time.monotonic() - start, received[i])
    for s in socks:
        s.close()
    return closed


def error_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


def assert_healthy(server: Server) -> None:
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_slowloris_is_closed_after_the_header_timeout_while_a_normal_client_is_served(server: Server) -> None:
    socks = [connect(server) for _ in range(8)]
    silent = connect(server)  # opens and never sends a byte
    start = time.monotonic()
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")

    def normal() -> tuple[int, float]:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        return r.status_code, time.monotonic() - start

    with ThreadPoolExecutor(1) as pool:
        answered = pool.submit(normal)
        closed = trickle_until_closed([*socks, silent], start, HEAD_S * 4, trickled=set(range(len(socks))))
        status, answered_at = answered.result()
    assert status == 200
    assert len(closed) == len(socks) + 1, "a slowloris connection outlived the header timeout"
    first_close = min(t for t, _ in closed.values())
    assert answered_at < first_close, "the normal request was not answered during the attack"
    for i, (t, response) in closed.items():
        assert HEAD_S - 0.2 <= t <= HEAD_S + SLACK_S, (i, t)  # trickling did not push the deadline back
        if i < len(socks):
            code, error = error_of(response)
            assert code == 408 and error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
        else:
            assert response == b""  # nothing sent, nothing to answer
    assert_healthy(server)


def test_a_trickled_body_gets_408_in_openai_shape(server: Server) -> None:
    body = json.dumps({"prompt": "hi" + " " * 200, "max_tokens": 1}).encode()
    s = connect(server)
    start = time.monotonic()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10]))
    closed = trickle_until_closed([s], start, BODY_S * 4)  # one byte per 0.25 s: ~12 of the 200 left
    assert 0 in closed, "a trickled body outlived the body timeout"
    t, response = closed[0]
    assert BODY_S - 0.2 <= t <= BODY_S + SLACK_S
    code, error = error_of(response)
    assert code == 408 and error["code"] == "request_timeout"
    assert f"within {BODY_S:g} s" in error["message"]
    assert_healthy(server)


def test_a_body_nobody_reads_must_still_end_in_time(server: Server) -> None:
    """405 is sent without reading the body; without the protocol's deadline uvicorn drains it forever."""
    s = connect(server)
    start = time.monotonic()
    s.sendall(b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\nabc")
    closed = trickle_until_closed([s], start, HEAD_S + BODY_S * 3)
    assert 0 in closed
    t, response = closed[0]
    assert response.startswith(b"HTTP/1.1 405")
    assert t <= BODY_S + SLACK_S + TRICKLE_S * 4
    assert_healthy(server)


def test_a_head_over_the_size_cap_gets_431_and_garbage_400(server: Server) -> None:
    big, garbage = connect(server), connect(server)
    big.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (10 << 10) + b"\r\n\r\n")
    garbage.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    closed = trickle_until_closed([big, garbage], time.monotonic(), 10, trickled=set())
    code, error = error_of(closed[0][1])
    assert code == 431 and error["code"] == "request_header_fields_too_large" and "8192 bytes" in error["message"]
    code, error = error_of(closed[1][1])
    assert code == 400 and error["code"] == "invalid_http"
    assert_healthy(server)


def test_connections_beyond_the_limit_get_503_in_openai_shape(server: Server) -> None:
    idle = [connect(server) for _ in range(LIMIT)]
    try:
        deadline, r = time.monotonic() + HEAD_S / 2, None
        while time.monotonic() < deadline:  # until the server has accepted all of them
            r = httpx.get(server.url + "/health", timeout=5)
            if r.status_code == 503:
                break
        assert r is not None and r.status_code == 503, "the connection limit was not applied"
        assert r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"] == "1"
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)  # the server sees the closes on its next loop turn
    assert_healthy(server)


def test_the_banner_states_the_limits(server: Server) -> None:
    assert (f"limits  {LIMIT} connections; head {HEAD_S:g} s and 8192 bytes, body {BODY_S:g} s, keep-alive 5 s"
            in server.log())


def test_limit_flags_out_of_range_refuse_to_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="header_timeout_s must be > 0"):
        start_server(tmp_path, "--header-timeout", "0")
