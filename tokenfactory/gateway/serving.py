"""From an OpenAI request to engine requests and back: the handlers behind the routes.

`Handler` checks a request against the model (`ModelInfo`: prompt length, ids, model-dependent values),
tokenizes it in a worker thread (a long conversation must not stall the event loop), takes the tenant's
`Reservation`, sends one `AddRequest` per prompt through the engine client, and answers: a JSON body once
every prompt finished (`collect`, aborting all if the client leaves), or a stream of SSE chunks read
straight from each prompt's engine stream (`stream`, sent through `EventStream`). Every way out settles
the request once (`Settlement`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenfactory.engine.client import AddRequest, EngineClient, EngineDeadError, RequestError
from tokenfactory.gateway.accounting import Accounting
from tokenfactory.gateway.admin import Tenancy
from tokenfactory.gateway.admission import Reservation
from tokenfactory.gateway.compression import compress_chat, request_options
from tokenfactory.gateway.errors import APIError
from tokenfactory.gateway.metrics import ServerMetrics
from tokenfactory.gateway.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
    check_unicode,
)
from tokenfactory.gateway.render import Choice, render_chat, render_completion, usage_dict
from tokenfactory.gateway.settlement import Settlement
from tokenfactory.gateway.streaming import EventStream, sse
from tokenfactory.types import ParameterError, RequestOutput, SamplingParams


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    max_waiting: int = 256  # requests queued beyond this are refused with 503 (admission.py enforces it)
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 2
    stream_send_timeout_s: float = 30.0  # a streaming client that takes no data this long is dropped
    baseline: tuple[str, float] | None = None  # (bench run, its J/output token): /metrics for the regression alert


@dataclass
class Prepared:
    """One prompt, tokenized and checked, ready for the engine."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Served:
    """One model the server serves: its name in the API and its engine client (one engine, or a fleet)."""

    name: str
    engine: EngineClient


