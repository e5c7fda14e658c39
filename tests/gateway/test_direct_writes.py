"""Direct stream writes (gateway/direct.py, engine/output_stream.py): a plain stream's token chunks written from
the engine's thread. The order rule of `OutputStream.offer`; the same bytes as the event loop's path, read by a
strict HTTP/1.1 parser over one kept-alive connection; a reader that stops reading or leaves is dropped, aborted
and billed as on the loop's path; streams that are not plain never go direct. The fake engine offers outputs as
`AsyncEngine` does; the real model's streams run through every streamed test of `tokenfactory serve`."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading

import h11
import pytest

from tests.fake_engine import FakeEngineClient
from tests.server_util import Gateway, raw_request, start_gateway, start_server, until
from tokenfactory.engine.output_stream import OutputStream
from tokenfactory.gateway.direct import DirectWriter
from tokenfactory.gateway.limits import LimitSettings
from tokenfactory.types import CompletionOutput, FinishReason, RequestOutput

MODEL = "fake-tiny"


def output(token: int, finished: bool = False) -> RequestOutput:
    reason = FinishReason.LENGTH if finished else None
    return RequestOutput("r", None, [1], [CompletionOutput(0, token_ids_delta=[token], finish_reason=reason)])


# -- the order rule -------------------------------------------------------------------------------------------


def test_an_output_goes_direct_only_while_its_reader_waits_with_nothing_on_the_way() -> None:
    async def main() -> None:
        taken: list[RequestOutput] = []
        stream = OutputStream(lambda out: taken.append(out) is None)
        assert not stream.offer(output(1))  # nobody waits yet: through the loop
        reader = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)  # the reader waits now, with nothing pending or in flight
        assert stream.offer(output(2)) and [o.outputs[0].token_ids_delta for o in taken] == [[2]]
        assert not stream.offer(output(3, finished=True))  # a final output always comes through the loop
        stream.posted()  # an output on its way through the loop: later ones must not overtake it
        assert not stream.offer(output(4))
        stream.put_posted(output(5))
        assert (await reader).outputs[0].token_ids_delta == [5]
        assert not stream.offer(output(6))  # the reader has not come back for more yet
        reader = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        assert stream.offer(output(7)) and stream.num_direct == 2
        stream.disarm()
        assert not stream.offer(output(8))
        reader.cancel()

    asyncio.run(main())


def test_a_failing_direct_consumer_sends_the_rest_through_the_loop() -> None:
    def broken(out: RequestOutput) -> bool:
        raise RuntimeError("boom")

    async def main() -> None:
        stream = OutputStream(broken)
        reader = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        assert not stream.offer(output(1)) and stream.direct is None
        stream.posted()
        stream.put_posted(output(1))
        assert (await reader).outputs[0].token_ids_delta == [1]

    asyncio.run(main())


def test_disarming_waits_for_a_direct_output_being_consumed() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(out: RequestOutput) -> bool:
        entered.set()
        release.wait(5)
        return True

    async def main() -> None:
        stream = OutputStream(slow)
        reader = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        offering = threading.Thread(target=stream.offer, args=(output(1),))
        offering.start()
        assert entered.wait(5)
        disarmed = threading.Event()
        threading.Thread(target=lambda: (stream.disarm(), disarmed.set())).start()
        assert not disarmed.wait(0.2)  # held until the write under way is done
        release.set()
        assert disarmed.wait(5)
        offering.join(5)
        reader.cancel()

    asyncio.run(main())


# -- over HTTP --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gw(tmp_path_factory) -> Gateway:
    # 5 ms steps: a reader (the loop's path included) keeps up, so outputs are not merged and chunks compare one
    # for one.
    g = start_gateway(FakeEngineClient(step_s=0.005), tmp_path_factory.mktemp("direct"))
    yield g
    g.stop()


@pytest.fixture(scope="module")
def gw_loop(tmp_path_factory) -> Gateway:
    g = start_gateway(FakeEngineClient(step_s=0.005), tmp_path_factory.mktemp("loop"), direct_stream_writes=False)
    yield g
    g.stop()


@pytest.fixture
def direct_writes(monkeypatch) -> list[int]:
    """How many chunks each direct writer wrote, as its stream ends."""
    counts: list[int] = []
    close = DirectWriter.close

    def counting_close(self: DirectWriter) -> None:
        if self._open:
            counts.append(self.num_written)
        close(self)

    monkeypatch.setattr(DirectWriter, "close", counting_close)
    return counts


def post(sock: socket.socket, conn: h11.Connection, path: str, body: dict) -> None:
    data = json.dumps(body).encode()
    sock.sendall(conn.send(h11.Request(method="POST", target=path, headers=[
        ("Host", "127.0.0.1"), ("Content-Type", "application/json"), ("Content-Length", str(len(data)))])))
    sock.sendall(conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))


def read_response(sock: socket.socket, conn: h11.Connection) -> tuple[int, bytes]:
    """One response through h11's strict parser (a chunk framed wrong fails here), then ready for the next."""
    status, body = 0, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(1 << 16))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            conn.start_next_cycle()
            return status, body


def normalized(body: bytes) -> str:
    """Without what differs between two runs of one request: its id, its time, its measured joules and cost."""
    body = re.sub(rb'"(chatcmpl|cmpl)-[0-9a-f]+"', b'"ID"', body)
    return re.sub(rb'"(created|\w*joules\w*|cost\w*)": ?[-+.\deE]+', rb'"\1": 0', body).decode()


