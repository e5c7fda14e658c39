"""An external backend is untrusted input (issue #25): a hostile OpenAI-compatible server on loopback sends chunks
of the wrong shape, a huge error body, a stream that never ends or a line that never ends, and negative or huge
usage counts; each ends its request with a named error (an error event in a stream, a 500 `request_failed`
otherwise) or is billed our own count, flagged. Credentials in a backend's URL or key never show: not in its
`url`, its dead reason, /health or the spec's repr; its key comes from a file or an environment variable."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.fake_engine import FakeEngineClient
from tests.server_util import free_port, start_gateway
from tokenfactory.engine.client import AddRequest, RequestError
from tokenfactory.fleet.backend import REFUSED_SOURCE, HTTPBackend, redact_url
from tokenfactory.fleet.fleet import Fleet, Replica
from tokenfactory.fleet.launch import BackendSpec
from tokenfactory.types import ParameterError, SamplingParams

SECRET = "s3cr3t-pw"


def chunk(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def text_chunk(text: str, finish: str | None = None) -> bytes:
    return chunk({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


async def completions(request: Request) -> Response:
    mode = (await request.json())["model"]

    async def body():  # noqa: ANN202 - the stream's bytes
        if mode == "not-an-object":
            yield text_chunk("Hi")
            yield chunk([1, 2, 3])
        elif mode == "bad-index":
            yield chunk({"choices": [{"index": "zero", "text": "Hi"}]})
        elif mode == "forever":
            while True:
                yield b": keep-alive\n\n"
                await asyncio.sleep(0.01)
        elif mode == "endless-line":
            while True:
                yield b"data: " + b"x" * 4096
                await asyncio.sleep(0)
        else:  # a proper answer, with the usage the mode names
            yield text_chunk("Hello")
            yield text_chunk(" there", "stop")
            usage = {"negative": -5, "huge": 10**12, "ok": 2, "string": "2"}[mode]
            yield chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": usage}})
            yield b"data: [DONE]\n\n"

    if mode == "big-error":  # an error body that never ends: read whole, it would never be cut
        async def endless_error():  # noqa: ANN202 - the body's bytes
            while True:
                yield b"E" * (64 << 10)
                await asyncio.sleep(0)
        return StreamingResponse(endless_error(), status_code=500, media_type="text/plain")
    return StreamingResponse(body(), media_type="text/event-stream")


async def health(request: Request) -> Response:
    expected = "Basic " + base64.b64encode(f"user:{SECRET}".encode()).decode()
    if request.headers.get("authorization") not in (expected, f"Bearer {SECRET}"):
        return JSONResponse({"error": "unauthorized"}, status_code=401)
    return JSONResponse({"status": "ok"})


@pytest.fixture(scope="module")
def hostile() -> str:
    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health),
                            Route("/metrics", lambda r: PlainTextResponse("x" * (16 << 20)))])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def backend(url: str, mode: str, **options: object) -> HTTPBackend:
    fake = FakeEngineClient()
    return HTTPBackend("b0", url, mode, fake.info, fake.tokenizer, **options)


def run(b: HTTPBackend, max_tokens: int = 8) -> list:
    request = AddRequest("r1", [5, 6, 7], None, SamplingParams(max_tokens=max_tokens), time.monotonic(), "t", 1)

    async def go() -> list:
        return [out async for out in b.generate(request)]
    return asyncio.run(asyncio.wait_for(go(), 30))  # a backend read without bounds would hang here


@pytest.mark.parametrize(("mode", "options", "message"), [
    ("not-an-object", {}, "a JSON list, not an object"),
    ("bad-index", {}, "choice index 'zero'"),
    ("forever", {"max_stream_s": 0.5}, "within 0.5 s"),
    ("endless-line", {"max_line_bytes": 64 << 10}, "longer than 65536 bytes"),
    ("big-error", {}, "answered 500"),
])
def test_a_hostile_stream_ends_its_request_with_a_named_error(hostile: str, mode: str, options: dict,
                                                              message: str) -> None:
    started = time.monotonic()
    with pytest.raises(RequestError) as e:
        run(backend(hostile, mode, **options))
    assert message in str(e.value) and "b0" in str(e.value)
    assert len(str(e.value)) < 1000  # an error body is cut, and was never read whole
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(("mode", "billed", "source"), [("ok", 2, "backend"), ("negative", 3, REFUSED_SOURCE),
                                                        ("huge", 3, REFUSED_SOURCE), ("string", 3, REFUSED_SOURCE)])
def test_a_reported_count_outside_what_was_asked_is_refused_and_flagged(hostile: str, mode: str, billed: int,
                                                                        source: str) -> None:
    b = backend(hostile, mode)
    final = run(b, max_tokens=3)[-1]  # "Hello there" is 11 byte-tokens to the fake tokenizer; at most 3 asked
    assert final.num_completion_tokens == billed and final.tokens_source == source
    assert b.num_counts_refused == (source == REFUSED_SOURCE)


def test_through_the_gateway_a_malformed_backend_is_an_error_event_or_a_500_never_a_cut(hostile: str,
                                                                                       tmp_path: Path) -> None:
    fleet = Fleet("fake-tiny", [Replica("b0", backend(hostile, "not-an-object"), "backend")])
    gw = start_gateway(fleet, tmp_path / "data")
    try:
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
        assert "not an object" in r.json()["error"]["message"]
        with httpx.stream("POST", gw.url + "/v1/completions",
                          json={"prompt": "hi", "max_tokens": 4, "stream": True}) as s:
            events = [line for line in s.iter_lines() if line.startswith("data:")]
        error = json.loads(events[-1][5:])
        assert error["error"]["code"] == "request_failed" and "not an object" in error["error"]["message"]
    finally:
        gw.stop()


def test_credentials_are_sent_but_never_shown(hostile: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = hostile.rsplit(":", 1)[1]
    with_password = f"http://user:{SECRET}@127.0.0.1:{port}/v1"
    b = backend(with_password, "ok", poll_s=0.05)
    assert SECRET not in b.url and "user" not in b.url
    assert redact_url(with_password) == f"http://***@127.0.0.1:{port}/v1"
    b.start()  # /health answers 200 only with the credentials: it stays alive
    time.sleep(0.4)
    assert b.is_alive
    b.shutdown()
    dead_port = free_port()
    dead = backend(f"http://user:{SECRET}@127.0.0.1:{dead_port}", "ok", poll_s=0.02)
    gw = start_gateway(Fleet("fake-tiny", [Replica("b0", dead, "backend")], check_interval_s=0.05), tmp_path / "d")
    try:
        deadline = time.monotonic() + 10
        while dead.is_alive:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        health = httpx.get(gw.url + "/health").text
        assert "failed 3 health checks" in health and SECRET not in health and "user:" not in health
        assert SECRET not in httpx.get(gw.url + "/fleet/replicas").text
    finally:
        gw.stop()
    key_file = tmp_path / "backend.key"
    key_file.write_text(SECRET + "\n")
    key_file.chmod(0o600)
    spec = BackendSpec.parse(f"{hostile},model=ok,key_file={key_file}")
    assert spec.api_key == SECRET and SECRET not in repr(spec)
    monkeypatch.setenv("BACKEND_KEY", SECRET)
    assert BackendSpec.parse(f"{hostile},key_env=BACKEND_KEY").api_key == SECRET
    spec = BackendSpec.parse(f"http://user:{SECRET}@127.0.0.1:{port}")
    assert spec.basic_auth == ("user", SECRET) and SECRET not in spec.url + repr(spec)
    for bad in (f"{hostile},key_env=NOT_SET_ANYWHERE", f"{hostile},key_file={tmp_path / 'missing'}",
                f"{hostile},key=a,key_env=BACKEND_KEY"):
        with pytest.raises(ParameterError):
            BackendSpec.parse(bad)
    keyed = backend(hostile, "ok", api_key=BackendSpec.parse(f"{hostile},key_env=BACKEND_KEY").api_key, poll_s=0.05)
    keyed.start()
    time.sleep(0.4)
    assert keyed.is_alive  # the bearer key reached /health
    keyed.shutdown()


def test_a_constraint_goes_to_a_backend_as_vllms_fields() -> None:
    """A backend engine enforces the grammar itself: our GrammarSpec becomes vLLM's (and SGLang's) guided_* fields."""
    from tokenfactory.fleet.backend import completion_body
    from tokenfactory.types import GrammarSpec

    def body(spec: GrammarSpec) -> dict:
        return completion_body("m", AddRequest("r", [1, 2], None, SamplingParams(grammar=spec), 0.0, "t", 1))

    assert body(GrammarSpec.json_schema({"type": "integer"}))["guided_json"] == {"type": "integer"}
    assert body(GrammarSpec.json_object())["guided_json"] == {"type": "object"}
    assert body(GrammarSpec.regex("a+"))["guided_regex"] == "a+"
    assert body(GrammarSpec.choice(["x", "y"]))["guided_choice"] == ["x", "y"]
    assert body(GrammarSpec.grammar('start: "a"'))["guided_grammar"] == 'start: "a"'
    assert not any(k.startswith("guided_") for k in completion_body(
        "m", AddRequest("r", [1], None, SamplingParams(), 0.0, "t", 1)))