class Handler:
    """The routes' work (see the module's docstring); `background` holds the settlements still running.
    `engine` serves `settings.served_model_name`, the default; `models` adds others by name (a fleet of
    several models: each request goes to the one its `model` names)."""

    def __init__(self, engine: EngineClient, settings: ServerSettings, metrics: ServerMetrics,
                 accounting: Accounting | None = None, tenancy: Tenancy | None = None,
                 models: Mapping[str, EngineClient] | None = None) -> None:
        self.engine, self.settings, self.metrics, self.accounting = engine, settings, metrics, accounting
        self.models: dict[str, Served] = {settings.served_model_name: Served(settings.served_model_name, engine)}
        self.models.update({name: Served(name, client) for name, client in (models or {}).items()})
        self.tenancy = tenancy if tenancy is not None else Tenancy(None)
        self.background: set[asyncio.Task] = set()
        self.started = time.time()
        self.last_output_time: dict[str, float] = {}

    @property
    def tokenizer(self):  # noqa: ANN201 - the model's Tokenizer
        return self.engine.tokenizer

    def check_model(self, name: str | None) -> Served:
        """The model a request names (None: the default one); 404 naming what is served otherwise."""
        if name is None:
            return self.models[self.settings.served_model_name]
        served = self.models.get(name)
        if served is None:
            names = ", ".join(repr(n) for n in self.models)
            raise APIError(404, f"the model {name!r} does not exist on this server; it serves {names} "
                           f"(see GET /v1/models)", "not_found_error", "model", "model_not_found")
        return served

    def check_alive(self, served: Served | None = None) -> None:
        engine = (served or self.check_model(None)).engine
        if not engine.is_alive:
            raise APIError(503, engine.dead_reason or "the engine is not running", "server_error",
                           code="engine_unavailable")

    def prepare(self, body: _SamplingFields, text: str | None, ids: list[int], max_tokens: int | None,
                logprobs: int | None, served: Served | None = None) -> Prepared:
        info = (served or self.check_model(None)).engine.info
        info.check_prompt(ids)
        room = info.max_model_len - len(ids)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise ParameterError(
                "max_tokens", f"this model's context window is {info.max_model_len} model tokens; the prompt has "
                f"{len(ids)} and max_tokens asks for {max_tokens} more: lower max_tokens to at most {room}")
        params = body.sampling_params(max_tokens, logprobs)
        info.check_params(params)
        return Prepared(text, ids, params)

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Shutdown: wait for every pending settlement (aborted requests' rows included)."""
        if self.background:
            await asyncio.wait(set(self.background), timeout=timeout_s)

    # -- endpoints --------------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        served = self.check_model(body.model)
        check_unicode(body)
        if body.best_of not in (None, 1) or body.suffix is not None:
            raise ParameterError("best_of" if body.suffix is None else "suffix",
                                 "best_of and suffix are not supported by this server")
        body.sampling_params(body.max_tokens, body.logprobs)  # cheap checks before tokenizing anything
        prompts = await asyncio.to_thread(self.normalize_prompts, body.prompt, served.engine.tokenizer)
        prepared = [self.prepare(body, text, ids, body.max_tokens, body.logprobs, served) for text, ids in prompts]
        return await self.serve(body, prepared, request, "text_completion", echo=body.echo, served=served)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        served = self.check_model(body.model)
        check_unicode(body)
        body.check_supported()
        messages = []
        for m in body.messages:
            extra = {k: v for k, v in (m.model_extra or {}).items() if isinstance(v, str)}
            messages.append({**extra, "role": m.role, "content": m.text()})
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        body.sampling_params(max_tokens, logprobs)  # cheap checks before tokenizing anything
        text, ids = await asyncio.to_thread(self.chat_prompt, messages, body.add_generation_prompt,
                                            served.engine.tokenizer)
        compression = None
        # Opt-in, by the request or its tenant's default: the oldest turns summarized if the chat won't fit.
        options = request_options(body.context_compression, self.tenancy.principal(request).tenant)
        if options is not None:
            compression = await compress_chat(self, served, body, messages, max_tokens, request, options)
            if compression is not None:
                text, ids = await asyncio.to_thread(self.chat_prompt, compression.messages,
                                                    body.add_generation_prompt, served.engine.tokenizer)
        prepared = [self.prepare(body, text, ids, max_tokens, logprobs, served)]
        return await self.serve(body, prepared, request, "chat.completion", served=served,
                                usage_extra=compression.usage_fields() if compression else None)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool, tokenizer: object = None
                    ) -> tuple[str, list[int]]:
        """The chat template applied and tokenized (in a worker thread: long conversations take a while)."""
        tokenizer = tokenizer or self.tokenizer
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # the template's own raise_exception(): e.g. roles out of order
            raise ParameterError("messages", f"the model's chat template refused these messages: {e}") from e
        return text, tokenizer.encode(text, add_special_tokens=False)

    def normalize_prompts(self, prompt: str | list, tokenizer: object = None) -> list[tuple[str | None, list[int]]]:
        tokenizer = tokenizer or self.tokenizer
        if isinstance(prompt, str):
            return [(prompt, tokenizer.encode(prompt))]
        if not prompt:
            raise ParameterError("prompt", "prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [(None, list(prompt))]  # checked in prepare()
        if len(prompt) > MAX_PROMPTS:
            raise ParameterError("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
        if all(isinstance(p, str) for p in prompt):
            return [(p, tokenizer.encode(p)) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return [(None, list(p)) for p in prompt]
        raise ParameterError("prompt", "prompt must be a string, a list of strings, a list of token ids, "
                             "or a list of lists of token ids")

    async def serve(self, body: _SamplingFields, prepared: list[Prepared], request: Request, kind: str,
                    echo: bool = False, served: Served | None = None,
                    usage_extra: Mapping[str, object] | None = None) -> Response:
        served = served or self.check_model(None)
        self.check_alive(served)
        # A batch line (batch/runner.py) brings its own durable request id and the batch priority band.
        request_id = (getattr(request.state, "request_id", None)
                      or f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}")
        # The caller's limits are checked and its worst case reserved (queue slots, concurrency, tokens,
        # budget); the Settlement releases all of it exactly once, on every way out.
        worst_tokens = sum(len(p.token_ids) + p.params.n * (p.params.max_tokens or 0) for p in prepared)
        reservation = self.tenancy.admit(request, request_id, worst_tokens=worst_tokens, num_prompts=len(prepared),
                                         model=served.name)
        try:
            priority = getattr(request.state, "priority", reservation.priority)
            adds = [AddRequest(f"{request_id}-{i}", p.token_ids, p.text, p.params, time.monotonic(),
                               reservation.tenant, priority, body.user) for i, p in enumerate(prepared)]
            settlement = Settlement(self.accounting, self.background, request_id, adds, reservation, served.name,
                                    usage_extra)
        except BaseException:
            reservation.cancel()
            raise
        render = render_chat if kind == "chat.completion" else render_completion
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            latest: dict[int, RequestOutput] = {}
            events = self.stream(adds, settlement, latest, render, include_usage, echo, served)

            async def on_close(how: str) -> None:  # the body's own settlement, or this one if it never ran
                await settlement.settle([latest.get(i) for i in range(len(adds))], "aborted")
            return EventStream(events, on_close, self.settings.stream_send_timeout_s)
        latest = {}
        try:
            finals = await self.collect(adds, request, latest, reservation, served)
        except BaseException as e:
            status = "failed" if isinstance(e, APIError) else "aborted"
            settlement.start([latest.get(i) for i in range(len(adds))], status)
            raise
        choices = []
        for i, out in enumerate(finals):
            n = len(out.outputs)
            for c in out.outputs:
                prefix = (out.prompt or "") if echo else ""
                choices.append(Choice(i * n + c.index, prefix + c.text, c.finish_reason, c.logprobs))
        extra = await settlement.settle(list(finals), "finished")
        return JSONResponse(render.full(request_id, served.name, choices,
                                        usage_dict(finals, extra)))

    async def collect(self, adds: list[AddRequest], request: Request, latest: dict[int, RequestOutput],
                      reservation: Reservation, served: Served | None = None) -> list[RequestOutput]:
        """Run each prompt to the end; if the client disconnects first, abort them all."""
        served = served or self.check_model(None)
        engine, name = served.engine, served.name

        async def one(i: int, add: AddRequest) -> RequestOutput:
            final = None
            try:
                async for out in engine.generate(add):
                    if final is None:
                        reservation.leave_queue(i)
                    final = latest[i] = self.observe(out, final, name)
            except RequestError as e:
                raise APIError(500, str(e), "server_error", code="request_failed") from e
            except EngineDeadError as e:
                raise APIError(503, str(e), "server_error", code="engine_unavailable") from e
            finally:
                self.last_output_time.pop(add.request_id, None)
            assert final is not None
            return final

        tasks = [asyncio.ensure_future(one(i, a)) for i, a in enumerate(adds)]
        gathered = asyncio.gather(*tasks)
        try:
            while True:
                done, _ = await asyncio.wait({gathered}, timeout=0.5)
                if done:
                    return gathered.result()
                if await request.is_disconnected():
                    raise asyncio.CancelledError
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # each engine request aborted before we go

    async def usage(self, since: str | None, group_by: str | None, tenant: str | None = None) -> dict:
        """Totals from the ledger; `tenant`: only that tenant's rows (what a tenant's key may read)."""
        from tokenfactory.meter.cli import parse_since

        assert self.accounting is not None
        if group_by not in (None, "day", "tenant", "model", "replica"):
            raise ParameterError("group_by", f"group_by must be day, tenant, model or replica, got {group_by!r}")
        try:
            since_dt = parse_since(since) if since else None
        except ValueError as e:
            raise ParameterError("since", str(e)) from e
        rows = await asyncio.to_thread(self.accounting.ledger.totals, since=since_dt, group_by=group_by,
                                       tenant=tenant)
        return {"object": "usage", "group_by": group_by, "since": since, "tenant": tenant,
                "data": [dataclasses.asdict(r) for r in rows]}

    def observe(self, out: RequestOutput, previous: RequestOutput | None, name: str | None = None) -> RequestOutput:
        """Per output event: inter-token latency (spread over the tokens the event carries), and the
        request's latency histograms once it finishes."""
        now = time.monotonic()
        new_tokens = sum(len(c.token_ids_delta) for c in out.outputs)
        last = self.last_output_time.get(out.request_id)
        if previous is not None and last is not None and new_tokens:
            self.metrics.itl.labels(name or self.settings.served_model_name).observe((now - last) / new_tokens)
        self.last_output_time[out.request_id] = now
        if out.finished:
            self.last_output_time.pop(out.request_id, None)
            self.record_finished(out, name)
        return out

    def record_finished(self, out: RequestOutput, name: str | None = None) -> None:
        name, m = name or self.settings.served_model_name, out.metrics
        if m is not None:
            for hist, value in ((self.metrics.ttft, m.ttft), (self.metrics.e2e, m.e2e_latency),
                                (self.metrics.queue, m.queue_time)):
                if value is not None:
                    hist.labels(name).observe(value)
        self.metrics.prompt_len.labels(name).observe(len(out.prompt_token_ids))
        self.metrics.gen_len.labels(name).observe(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            self.metrics.success.labels(name, str(c.finish_reason)).inc()

    async def stream(self, adds: list[AddRequest], settlement: Settlement, latest: dict[int, RequestOutput],
                     render: type, include_usage: bool, echo: bool, served: Served | None = None
                     ) -> AsyncIterator[str]:
        """The SSE body: every prompt's engine stream read directly (each holds at most one pending
        output), never through a queue of its own. Closing it aborts whatever has not finished."""
        served = served or self.check_model(None)
        model, created, request_id = served.name, int(time.time()), settlement.request_id
        gens = [served.engine.generate(a) for a in adds]
        nexts: dict[asyncio.Future, int] = {}
        finals: dict[int, RequestOutput] = {}
        finished_choices: dict[int, set[int]] = {}  # per prompt, the choices whose finish was sent
        try:
            for chunk in render.first_chunks(request_id, model, created, adds, echo):
                yield sse(chunk, include_usage)
            nexts = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens)}
            while nexts:
                done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    i = nexts.pop(future)
                    try:
                        out = future.result()
                    except (RequestError, EngineDeadError) as e:
                        settlement.start([finals.get(j, latest.get(j)) for j in range(len(adds))], "failed")
                        code = "request_failed" if isinstance(e, RequestError) else "engine_unavailable"
                        yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": code}})
                        return
                    if i not in latest:
                        settlement.reservation.leave_queue(i)
                    latest[i] = self.observe(out, latest.get(i), model)
                    for chunk in render.delta_chunks(request_id, model, created, i, out,
                                                     frozenset(finished_choices.get(i, ()))):
                        yield sse(chunk, include_usage)
                    finished_choices.setdefault(i, set()).update(c.index for c in out.outputs if c.finished)
                    if out.finished:
                        finals[i] = out
                    else:
                        nexts[asyncio.ensure_future(anext(gens[i]))] = i
            ordered = [finals[i] for i in sorted(finals)]
            extra = await settlement.settle(list(ordered), "finished")
            if include_usage:
                yield sse(render.usage_chunk(request_id, model, created, usage_dict(ordered, extra)))
            yield "data: [DONE]\n\n"
        finally:
            for future in nexts:
                future.cancel()
            await asyncio.gather(*nexts, return_exceptions=True)
            for g in gens:
                await g.aclose()  # an unfinished engine request is aborted here, its blocks freed
            for a in adds:
                self.last_output_time.pop(a.request_id, None)
