"""Another engine's OpenAI-compatible server as a replica (`serve --backend URL`): vLLM, SGLang, llama-server,
TGI, Ollama, or another tokenfactory.

The gateway has already tokenized and admitted the request, so the backend gets it as `/v1/completions` with
the prompt as token ids (a chat's template applied by us, as for our own replicas) and our sampling
parameters, streamed. Its text deltas become `RequestOutput`s; the completion's token count is the one its
`usage` reports (`tokens_source: backend`), or our tokenizer's count of the text when it sends none
(`tokens_source: tokenizer`). Energy is modelled (fleet/energy.py) unless a power source for its device is
reachable. A background thread checks `/health` (or `/v1/models`) and reads `/metrics` every `poll_s`:
vLLM's, SGLang's and our own names for running and waiting requests and KV usage feed the router; three
failed checks in a row mark it down, and a passing check brings it back.

A backend is untrusted input (docs/fleet.md, "A backend is untrusted input"): every chunk's shape is checked
(an object; `choices` a list of objects; `index` an integer naming one of the request's choices; `text` and
`finish_reason` strings), a malformed one ends the request with a named `RequestError` (an error event in a
stream, a 500 otherwise) instead of an exception; a line is at most `max_line_bytes`, an error body is read
up to `MAX_ERROR_BYTES` only, `/health` and `/metrics` up to `MAX_POLL_BYTES`, and the whole stream must end
within `max_stream_s`. A reported `completion_tokens` that is not an integer in [0, n × max_tokens] is
refused: the count is our tokenizer's (clamped to that bound) and the usage says `tokens_source:
backend-refused`. Credentials never appear in what is shown: a URL's `user:password@` is sent as basic auth
and dropped from `url`, and the key is a header only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx

from tokenfactory.engine.client import (
    AddRequest,
    ClientBase,
    Control,
    DirectOutputs,
    EngineDeadError,
    EngineFacts,
    EngineStats,
    ModelInfo,
    RequestError,
)
from tokenfactory.types import (
    CompletionOutput,
    FinishReason,
    GrammarKind,
    GrammarSpec,
    PoolingParams,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)

if TYPE_CHECKING:
    from tokenfactory.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Prometheus names of running and waiting requests and KV usage (a fraction), by engine.
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "tokenfactory:num_requests_running")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "tokenfactory:num_requests_waiting")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
            "tokenfactory:kv_cache_usage_perc")
MAX_ERROR_BYTES = 4096  # of an error body: enough for any message, never a backend's whole answer
MAX_POLL_BYTES = 4 << 20  # of /health, /v1/models or /metrics
REFUSED_SOURCE = "backend-refused"  # usage.tokens_source when the backend's own count was refused


def split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """(the URL without `user:password@`, (user, password) or None)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port is not None else "")
    clean = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return clean, (unquote(parts.username or ""), unquote(parts.password or ""))


def redact_url(url: str) -> str:
    """A URL fit to show: `user:password@` becomes `***@` (banners, logs, /health, fleet status)."""
    try:
        clean, credentials = split_credentials(url)
    except ValueError:  # not a URL urllib can read: still hide whatever sits before an '@'
        return re.sub(r"(://)[^/]*@", r"\1***@", url)
    if credentials is None:
        return url
    scheme, _, rest = clean.partition("://")
    return f"{scheme}://***@{rest}"


@dataclass(frozen=True)
class BackendMetrics:
    num_running: int | None = None
    num_waiting: int | None = None
    kv_cache_usage: float | None = None


def parse_backend_metrics(text: str) -> BackendMetrics:
    """Running/waiting requests and KV usage from a Prometheus exposition, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    except ValueError:
        return BackendMetrics()

    def first(names: tuple[str, ...]) -> float | None:
        return next((values[n] for n in names if n in values), None)

    running, waiting = first(RUNNING), first(WAITING)
    return BackendMetrics(None if running is None else int(running), None if waiting is None else int(waiting),
                          first(KV_USAGE))


def completion_body(model: str, request: AddRequest) -> dict[str, Any]:
    """Our sampling parameters in the completions API (vLLM's extra fields where the API has none)."""
    p: SamplingParams = request.params
    body: dict[str, Any] = {"model": model, "prompt": request.prompt_token_ids, "stream": True,
                            "stream_options": {"include_usage": True}, "n": p.n, "temperature": p.temperature,
                            "top_p": p.top_p, "presence_penalty": p.presence_penalty,
                            "frequency_penalty": p.frequency_penalty}
    if p.max_tokens is not None:
        body["max_tokens"] = p.max_tokens
    if p.seed is not None:
        body["seed"] = p.seed
    if p.stop:
        body["stop"] = list(p.stop)
    extra = {"top_k": p.top_k or None, "min_p": p.min_p or None, "min_tokens": p.min_tokens or None,
             "repetition_penalty": p.repetition_penalty if p.repetition_penalty != 1.0 else None,
             "stop_token_ids": list(p.stop_token_ids) or None, "ignore_eos": p.ignore_eos or None}
    body.update({k: v for k, v in extra.items() if v is not None})
    if p.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in p.logit_bias}  # OpenAI's shape: token ids as strings
    if p.grammar is not None:
        body.update(guided_fields(p.grammar))
    return body


