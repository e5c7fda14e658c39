"""One streamed request against an OpenAI-compatible endpoint, timed chunk by chunk, as `vllm bench serve` does.

    t_send ── ... ── first token chunk ── token chunk ── ... ── last token chunk ── usage chunk ── [DONE]
             └──── ttft ────┘      └ itl[0] ┘                                  │
             └─────────────────────────── e2e ───────────────────────────────┘

A *token chunk* is an SSE event whose first choice carries generated text, logprobs or a finish_reason
(a chat server's opening {"role": "assistant", "content": ""} carries none of them, so it does not end
TTFT). TTFT ends at the first token chunk, each ITL is the gap between consecutive token chunks, e2e
ends at the last one. Output tokens come from the final usage chunk (`stream_options.include_usage`);
a server that sends none has its text counted with the benchmark's tokenizer, as vllm does.

Failures are data: every request comes back as a RequestSample, with `error_kind` one of ERROR_KINDS
and a one-line `error` naming what went wrong (the server's own message when it sent one).

Streams are read with aiohttp (as vLLM's and SGLang's benchmarks read them), on uvloop where it is installed
(`run_async`): on a 2-core machine the load generator's CPU per token is taken from the server under test, and
httpx on asyncio cost ~370 us a streamed token where aiohttp on uvloop costs ~150 (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import httpx

from tokenfactory.bench.datasets import BenchRequest

# connect: nothing listens / DNS; auth: 401 or 403; http: any other non-200 status; stream: the
# stream broke, carried an error event or ended early; timeout; no_tokens: a 200 with no token at all.
ERROR_KINDS = ("connect", "auth", "http", "stream", "timeout", "no_tokens")
FATAL_ERROR_KINDS = frozenset({"connect", "auth"})  # the next request would fail the same way
USAGE_EXTRAS = ("energy_joules", "energy_source", "energy_scope", "cost_usd", "cost_device_usd", "cost_energy_usd")


@dataclass(frozen=True)
class Target:
    """Where requests go. `base_url` has no trailing /v1 (normalise_base_url strips it)."""

    base_url: str
    model: str
    endpoint: str = "completions"  # completions | chat
    api_key: str | None = None
    label: str = ""

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0
    top_p: float | None = None
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class RequestSample:
    """What one request did. Times are seconds; `start_s` is since the run began (time.perf_counter)."""

    index: int
    prompt_len: int  # the workload's count
    max_tokens: int
    start_s: float = 0.0
    success: bool = False
    error_kind: str | None = None
    error: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0  # token chunks received
    output_tokens: int | None = None
    output_tokens_source: str | None = None  # usage | tokenizer
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    usage_extra: dict[str, Any] = field(default_factory=dict)  # energy_joules, cost_usd, ... when present
    text: str = ""  # not saved: only for counting when usage is missing

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1): vllm's TPOT, defined for two or more output tokens."""
        if not self.success or self.output_tokens is None or self.output_tokens < 2:
            return None
        assert self.e2e_s is not None and self.ttft_s is not None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "text"}
        out["tpot_s"] = self.tpot_s
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestSample:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