REQUESTS = [("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 40, "ignore_eos": True,
                                 "stream": True, "stream_options": {"include_usage": True}}),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                                      "max_tokens": 30, "stream": True}),
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5}),
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 25, "stop": [" over"],
                                 "stream": True})]


def exchange(gateway: Gateway) -> list[tuple[int, str]]:
    """REQUESTS one after another on one kept-alive connection."""
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)
    conn = h11.Connection(h11.CLIENT)
    answers = []
    with sock:
        for path, body in REQUESTS:
            post(sock, conn, path, body)
            status, data = read_response(sock, conn)
            answers.append((status, normalized(data)))
    return answers


def test_direct_writes_send_the_loops_bytes_on_a_kept_alive_connection(gw, gw_loop, direct_writes) -> None:
    direct = exchange(gw)
    assert len(direct_writes) == 3 and all(n > 10 for n in direct_writes[:2]), direct_writes
    assert exchange(gw_loop) == direct
    assert [status for status, _ in direct] == [200] * 4
    events = [line[6:] for line in direct[0][1].split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 40 + 2  # a chunk a token, the usage chunk, [DONE]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 40
    assert all(json.loads(e)["usage"] is None for e in events[:-2])  # include_usage's nulls, as the loop sends


def test_streams_that_are_not_plain_never_go_direct(gw, direct_writes) -> None:
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=30)
    conn = h11.Connection(h11.CLIENT)
    with sock:
        for body in ({"n": 2}, {"prompt": ["a", "b"]}):
            post(sock, conn, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 20,
                                                 "stream": True, **body})
            status, data = read_response(sock, conn)
            assert status == 200 and data.endswith(b"data: [DONE]\n\n")
    assert direct_writes == [0, 0]


def test_a_direct_stream_whose_reader_leaves_is_aborted_and_billed(gw, direct_writes) -> None:
    engine = gw.engine
    num_aborted = engine.num_aborted
    sock = raw_request(gw.port, {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True,
                                "stream": True})
    sock.settimeout(30)
    received = b""
    while received.count(b"data: ") < 20:  # well into the direct writes
        received += sock.recv(1 << 16)
    engine.pause()  # it is surely still running when the client leaves
    request_id = re.search(rb'"id": "(cmpl-[0-9a-f]+)"', received).group(1).decode()
    sock.close()
    until(lambda: engine.num_aborted == num_aborted + 1, what="the abort")
    engine.resume()
    until(lambda: bool(gw.ledger_rows(request_id)), what="the aborted row")
    [row] = gw.ledger_rows(request_id)
    assert row["status"] == "aborted" and 20 <= row["completion_tokens"] < 200
    until(lambda: engine.stats().num_running == 0 and gw.metric("tokenfactory:kv_cache_usage_perc") == 0,
          what="the engine idle, its blocks freed")
    until(lambda: len(direct_writes) == 1, what="the stream's end")
    assert direct_writes[0] >= 18


def test_a_direct_stream_whose_reader_stops_reading_is_dropped_and_billed(tmp_path, direct_writes) -> None:
    """The socket fills: direct writes are declined, the loop's send waits and its deadline drops the client."""
    engine = FakeEngineClient(step_s=0.0005, max_model_len=32_768, num_kv_blocks=2_100)
    g = start_gateway(engine, tmp_path, limits=LimitSettings(send_buffer_bytes=4096), stream_send_timeout_s=1.0)
    try:
        sock = raw_request(g.port, {"model": MODEL, "prompt": "hi", "max_tokens": 30_000, "ignore_eos": True,
                                   "stream": True}, rcvbuf=4096)  # reads nothing from here on
        until(lambda: bool(g.ledger_rows()), timeout_s=30, what="the stalled stream dropped")
        [row] = g.ledger_rows()
        assert row["status"] == "aborted" and 0 < row["completion_tokens"] < 30_000
        assert 0 < direct_writes[0] < row["completion_tokens"]  # direct until the socket filled, then the loop
        until(lambda: g.engine.stats().num_running == 0 and g.metric("tokenfactory:kv_cache_usage_perc") == 0,
              what="the engine idle, its blocks freed")
        sock.close()
    finally:
        g.stop()


@pytest.mark.slow
def test_the_real_model_streams_the_same_text_directly_and_through_the_loop(tmp_path) -> None:
    """`tokenfactory serve` with and without --direct-stream-writes: the bundled model's greedy stream, the same."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Name three rivers."}],
            "max_tokens": 40, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    answers = []
    for flag in ("--direct-stream-writes", "--no-direct-stream-writes"):
        (folder := tmp_path / flag.strip("-")).mkdir()
        server = start_server(folder, flag)
        try:
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
            conn = h11.Connection(h11.CLIENT)
            with sock:
                for _ in range(2):  # twice on one connection
                    post(sock, conn, "/v1/chat/completions", body)
                    status, data = read_response(sock, conn)
                    assert status == 200
                    answers.append(normalized(data))
        finally:
            server.stop()
    # The same request twice on a connection, with and without direct writes (the second hits the prefix cache,
    # whose bf16 keys may turn greedy decoding elsewhere: each is compared with its own kind).
    assert answers[0] == answers[2] and answers[1] == answers[3]
    chunks = [json.loads(line[6:]) for line in answers[0].split("\n") if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 40 and len(chunks) == 40 + 2