def unsupported(request: AddRequest) -> str | None:
    """What this client cannot forward (it reads only generated text back), in words; None: all of it."""
    if isinstance(request.params, PoolingParams):
        return "embeddings are not served through an external backend replica"
    if request.params.prompt_logprobs is not None or request.params.prompt_only:
        return "prompt logprobs and max_tokens 0 are not served through an external backend replica"
    return None


def guided_fields(spec: GrammarSpec) -> dict[str, Any]:
    """A constraint as vLLM's (and SGLang's) completions fields, so a backend engine enforces it too."""
    match spec.kind:
        case GrammarKind.JSON_SCHEMA:
            return {"guided_json": json.loads(spec.source)}
        case GrammarKind.JSON_OBJECT:
            return {"guided_json": {"type": "object"}}
        case GrammarKind.REGEX:
            return {"guided_regex": spec.source}
        case GrammarKind.CHOICE:
            return {"guided_choice": json.loads(spec.source)}
    return {"guided_grammar": spec.source}


class HTTPBackend(ClientBase):
    """An EngineClient over an OpenAI-compatible server (see the module's docstring). It sends no steps: its
    step subscribers hear nothing (its energy is modelled per request, fleet/energy.py)."""

    kind = "backend"

    def __init__(self, name: str, url: str, model: str, info: ModelInfo, tokenizer: Tokenizer,
                 api_key: str | None = None, poll_s: float = 1.0, timeout_s: float = 600.0, *,
                 basic_auth: tuple[str, str] | None = None, max_stream_s: float = 3600.0,
                 max_line_bytes: int = 1 << 20, device: str = "unknown") -> None:
        """`url` may carry `user:password@` (sent as basic auth, never kept in `url`); `timeout_s`: the longest
        silence within a response; `max_stream_s`: the longest whole response."""
        url, in_url = split_credentials(url)
        self.name, self.url, self.model = name, url.rstrip("/").removesuffix("/v1"), model
        super().__init__(info, tokenizer, EngineFacts(info.path, device, url=self.url))
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        credentials = basic_auth or in_url
        self.auth = httpx.BasicAuth(*credentials) if credentials and not api_key else None
        self.poll_s, self.timeout_s, self.max_stream_s, self.max_line_bytes = (poll_s, timeout_s, max_stream_s,
                                                                               max_line_bytes)
        self.num_counts_refused = 0  # completion_tokens reports refused (negative, huge, not an integer)
        self.request_listeners: list[Callable[[str, bool], None]] = []  # (request_id, started?): the energy model
        self.metrics = BackendMetrics()
        self._num_in_flight = 0
        self._num_failed_checks = 0
        self._num_prompt_tokens = self._num_generation_tokens = self._num_requests = 0
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name=f"backend-{name}-poll", daemon=True)

    # -- EngineClient ------------------------------------------------------------------------------------

    def start(self) -> None:
        if not self._poller.is_alive():
            self._poller.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()

    def send(self, message: Control) -> None:
        pass  # weights and joules are ours to keep; an abort is the stream being closed

    def stats(self) -> EngineStats:
        m = self.metrics
        running = m.num_running if m.num_running is not None else self._num_in_flight
        blocks = 1000
        free = blocks if m.kv_cache_usage is None else int(blocks * (1 - min(max(m.kv_cache_usage, 0.0), 1.0)))
        return EngineStats(time=time.monotonic(), num_steps=self._num_requests, num_running=running,
                           num_waiting=m.num_waiting or 0, num_kv_blocks=blocks, num_free_kv_blocks=free,
                           num_prompt_tokens_total=self._num_prompt_tokens,
                           num_generation_tokens_total=self._num_generation_tokens, num_prefix_queries=0,
                           num_prefix_hits=0, num_preemptions=0, num_failed_requests=0, last_step_s=None,
                           last_step_tokens=0, max_num_seqs=256, max_num_batched_tokens=8192,
                           alive=self.is_alive, dead_reason=self._dead_reason)

    def generate(self, request: AddRequest,
                 direct: DirectOutputs | None = None) -> AsyncIterator[RequestOutput]:
        # `direct` (EngineClient.generate): not taken: outputs are read on the loop.
        return self._generate(request)

    async def _generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if (reason := unsupported(request)) is not None:
            raise RequestError(reason)
        http = self._client()
        metrics = RequestMetrics(arrival_time=request.arrival_time, first_scheduled_time=time.monotonic())
        state = _Accumulated(request, self._tokenizer, metrics, self.name, self._info.max_model_len)
        produced = False
        self._num_in_flight += 1
        self._num_requests += 1
        self._notify(request.request_id, True)
        deadline = time.monotonic() + self.max_stream_s
        try:
            async with http.stream("POST", f"{self.url}/v1/completions", headers=self.headers, auth=self.auth,
                                   json=completion_body(self.model, request), timeout=self.timeout_s) as resp:
                if resp.status_code >= 400:
                    body = (await _read_at_most(resp, MAX_ERROR_BYTES)).decode(errors="replace")[:500]
                    raise RequestError(f"backend {self.name} answered {resp.status_code}: {body}")
                async for line in self._lines(resp, deadline):
                    # The last chunks (finish reasons, then usage) are held for one final output with the count.
                    if state.feed(line) and not state.all_finished:
                        produced = True
                        yield state.output()
            final = state.final()
            if state.refused is not None:
                self.num_counts_refused += 1
                logger.warning("backend %s reported completion_tokens=%r for request %s; billed our tokenizer's "
                               "count %d instead (%s)", self.name, state.refused, request.request_id,
                               final.num_completion_tokens, REFUSED_SOURCE)
            self._num_prompt_tokens += len(request.prompt_token_ids)
            self._num_generation_tokens += final.num_completion_tokens
            yield final
        except (httpx.TransportError, httpx.StreamError) as e:
            if not produced:  # nothing reached the client: the fleet may send it elsewhere
                raise EngineDeadError(f"backend {self.name} unreachable: {type(e).__name__}: {e}") from e
            raise RequestError(f"backend {self.name} broke off the stream: {type(e).__name__}: {e}") from e
        finally:
            self._num_in_flight -= 1
            self._notify(request.request_id, False)

    # -- helpers -----------------------------------------------------------------------------------------

    async def _lines(self, resp: httpx.Response, deadline: float) -> AsyncIterator[str]:
        """The response's lines, each at most `max_line_bytes`, all of them before `deadline`."""
        chunks = resp.aiter_bytes()
        pending = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestError(f"backend {self.name} did not finish its answer within {self.max_stream_s:g} s")
            try:
                async with asyncio.timeout(left):  # only this read: never across a yield
                    chunk = await anext(chunks, None)
            except TimeoutError:
                raise RequestError(f"backend {self.name} did not finish its answer within "
                                   f"{self.max_stream_s:g} s") from None
            if chunk is None:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if len(pending) > self.max_line_bytes or any(len(line) > self.max_line_bytes for line in lines):
                raise RequestError(f"backend {self.name} sent a line longer than {self.max_line_bytes} bytes")
            for line in lines:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", errors="replace")

    def _notify(self, request_id: str, started: bool) -> None:
        for listener in self.request_listeners:
            listener(request_id, started)

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
            client = self._clients[loop] = httpx.AsyncClient(limits=limits)
        return client

    def _poll(self) -> None:
        with httpx.Client(timeout=max(self.poll_s * 2, 2.0), headers=self.headers, auth=self.auth) as http:
            while not self._stop.is_set():
                self._check(http)
                self._stop.wait(self.poll_s)

    def _get(self, http: httpx.Client, path: str) -> tuple[int, bytes]:
        """(status, at most MAX_POLL_BYTES of the body): a backend's /metrics cannot fill our memory."""
        with http.stream("GET", f"{self.url}{path}") as r:
            body = b""
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) >= MAX_POLL_BYTES:
                    break
            return r.status_code, body[:MAX_POLL_BYTES]

    def _check(self, http: httpx.Client) -> None:
        try:
            status, _ = self._get(http, "/health")
            if status == 404:
                status, _ = self._get(http, "/v1/models")
            ok = status == 200
            reason = f"/health answered {status}"
        except httpx.HTTPError as e:  # its message names no credentials: `url` carries none
            ok, reason = False, f"{type(e).__name__}: {e}"
        if ok:
            self._num_failed_checks, self._dead_reason = 0, None
            try:
                status, body = self._get(http, "/metrics")
                if status == 200:
                    self.metrics = parse_backend_metrics(body.decode("utf-8", errors="replace"))
            except httpx.HTTPError:
                pass
            return
        self._num_failed_checks += 1
        if self._num_failed_checks >= 3 and self._dead_reason is None:
            self._dead_reason = f"backend {self.name} ({self.url}) failed 3 health checks: {reason}"
            logger.warning("%s", self._dead_reason)