def normalise_base_url(url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000'; a URL without a scheme gets http://."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    for suffix in ("/v1/chat/completions", "/v1/completions", "/v1"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


def payload(target: Target, request: BenchRequest, sampling: SamplingOptions) -> dict[str, Any]:
    body: dict[str, Any] = {"model": target.model, "max_tokens": request.output_len, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": sampling.temperature}
    if target.endpoint == "chat":
        messages = request.messages if request.messages is not None else ({"role": "user", "content": request.prompt},)
        body["messages"] = list(messages)
    else:
        if request.prompt is None:
            raise ValueError(f"request {request.index} has messages but no prompt; use --endpoint chat")
        body["prompt"] = request.prompt
    if sampling.top_p is not None:
        body["top_p"] = sampling.top_p
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    return body


def _delta_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def error_message(status: int, body: str) -> str:
    """The server's OpenAI-style error message, else the body's start."""
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (json.JSONDecodeError, AttributeError):
        pass
    return body.strip()[:300] or httpx.codes.get_reason_phrase(status)


class _Stream:
    """Parses one SSE stream into a RequestSample."""

    def __init__(self, sample: RequestSample, t_send: float, on_chunk: Callable[[], None]) -> None:
        self.sample, self.t_send, self.on_chunk = sample, t_send, on_chunk
        self.last_token_time: float | None = None
        self.done = False

    def feed(self, line: str) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        now = time.perf_counter()
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            raise StreamError(f"the server sent an event that is not JSON: {data[:120]!r}") from None
        if "error" in event and event["error"]:
            err = event["error"]
            raise StreamError(f"the server reported an error mid-stream: "
                              f"{err.get('message', err) if isinstance(err, dict) else err}")
        choices = event.get("choices") or []
        if choices:
            choice = choices[0]
            text = _delta_text(choice)
            if text or choice.get("logprobs") or choice.get("finish_reason"):
                self.token_chunk(now, text, choice.get("finish_reason"))
        if event.get("usage"):
            self.usage(event["usage"])

    def token_chunk(self, now: float, text: str, finish_reason: str | None) -> None:
        s = self.sample
        if self.last_token_time is None:
            s.ttft_s = now - self.t_send
        else:
            s.itl_s.append(now - self.last_token_time)
        self.last_token_time = now
        s.e2e_s = now - self.t_send
        s.num_chunks += 1
        s.text += text
        if finish_reason:
            s.finish_reason = finish_reason
        self.on_chunk()

    def usage(self, usage: dict[str, Any]) -> None:
        s = self.sample
        if isinstance(usage.get("completion_tokens"), int):
            s.output_tokens, s.output_tokens_source = usage["completion_tokens"], "usage"
        if isinstance(usage.get("prompt_tokens"), int):
            s.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        if isinstance(details.get("cached_tokens"), int):
            s.cached_tokens = details["cached_tokens"]
        s.usage_extra = {k: usage[k] for k in USAGE_EXTRAS if k in usage}


class StreamError(Exception):
    """The stream was readable but wrong (error event, bad JSON)."""


T = TypeVar("T")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on uvloop where it is installed (every platform but Windows), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def stream_session(request_timeout_s: float) -> aiohttp.ClientSession:
    """The session `send_request` streams on: a new connection per request, as the plain generator (plain.py)
    opens (llama-server's cpp-httplib closes a kept-alive connection now and then with no response to the
    request just sent on it; a loopback connect costs ~0.1 ms, inside TTFT for every engine alike); no proxy
    from the environment; no limit on connections (the load sets the concurrency)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=10.0),
                                 trust_env=False)


async def send_request(session: aiohttp.ClientSession, target: Target, request: BenchRequest,
                       sampling: SamplingOptions, run_start: float,
                       on_chunk: Callable[[], None] = lambda: None) -> RequestSample:
    """Send one streamed request; never raises for a server or network fault (see RequestSample.error)."""
    sample = RequestSample(request.index, request.prompt_len, request.output_len)
    t_send = time.perf_counter()
    sample.start_s = t_send - run_start
    stream = _Stream(sample, t_send, on_chunk)
    try:
        async with session.post(target.url, json=payload(target, request, sampling),
                                headers=target.headers()) as response:
            sample.status = response.status
            if response.status != 200:
                body = (await response.read()).decode("utf-8", errors="replace")
                kind = "auth" if response.status in (401, 403) else "http"
                return _fail(sample, kind, f"HTTP {response.status}: {error_message(response.status, body)}")
            await _read_lines(response, stream)
    except aiohttp.ClientConnectorError as e:
        return _fail(sample, "connect", f"cannot connect to {target.base_url}: {e.os_error or type(e).__name__}")
    except TimeoutError as e:  # aiohttp's ServerTimeoutError is one too
        return _fail(sample, "timeout", f"timed out after {time.perf_counter() - t_send:.1f} s "
                                        f"({type(e).__name__}); raise --request-timeout")
    except (aiohttp.ClientError, OSError) as e:
        return _fail(sample, "stream", f"the connection broke mid-stream after {sample.num_chunks} token chunks: "
                                       f"{e or type(e).__name__}")
    except StreamError as e:
        return _fail(sample, "stream", str(e))
    if sample.num_chunks == 0:
        return _fail(sample, "no_tokens", "the server answered 200 but streamed no token")
    if not stream.done and sample.finish_reason is None:
        return _fail(sample, "stream", f"the stream ended after {sample.num_chunks} token chunks without a "
                                       f"finish_reason or [DONE]")
    sample.success = True
    return sample


async def _read_lines(response: aiohttp.ClientResponse, stream: _Stream) -> None:
    """Feed the body to `stream` line by line, split here: aiohttp's own line reader refuses a line longer
    than its buffer (64 KiB), which a chunk with many logprobs can be. Each byte is searched once, however
    many reads a long line takes."""
    buf = bytearray()
    async for data in response.content.iter_any():
        searched = len(buf)
        buf += data
        start = 0
        while (end := buf.find(b"\n", max(start, searched))) >= 0:
            stream.feed(buf[start:end].decode("utf-8", errors="replace"))
            start = end + 1
        del buf[:start]
    if buf:
        stream.feed(buf.decode("utf-8", errors="replace"))


def _fail(sample: RequestSample, kind: str, message: str) -> RequestSample:
    sample.success, sample.error_kind, sample.error = False, kind, message
    return sample


@dataclass(frozen=True)
class TargetInfo:
    """What GET /v1/models said. `error_kind` is set when the target cannot be benchmarked at all."""

    model_ids: tuple[str, ...] = ()
    owned_by: str | None = None
    root: str | None = None
    max_model_len: int | None = None
    machine_profile: dict[str, Any] | None = None  # a tokenfactory server's measured kernel choices
    error_kind: str | None = None
    error: str | None = None


async def probe_target(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> TargetInfo:
    """GET /v1/models: reachable? key accepted? which models? A 404 (no such route) is not fatal."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await client.get(f"{base_url}/v1/models", headers=headers)
    except httpx.ConnectError as e:
        return TargetInfo(error_kind="connect", error=f"cannot connect to {base_url}: {e or type(e).__name__} "
                                                      f"(is the server running, and is --base-url right?)")
    except httpx.TimeoutException:
        return TargetInfo(error_kind="timeout", error=f"{base_url}/v1/models did not answer in time")
    except httpx.HTTPError as e:
        return TargetInfo(error_kind="connect", error=f"cannot talk to {base_url}: {e or type(e).__name__}")
    if response.status_code in (401, 403):
        hint = "the --api-key was refused" if api_key else "it needs an --api-key"
        return TargetInfo(error_kind="auth", error=f"{base_url} answered HTTP {response.status_code}: {hint} "
                                                   f"({error_message(response.status_code, response.text)})")
    if response.status_code != 200:
        return TargetInfo()
    try:
        models = response.json().get("data") or []
    except (json.JSONDecodeError, AttributeError):
        return TargetInfo()
    first = models[0] if models and isinstance(models[0], dict) else {}
    return TargetInfo(tuple(str(m.get("id")) for m in models if isinstance(m, dict)), first.get("owned_by"),
                      first.get("root"), first.get("max_model_len"),
                      first.get("machine_profile") if isinstance(first.get("machine_profile"), dict) else None)
