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
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from tokenfactory.engine.client import (
    AbortRequest,
    AddRequest,
    ChargeEnergy,
    EngineDeadError,
    EngineStats,
    ModelInfo,
    RequestError,
    SetTenantWeight,
)
from tokenfactory.types import CompletionOutput, FinishReason, RequestMetrics, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from tokenfactory.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Prometheus names of running and waiting requests and KV usage (a fraction), by engine.
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "tokenfactory:num_requests_running")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "tokenfactory:num_requests_waiting")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
            "tokenfactory:kv_cache_usage_perc")


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
    return body


class HTTPBackend:
    """An EngineClient over an OpenAI-compatible server (see the module's docstring)."""

    def __init__(self, name: str, url: str, model: str, info: ModelInfo, tokenizer: Tokenizer,
                 api_key: str | None = None, poll_s: float = 1.0, timeout_s: float = 600.0) -> None:
        self.name, self.url, self.model = name, url.rstrip("/").removesuffix("/v1"), model
        self._info, self._tokenizer = info, tokenizer
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.request_listeners: list[Callable[[str, bool], None]] = []  # (request_id, started?): the energy model
        self.metrics = BackendMetrics()
        self._num_in_flight = 0
        self._num_failed_checks = 0
        self._dead_reason: str | None = None
        self._num_prompt_tokens = self._num_generation_tokens = self._num_requests = 0
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name=f"backend-{name}-poll", daemon=True)

    # -- EngineClient ------------------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def start(self) -> None:
        if not self._poller.is_alive():
            self._poller.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()

    def send(self, message: SetTenantWeight | ChargeEnergy | AbortRequest) -> None:
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

    def generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        return self._generate(request)

    async def _generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        client = self._client()
        metrics = RequestMetrics(arrival_time=request.arrival_time, first_scheduled_time=time.monotonic())
        state = _Accumulated(request, self._tokenizer, metrics)
        produced = False
        self._num_in_flight += 1
        self._num_requests += 1
        self._notify(request.request_id, True)
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", headers=self.headers,
                                     json=completion_body(self.model, request), timeout=self.timeout_s) as resp:
                if resp.status_code >= 400:
                    body = (await resp.aread()).decode(errors="replace")[:500]
                    raise RequestError(f"backend {self.name} answered {resp.status_code}: {body}")
                async for line in resp.aiter_lines():
                    # The last chunks (finish reasons, then usage) are held for one final output with the count.
                    if state.feed(line) and not state.all_finished:
                        produced = True
                        yield state.output()
            final = state.final()
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
        with httpx.Client(timeout=max(self.poll_s * 2, 2.0), headers=self.headers) as http:
            while not self._stop.is_set():
                self._check(http)
                self._stop.wait(self.poll_s)

    def _check(self, http: httpx.Client) -> None:
        try:
            r = http.get(f"{self.url}/health")
            if r.status_code == 404:
                r = http.get(f"{self.url}/v1/models")
            ok = r.status_code == 200
            reason = f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, reason = False, f"{type(e).__name__}: {e}"
        if ok:
            self._num_failed_checks, self._dead_reason = 0, None
            try:
                m = http.get(f"{self.url}/metrics")
                if m.status_code == 200:
                    self.metrics = parse_backend_metrics(m.text)
            except httpx.HTTPError:
                pass
            return
        self._num_failed_checks += 1
        if self._num_failed_checks >= 3 and self._dead_reason is None:
            self._dead_reason = f"backend {self.name} ({self.url}) failed 3 health checks: {reason}"
            logger.warning("%s", self._dead_reason)


class _Accumulated:
    """One streamed completion, chunk by chunk, as RequestOutputs with deltas."""

    def __init__(self, request: AddRequest, tokenizer: Tokenizer, metrics: RequestMetrics) -> None:
        self.request, self.tokenizer, self.metrics = request, tokenizer, metrics
        self.outputs = {i: CompletionOutput(index=i) for i in range(request.params.n)}
        self.usage: dict[str, Any] | None = None

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
        except json.JSONDecodeError:
            return False
        if "error" in chunk:
            raise RequestError(f"the backend failed this request: {chunk['error']}")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        changed = False
        for choice in chunk.get("choices") or []:
            changed |= self._apply(choice)
        return changed

    def _apply(self, choice: dict[str, Any]) -> bool:
        c = self.outputs.get(int(choice.get("index", 0)))
        if c is None:
            return False
        text = choice.get("text") or ""
        ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        now = time.monotonic()
        if text and self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        if text:
            self.metrics.last_token_time = now
        c.text += text
        c.token_ids = c.token_ids + ids
        c.text_delta, c.token_ids_delta = c.text_delta + text, c.token_ids_delta + ids
        if choice.get("finish_reason"):
            reason = choice["finish_reason"]
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
        reported = self.usage.get("completion_tokens") if self.usage else None
        cached = ((self.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return RequestOutput(self.request.request_id, self.request.prompt, list(self.request.prompt_token_ids), outs,
                             num_cached_tokens=int(cached), metrics=self.metrics,
                             num_completion_tokens_reported=int(reported) if reported is not None else None,
                             tokens_source="backend" if reported is not None else "tokenizer")

    def final(self) -> RequestOutput:
        for c in self.outputs.values():
            if c.finish_reason is None:
                c.finish_reason = FinishReason.STOP
        return self.output()