async def _read_at_most(resp: httpx.Response, limit: int) -> bytes:
    body = b""
    async for chunk in resp.aiter_bytes():
        body += chunk
        if len(body) >= limit:
            break
    return body[:limit]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Accumulated:
    """One streamed completion, chunk by chunk, as RequestOutputs with deltas; every chunk's shape checked."""

    def __init__(self, request: AddRequest, tokenizer: Tokenizer, metrics: RequestMetrics, name: str = "backend",
                 max_model_len: int | None = None) -> None:
        self.request, self.tokenizer, self.metrics, self.name = request, tokenizer, metrics, name
        self.outputs = {i: CompletionOutput(index=i) for i in range(request.params.n)}
        self.usage: dict[str, Any] | None = None
        self.max_choice_tokens = request.params.max_tokens or max_model_len or 1 << 20
        self.max_completion_tokens = request.params.n * self.max_choice_tokens  # the most the backend may report
        self.refused: object = None  # a refused completion_tokens report, as the backend sent it

    def malformed(self, what: str) -> RequestError:
        return RequestError(f"backend {self.name} sent a malformed chunk: {what}")

    @property
    def all_finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.outputs.values())

    def feed(self, line: str) -> bool:
        """One SSE line; True when it changed a choice."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            return False
        try:
            chunk = json.loads(data)
        except (json.JSONDecodeError, RecursionError):
            raise self.malformed("not JSON") from None
        if not isinstance(chunk, dict):
            raise self.malformed(f"a JSON {type(chunk).__name__}, not an object")
        if "error" in chunk:
            raise RequestError(f"backend {self.name} failed this request: {str(chunk['error'])[:500]}")
        usage = chunk.get("usage")
        if usage is not None and not isinstance(usage, dict):
            raise self.malformed("usage is not an object")
        if usage:
            self.usage = usage
        choices = chunk.get("choices")
        if choices is None:
            choices = []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise self.malformed("choices is not a list of objects")
        changed = False
        for choice in choices:
            changed |= self._apply(choice)
        return changed

    def _apply(self, choice: dict[str, Any]) -> bool:
        index = choice.get("index", 0)
        if not _is_int(index) or index not in self.outputs:
            raise self.malformed(f"choice index {str(index)[:40]!r} is not one of 0..{len(self.outputs) - 1}")
        c = self.outputs[index]
        text, reason = choice.get("text") or "", choice.get("finish_reason")
        if not isinstance(text, str) or (reason is not None and not isinstance(reason, str)):
            raise self.malformed("text or finish_reason is not a string")
        ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        if len(c.token_ids) + len(ids) > 2 * self.max_choice_tokens + 64:  # our count, with slack for re-tokenizing
            raise RequestError(f"backend {self.name} sent far more text than max_tokens allows")
        now = time.monotonic()
        if text and self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        if text:
            self.metrics.last_token_time = now
        c.text += text
        c.token_ids = c.token_ids + ids
        c.text_delta, c.token_ids_delta = c.text_delta + text, c.token_ids_delta + ids
        if reason:
            c.finish_reason = FinishReason(reason) if reason in FinishReason._value2member_map_ else FinishReason.STOP
        return bool(text) or c.finish_reason is not None

    def output(self) -> RequestOutput:
        """The state so far, with the deltas since the previous output."""
        outs = []
        for c in self.outputs.values():
            outs.append(CompletionOutput(c.index, c.text, list(c.token_ids), None, c.finish_reason,
                                         c.text_delta, list(c.token_ids_delta)))
            c.text_delta, c.token_ids_delta = "", []
        if all(c.finish_reason is not None for c in outs) and self.metrics.finished_time is None:
            self.metrics.finished_time = time.monotonic()
        reported, source = self.reported_count(outs)
        details = (self.usage or {}).get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else 0
        num_prompt = len(self.request.prompt_token_ids)
        cached = min(max(cached, 0), num_prompt) if _is_int(cached) else 0
        return RequestOutput(self.request.request_id, self.request.prompt, list(self.request.prompt_token_ids), outs,
                             num_cached_tokens=cached, metrics=self.metrics,
                             num_completion_tokens_reported=reported, tokens_source=source)

    def reported_count(self, outs: list[CompletionOutput]) -> tuple[int | None, str]:
        """The completion count to bill and where it came from: the backend's, when it is an integer in
        [0, n × max_tokens]; else our tokenizer's, clamped to that bound (and the report kept in `refused`)."""
        reported = self.usage.get("completion_tokens") if self.usage else None
        if reported is None:
            return None, "tokenizer"
        if _is_int(reported) and 0 <= reported <= self.max_completion_tokens:
            return reported, "backend"
        self.refused = reported if _is_int(reported) else str(reported)[:40]
        return min(sum(len(c.token_ids) for c in outs), self.max_completion_tokens), REFUSED_SOURCE

    def final(self) -> RequestOutput:
        for c in self.outputs.values():
            if c.finish_reason is None:
                c.finish_reason = FinishReason.STOP
        return self.output()
