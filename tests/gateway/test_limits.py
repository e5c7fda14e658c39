"""Limits in-process: the settings, the flags, the body deadline middleware, the banner's database URL.

The raw-socket behaviour against a real server is in test_limits_server.py; here the pieces alone, fast.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenfactory.cli import build_parser
from tokenfactory.gateway.limits import BodyDeadline, LimitedH11Protocol, LimitSettings, wrap_app
from tokenfactory.serve.flags import limit_settings_from_args
from tokenfactory.serve.wiring import display_url

Message = dict


def test_display_url_hides_the_password() -> None:
    shown = display_url("postgresql+psycopg://alice:s3cr%40t@db.internal:5432/ledger")
    assert shown == "postgresql+psycopg://alice:***@db.internal:5432/ledger"
    assert "s3cr" not in shown
    assert display_url("postgresql://bob@db/ledger") == "postgresql://bob@db/ledger"
    assert display_url("sqlite:////var/lib/tokenfactory/ledger.db") == "sqlite:////var/lib/tokenfactory/ledger.db"


@pytest.mark.parametrize("url", ["postgresql://u:hunter2@host:notaport/db", "pg sql://u:hunter2@h/db"])
def test_display_url_hides_a_password_sqlalchemy_cannot_parse(url: str) -> None:
    assert "hunter2" not in display_url(url) and "u:***@" in display_url(url)


def test_flags_become_settings_with_documented_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    assert limit_settings_from_args(args) == LimitSettings()
    args = build_parser().parse_args(["serve", "--limit-concurrency", "0", "--header-timeout", "2.5",
                                      "--max-header-bytes", "8KiB", "--timeout-keep-alive", "1"])
    s = limit_settings_from_args(args)
    assert s.limit_concurrency is None and s.header_timeout_s == 2.5 and s.max_header_bytes == 8192
    kwargs = s.uvicorn_kwargs()
    assert issubclass(kwargs["http"], LimitedH11Protocol) and kwargs["http"].settings is s
    assert kwargs["h11_max_incomplete_event_size"] == 8192 and kwargs["timeout_keep_alive"] == 1
    assert "no connection limit; head 2.5 s and 8192 bytes" in s.describe()


@pytest.mark.parametrize("field", ["header_timeout_s", "body_timeout_s", "timeout_keep_alive_s"])
def test_settings_refuse_non_positive_timeouts(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be > 0"):
        LimitSettings(**{field: 0})


def test_settings_refuse_a_tiny_header_cap_and_a_zero_limit() -> None:
    with pytest.raises(ValueError, match="max_header_bytes"):
        LimitSettings(max_header_bytes=100)
    with pytest.raises(ValueError, match="limit_concurrency"):
        LimitSettings(limit_concurrency=0)


def run_app(app_receives: int, incoming: list[Message | None], timeout_s: float,
            app_fails: bool = False) -> tuple[list[Message], list[Message]]:
    """Drive BodyDeadline around an app that calls receive `app_receives` times then answers 200.

    `incoming` is what the server's receive yields; None means: never (the client stalls).
    Returns (what the app received, what reached the client)."""
    got: list[Message] = []
    sent: list[Message] = []

    async def receive() -> Message:
        message = incoming.pop(0)
        if message is None:
            await asyncio.Event().wait()  # a stalled client: only the deadline ends this
        return message

    async def send(message: Message) -> None:
        sent.append(message)

    async def app(scope: dict, receive_: object, send_: object) -> None:
        for _ in range(app_receives):
            got.append(await receive_())  # type: ignore[operator]
        if app_fails and got[-1]["type"] == "http.disconnect":
            raise RuntimeError("the app's reaction to a vanished client")
        await send_({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send_({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    asyncio.run(BodyDeadline(app, timeout_s)({"type": "http"}, receive, send))
    return got, sent


def test_a_stalled_body_gets_408_and_the_app_sees_a_disconnect() -> None:
    got, sent = run_app(2, [{"type": "http.request", "body": b"{", "more_body": True}, None], timeout_s=0.05,
                        app_fails=True)
    assert got[1] == {"type": "http.disconnect"}
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]  # the app's 200 dropped
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert "within 0.05 s" in error["message"] and error["param"] is None


def test_no_deadline_once_the_body_is_complete() -> None:
    """After the body, receive waits for a disconnect (streaming handlers): that must not become a 408."""
    async def scenario() -> list[Message]:
        sent: list[Message] = []
        late = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.2, late.set_result, {"type": "http.disconnect"})
        messages = iter([{"type": "http.request", "body": b"{}", "more_body": False}])

        async def receive() -> Message:
            return next(messages, None) or await late

        async def send(message: Message) -> None:
            sent.append(message)

        async def app(scope: dict, receive_: object, send_: object) -> None:
            await receive_()  # type: ignore[operator]
            assert (await receive_())["type"] == "http.disconnect"  # type: ignore[operator]
            await send_({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]

        await BodyDeadline(app, 0.05)({"type": "http"}, receive, send)
        return sent

    sent = asyncio.run(scenario())
    assert [m.get("status") for m in sent] == [200]


def test_an_app_error_without_a_timeout_still_propagates() -> None:
    with pytest.raises(RuntimeError):
        run_app(1, [{"type": "http.disconnect"}], timeout_s=5, app_fails=True)


def test_wrap_app_passes_lifespan_through() -> None:
    seen: list[str] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        seen.append(scope["type"])

    async def never() -> Message:
        raise AssertionError("lifespan must not be wrapped")

    asyncio.run(wrap_app(app, LimitSettings())({"type": "lifespan"}, never, never))  # type: ignore[arg-type]
    assert seen == ["lifespan"]
