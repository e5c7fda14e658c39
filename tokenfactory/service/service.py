"""The request service: a `Call` and a validated body in, typed results out. No HTTP inside.

    service.chat(call, ChatCompletionRequest)     -> CompletionResult | CompletionStream
    service.completions(call, CompletionRequest)  -> CompletionResult | CompletionStream
    service.embeddings(call, EmbeddingRequest)    -> EmbeddingResult (prefill-only engine requests, one row)
    service.tokenize(TokenizeRequest) / detokenize(DetokenizeRequest)  the model's tokenizer, nothing admitted
    service.usage(call, since, group_by, tenant)  -> UsageReport
    service.model(name) / service.models          the served models (one engine client, or a fleet, each)

Every endpoint goes through it: the HTTP routes (gateway/routes.py build the `Call` from the request and
render the result), the Batch API (a line is a call as its tenant, in the batch band, with its durable
request id), context compression (the summary is a call of its own, `<id>-summary`), and what follows.

A request is checked against the model it names (`ModelInfo`: prompt length, ids, model-dependent values),
tokenized in a worker thread (a long conversation must not stall the event loop), admitted by its tenant's
`Reservation` (service/admission.py), sent as one `AddRequest` per prompt through the engine client, and
answered: a `CompletionResult` once every prompt finished, or a `CompletionStream` read straight from each
prompt's engine stream. Every way out — the end, a failure, the caller's cancel signal, a stream closed early
— settles the request exactly once (`Settlement`: meter, ledger row, reservation).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from tokenfactory.engine.client import AddRequest, DirectOutputs, EngineClient, EngineDeadError, RequestError
from tokenfactory.engine.grammar import validate_grammar
from tokenfactory.meter.ledger import UsageTotals
from tokenfactory.models.tokenizer import Tokenizer
from tokenfactory.models.tools import ToolCallStream
from tokenfactory.service.accounting import Accounting
from tokenfactory.service.admission import Reservation
from tokenfactory.service.call import Call
from tokenfactory.service.compression import Compression, compress, request_options, summary_request
from tokenfactory.service.errors import APIError, Cancelled
from tokenfactory.service.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    CompressionOptions,
    DetokenizeRequest,
    EmbeddingRequest,
    SamplingFields,
    TokenizeRequest,
    check_unicode,
    messages_as_dicts,
)
from tokenfactory.service.results import (
    NO_PROMPT_LOGPROBS,
    Choice,
    ChoiceDelta,
    CompletionResult,
    CompletionStream,
    CompressionUsage,
    DirectDeltas,
    EmbeddingResult,
    Kind,
    PromptLogprobs,
    PromptRendering,
    StreamEnd,
    StreamEvent,
    StreamFailed,
    StreamStart,
    TokenizeResult,
    Usage,
)
from tokenfactory.service.settlement import Settlement
from tokenfactory.service.structured import ToolPlan, one_constraint, plan_tools, request_grammar
from tokenfactory.service.tenancy import Tenancy
from tokenfactory.types import FinishReason, GrammarSpec, ParameterError, PoolingParams, RequestOutput, SamplingParams

USAGE_GROUPS = (None, "day", "tenant", "model", "replica")


class RequestObserver(Protocol):
    """Sees every engine output of every request (the gateway's latency histograms): called on the event
    loop, and for a plain stream's direct outputs on the engine's thread (one request's calls never at once, and
    `on_end` after its last), so it must be cheap, must not raise, and must not assume the loop's thread."""

    def on_output(self, model: str, out: RequestOutput) -> None: ...

    def on_end(self, request_id: str) -> None:
        """The engine request is over (finished, failed or aborted): forget what was kept for it."""
        ...


class NullObserver:
    def on_output(self, model: str, out: RequestOutput) -> None:
        pass

    def on_end(self, request_id: str) -> None:
        pass


@dataclass(frozen=True)
class Served:
    """One model the server serves: its name in the API and its engine client (one engine, or a fleet)."""

    name: str
    engine: EngineClient


@dataclass(frozen=True)
class Prepared:
    """One prompt, tokenized and checked, ready for the engine."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams | PoolingParams


@dataclass(frozen=True)
class UsageReport:
    group_by: str | None
    since: str | None
    tenant: str | None
    rows: tuple[UsageTotals, ...]


async def _merged(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Each prompt's outputs as they come, with the prompt's index, until every prompt's last. One prompt (the common
    case) is read directly: racing it with asyncio.wait made a task, a wait and its callbacks for every token (this
    and EventStream's send without wait_for took a quarter off the event loop's CPU per streamed token at one
    client). A stream's error is raised here."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
            if out.finished:
                return
        return
    nexts = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens)}
    try:
        while nexts:
            done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = nexts.pop(future)
                out = future.result()
                yield i, out
                if not out.finished:
                    nexts[asyncio.ensure_future(anext(gens[i]))] = i
    finally:
        for future in nexts:
            future.cancel()
        await asyncio.gather(*nexts, return_exceptions=True)


class RequestService:
    """See the module's docstring. `models` maps each served name to its engine client, the default first;
    `pending` holds the settlements still running (what `drain` waits for at shutdown)."""

    def __init__(self, models: Mapping[str, EngineClient], accounting: Accounting | None = None,
                 tenancy: Tenancy | None = None, observer: RequestObserver | None = None) -> None:
        if not models:
            raise ValueError("a request service needs at least one model")
        self.models: dict[str, Served] = {name: Served(name, client) for name, client in models.items()}
        self.default_model = next(iter(self.models))
        self.accounting = accounting
        self.tenancy = tenancy if tenancy is not None else Tenancy(None)
        self.observer: RequestObserver = observer if observer is not None else NullObserver()
        self.pending: set[asyncio.Task] = set()
        self.started = time.time()

    # -- the served models -------------------------------------------------------------------------------

    def model(self, name: str | None) -> Served:
        """The model a request names (None: the default one); 404 naming what is served otherwise."""
        if name is None:
            return self.models[self.default_model]
        served = self.models.get(name)
        if served is None:
            names = ", ".join(repr(n) for n in self.models)
            raise APIError(404, f"the model {name!r} does not exist on this server; it serves {names} "
                           f"(see GET /v1/models)", "not_found_error", "model", "model_not_found")
        return served

    @staticmethod
    def check_alive(served: Served) -> None:
        if not served.engine.is_alive:
            raise APIError(503, served.engine.dead_reason or "the engine is not running", "server_error",
                           code="engine_unavailable")

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Shutdown: wait for every pending settlement (aborted requests' rows included)."""
        if self.pending:
            await asyncio.wait(set(self.pending), timeout=timeout_s)

    # -- endpoints ---------------------------------------------------------------------------------------

    async def completions(self, call: Call, body: CompletionRequest) -> CompletionResult | CompletionStream:
        served = self.model(body.model)
        check_unicode(body)
        if body.best_of not in (None, 1) or body.suffix is not None:
            raise ParameterError("best_of" if body.suffix is None else "suffix",
                                 "best_of and suffix are not supported by this server")
        prompt_logprobs = body.engine_prompt_logprobs
        body.sampling_params(body.max_tokens, body.logprobs, prompt_logprobs)  # cheap checks before tokenizing
        grammar = one_constraint(body.output_constraints())
        if grammar is not None:
            await asyncio.to_thread(validate_grammar, grammar)  # a 400 naming the field, before any work
        prompts = await asyncio.to_thread(normalize_prompts, body.prompt, served.engine.tokenizer, body.echo)
        prepared = [prepare(served, body, text, ids, body.max_tokens, body.logprobs, grammar, prompt_logprobs)
                    for text, ids in prompts]
        request_id = call.request_id or f"cmpl-{uuid.uuid4().hex}"
        rendering = PromptRendering(body.logprobs if body.echo else None, body.prompt_logprobs)
        return await self._run(call, request_id, "text", body, prepared, served, echo=body.echo, prompt=rendering)

    async def chat(self, call: Call, body: ChatCompletionRequest) -> CompletionResult | CompletionStream:
        served = self.model(body.model)
        check_unicode(body)
        body.check_supported()
        messages = body.messages_as_dicts()
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        body.sampling_params(max_tokens, logprobs)  # cheap checks before tokenizing anything
        request_id = call.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        tokenizer = served.engine.tokenizer
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, tokenizer)
        grammar = request_grammar(body.output_constraints(), tools)
        if grammar is not None:
            await asyncio.to_thread(validate_grammar, grammar)  # a 400 naming the field, before any work
        text, ids = await asyncio.to_thread(chat_prompt, tokenizer, messages, body.add_generation_prompt, body.tools)
        compression = None
        # Opt-in, by the request or its tenant's default: the oldest turns summarized if the chat won't fit.
        options = request_options(body.context_compression, call.tenant)
        if options is not None:
            compression = await self._compress(call.derived(f"{request_id}-summary"), served, body, messages,
                                               max_tokens, options)
            if compression is not None:
                text, ids = await asyncio.to_thread(chat_prompt, tokenizer, compression.messages,
                                                    body.add_generation_prompt, body.tools)
        prepared = [prepare(served, body, text, ids, max_tokens, logprobs, grammar)]
        usage = compression.usage() if compression is not None else None
        return await self._run(call, request_id, "chat", body, prepared, served, compression=usage, tools=tools,
                               prompt=PromptRendering(None, body.prompt_logprobs))

    async def embeddings(self, call: Call, body: EmbeddingRequest) -> EmbeddingResult:
        """One prefill-only engine request per input, its vector pooled as the engine pools (ModelInfo.pooling);
        admitted, metered and written to the ledger (one row) like any request."""
        served = self.model(body.model)
        check_unicode(body)
        info = served.engine.info
        params = PoolingParams(dimensions=body.dimensions)
        info.check_params(params)
        prompts = await asyncio.to_thread(normalize_prompts, body.input, served.engine.tokenizer, False, "input")
        for _, ids in prompts:
            try:
                info.check_prompt(ids, generates=False)
            except ParameterError as e:
                raise ParameterError("input", str(e).replace("the prompt", "an input")) from e
        request_id = call.request_id or f"embd-{uuid.uuid4().hex}"
        self.check_alive(served)
        adds, settlement, reservation = self._reserve(call, request_id, served, [
            Prepared(text, ids, params) for text, ids in prompts], body.user)
        latest: dict[int, RequestOutput] = {}
        try:
            finals = await self._collect(call, served, adds, latest, reservation)
        except BaseException as e:
            settlement.start([latest.get(i) for i in range(len(adds))], "failed" if isinstance(e, APIError)
                             else "aborted")
            raise
        energy = await settlement.settle(list(finals), "finished")
        return EmbeddingResult(request_id, served.name, int(time.time()),
                               tuple(out.embedding or [] for out in finals), Usage.of(finals, energy))

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResult:
        """The model's own tokens for a prompt or (through its chat template) messages; nothing is admitted."""
        served = self.model(body.model)
        check_unicode(body)
        body.check()
        tokenizer = served.engine.tokenizer

        def run() -> TokenizeResult:
            if body.messages is not None:
                rendered, ids = chat_prompt(tokenizer, messages_as_dicts(body.messages),
                                            body.add_generation_prompt)
                if body.add_special_tokens:
                    ids = tokenizer.encode(rendered)
            else:
                ids = tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens is not False)
            strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
            return TokenizeResult(ids, served.engine.info.max_model_len, strs)

        return await asyncio.to_thread(run)

    async def detokenize(self, body: DetokenizeRequest) -> str:
        served = self.model(body.model)
        vocab = served.engine.info.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise ParameterError("tokens", f"token ids must be integers in [0, {vocab})")
        return await asyncio.to_thread(served.engine.tokenizer.decode, body.tokens, skip_special_tokens=False)

    async def usage(self, call: Call, since: str | None, group_by: str | None,
                    tenant: str | None = None) -> UsageReport:
        """Totals from the ledger; the caller may read its own tenant's (an admin, or auth off: any, or all)."""
        from tokenfactory.meter.cli import parse_since

        if self.accounting is None:
            raise APIError(404, "usage is not recorded by this server (it runs without a ledger)", "not_found_error")
        tenant = self.tenancy.usage_tenant(call.principal, tenant)
        if group_by not in USAGE_GROUPS:
            raise ParameterError("group_by", f"group_by must be day, tenant, model or replica, got {group_by!r}")
        try:
            since_dt = parse_since(since) if since else None
        except ValueError as e:
            raise ParameterError("since", str(e)) from e
        rows = await asyncio.to_thread(self.accounting.ledger.totals, since=since_dt, group_by=group_by,
                                       tenant=tenant)
        return UsageReport(group_by, since, tenant, tuple(rows))

    # -- one request: admission, the engine, settlement ---------------------------------------------------

    async def _run(self, call: Call, request_id: str, kind: Kind, body: SamplingFields, prepared: list[Prepared],
                   served: Served, *, echo: bool = False, compression: CompressionUsage | None = None,
                   tools: ToolPlan | None = None, prompt: PromptRendering = NO_PROMPT_LOGPROBS
                   ) -> CompletionResult | CompletionStream:
        self.check_alive(served)
        adds, settlement, reservation = self._reserve(call, request_id, served, prepared, body.user)
        created = int(time.time())
        constrained = any(p.params.grammar is not None for p in prepared)
        if body.stream:
            return self._stream(call, kind, request_id, created, served, adds, settlement, echo, compression,
                                tools, constrained, prompt)
        latest: dict[int, RequestOutput] = {}
        try:
            finals = await self._collect(call, served, adds, latest, reservation)
        except BaseException as e:
            status = "failed" if isinstance(e, APIError) else "aborted"
            settlement.start([latest.get(i) for i in range(len(adds))], status)
            raise
        choices = []
        for i, out in enumerate(finals):
            n = len(out.outputs)
            prompt_logprobs = prompt_logprobs_of(out, served.engine.tokenizer)
            for c in out.outputs:
                prefix = (out.prompt or "") if echo else ""
                choices.append(_choice(i * n + c.index, prefix + c.text, c.finish_reason, c.logprobs, tools,
                                       prompt_logprobs))
        energy = await settlement.settle(list(finals), "finished")
        return CompletionResult(kind, request_id, served.name, created, tuple(choices),
                                Usage.of(finals, energy, compression, constrained), prompt)

    def _reserve(self, call: Call, request_id: str, served: Served, prepared: list[Prepared],
                 user: str | None) -> tuple[list[AddRequest], Settlement, Reservation]:
        """The caller's limits checked and its worst case reserved (queue slots, concurrency, tokens, budget), and
        the engine requests made; the Settlement releases all of it exactly once, on every way out."""
        worst_tokens = sum(len(p.token_ids) + _worst_new_tokens(p.params) for p in prepared)
        reservation = self.tenancy.admit(call.principal, request_id, worst_tokens, num_prompts=len(prepared),
                                         model=served.name)
        try:
            priority = call.priority if call.priority is not None else reservation.priority
            adds = [AddRequest(f"{request_id}-{i}", p.token_ids, p.text, p.params, time.monotonic(),
                               reservation.tenant, priority, user) for i, p in enumerate(prepared)]
            settlement = Settlement(self.accounting, self.pending, request_id, adds, reservation, served.name)
        except BaseException:
            reservation.cancel()
            raise
        return adds, settlement, reservation

    async def _collect(self, call: Call, served: Served, adds: list[AddRequest], latest: dict[int, RequestOutput],
                       reservation: Reservation) -> list[RequestOutput]:
        """Run each prompt to the end; if the call is cancelled first, abort them all (raises Cancelled)."""
        async def one(i: int, add: AddRequest) -> RequestOutput:
            final = None
            try:
                async for out in served.engine.generate(add):
                    if final is None:
                        reservation.leave_queue(i)
                    self.observer.on_output(served.name, out)
                    final = latest[i] = out
            except RequestError as e:
                if e.param is not None:  # the client's input (a grammar the engine could not compile): a 400
                    raise APIError(400, str(e), "invalid_request_error", e.param) from e
                raise APIError(500, str(e), "server_error", code="request_failed") from e
            except EngineDeadError as e:
                raise APIError(503, str(e), "server_error", code="engine_unavailable") from e
            finally:
                self.observer.on_end(add.request_id)
            assert final is not None
            return final

        tasks = [asyncio.ensure_future(one(i, a)) for i, a in enumerate(adds)]
        gathered = asyncio.gather(*tasks)
        cancelled = asyncio.ensure_future(call.cancelled.wait())
        try:
            await asyncio.wait({gathered, cancelled}, return_when=asyncio.FIRST_COMPLETED)
            if gathered.done():
                return gathered.result()
            raise Cancelled(f"request {reservation.request_id} was cancelled by its caller")
        finally:
            cancelled.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(gathered, *tasks, return_exceptions=True)  # each engine request aborted first

    def _stream(self, call: Call, kind: Kind, request_id: str, created: int, served: Served,
                adds: list[AddRequest], settlement: Settlement, echo: bool,
                compression: CompressionUsage | None, tools: ToolPlan | None = None,
                constrained: bool = False, prompt: PromptRendering = NO_PROMPT_LOGPROBS) -> CompletionStream:
        latest: dict[int, RequestOutput] = {}
        plain = len(adds) == 1 and adds[0].params.n == 1 and (tools is None or not tools.parse)
        direct = DirectDeltas() if plain else None
        events = self._events(served, adds, settlement, latest, echo, compression, tools, constrained, direct)

        async def on_close() -> None:  # the stream's own settlement, or this one if it never finished
            await settlement.settle([latest.get(i) for i in range(len(adds))], "aborted")

        return CompletionStream(kind, request_id, served.name, created, events, on_close, prompt, direct)

    def _direct_outputs(self, served: Served, direct: DirectDeltas, latest: dict[int, RequestOutput],
                        sent_finish: set[int]) -> DirectOutputs:
        """One plain stream's outputs, on the engine's thread while its reader waits: each becomes its delta for
        `direct`'s consumer, and is recorded (the observer, the latest output settlement bills) only once taken.
        The first output (it leaves the queue, may carry prompt logprobs) and the last come through the loop."""
        def offer(out: RequestOutput) -> bool:
            consumer = direct.consumer
            if consumer is None or 0 not in latest:
                return False
            deltas = choice_deltas(0, out, sent_finish)
            if deltas and not consumer(deltas[0]):
                return False
            self.observer.on_output(served.name, out)
            latest[0] = out
            return True

        return offer

    async def _events(self, served: Served, adds: list[AddRequest], settlement: Settlement,
                      latest: dict[int, RequestOutput], echo: bool, compression: CompressionUsage | None,
                      tools: ToolPlan | None = None, constrained: bool = False,
                      direct: DirectDeltas | None = None) -> AsyncIterator[StreamEvent]:
        """Every prompt's engine stream read directly (each holds at most one pending output), never through a
        queue of its own; a plain stream's deltas may also go to `direct`'s consumer from the engine's thread.
        Closing it aborts whatever has not finished."""
        sent_finish: dict[int, set[int]] = {}  # per prompt, the choices whose finish was sent
        if direct is not None:
            gens = [served.engine.generate(adds[0], self._direct_outputs(served, direct, latest,
                                                                         sent_finish.setdefault(0, set())))]
        else:
            gens = [served.engine.generate(a) for a in adds]
        merged = _merged(gens)
        finals: dict[int, RequestOutput] = {}
        calls = ToolDeltas(tools) if tools is not None and tools.parse else None
        sent_prompt: set[int] = set()  # prompts whose prompt logprobs went out (with their first output)
        tokenizer = served.engine.tokenizer
        try:
            yield StreamStart(tuple((i * a.params.n + k, (a.prompt or "") if echo else "")
                                    for i, a in enumerate(adds) for k in range(a.params.n)), echo)
            while True:
                try:
                    i, out = await anext(merged)
                except StopAsyncIteration:
                    break
                except (RequestError, EngineDeadError) as e:
                    settlement.start([finals.get(j, latest.get(j)) for j in range(len(adds))], "failed")
                    code = "request_failed" if isinstance(e, RequestError) else "engine_unavailable"
                    yield StreamFailed(str(e), code, e.param if isinstance(e, RequestError) else None)
                    return
                if i not in latest:
                    settlement.reservation.leave_queue(i)
                self.observer.on_output(served.name, out)
                latest[i] = out
                prompt_logprobs = None  # sent once, with the first output that has them all
                if i not in sent_prompt and (prompt_logprobs := prompt_logprobs_of(out, tokenizer)) is not None:
                    sent_prompt.add(i)
                for delta in choice_deltas(i, out, sent_finish.setdefault(i, set()), prompt_logprobs):
                    if calls is not None and (delta := calls.split(delta)) is None:
                        continue  # held: the text so far may be the start of a call
                    yield delta
                if out.finished:
                    finals[i] = out
            ordered = [finals[i] for i in sorted(finals)]
            energy = await settlement.settle(list(ordered), "finished")
            yield StreamEnd(Usage.of(ordered, energy, compression, constrained))
        finally:
            await merged.aclose()
            for g in gens:
                await g.aclose()  # an unfinished engine request is aborted here, its blocks freed
            for a in adds:
                self.observer.on_end(a.request_id)

    # -- context compression -----------------------------------------------------------------------------

    async def _compress(self, call: Call, served: Served, body: ChatCompletionRequest, messages: list[dict],
                        max_tokens: int | None, options: CompressionOptions) -> Compression | None:
        """The oldest turns summarized by a call of its own (`call.request_id`, the same tenant and signal),
        admitted, metered and written to the ledger like any request."""
        info = served.engine.info
        reply = max_tokens if max_tokens is not None else options.summary_tokens
        if reply >= info.max_model_len:
            return None  # nothing can fit beside such a reply: prepare() says so, naming max_tokens
        summarizer = self.model(options.model) if options.model else served

        async def tokenize(msgs: list[dict], on: Served = served) -> int:
            _, ids = await asyncio.to_thread(chat_prompt, on.engine.tokenizer, msgs, body.add_generation_prompt)
            return len(ids)

        async def summarize(old: list[dict], summary_tokens: int) -> tuple[str, int, str]:
            limit = summarizer.engine.info.max_model_len - summary_tokens
            while len(old) > 1 and await tokenize(summary_request(old, 0, None)["messages"], summarizer) > limit:
                old = old[1:]  # the oldest turns past what the summarizer can read are dropped, not summarized
            if await tokenize(summary_request(old, 0, None)["messages"], summarizer) > limit:
                raise ParameterError("context_compression", f"the summarizing model ({summarizer.name}) cannot "
                                     "read even the latest earlier turn beside its summary: lower summary_tokens "
                                     "or name a model with a longer context")
            result = await self.chat(call, ChatCompletionRequest(**summary_request(old, summary_tokens,
                                                                                   summarizer.name)))
            assert isinstance(result, CompletionResult)  # the summary request does not stream
            return result.choices[0].text, result.usage.num_completion_tokens, result.request_id

        return await compress(messages, limit_tokens=info.max_model_len - reply, options=options, tokenize=tokenize,
                              summarize=summarize)


# -- preparing prompts (pure; the tokenizing ones run in a worker thread) ---------------------------------------


def prepare(served: Served, body: SamplingFields, text: str | None, ids: list[int], max_tokens: int | None,
            logprobs: int | None, grammar: GrammarSpec | None = None, prompt_logprobs: int | None = None) -> Prepared:
    """One prompt checked against the model (ids, length, room for max_tokens, model-dependent values)."""
    info = served.engine.info
    info.check_prompt(ids, generates=max_tokens != 0)
    room = info.max_model_len - len(ids)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise ParameterError(
            "max_tokens", f"this model's context window is {info.max_model_len} model tokens; the prompt has "
            f"{len(ids)} and max_tokens asks for {max_tokens} more: lower max_tokens to at most {room}")
    params = body.sampling_params(max_tokens, logprobs, prompt_logprobs)
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar)
    info.check_params(params)
    return Prepared(text, ids, params)


def _worst_new_tokens(params: SamplingParams | PoolingParams) -> int:
    return 0 if isinstance(params, PoolingParams) else params.n * (params.max_tokens or 0)


def prompt_logprobs_of(out: RequestOutput, tokenizer: Tokenizer) -> PromptLogprobs | None:
    if out.prompt_logprobs is None or not out.prompt_token_ids:
        return None
    return PromptLogprobs.of(out, tokenizer.decode(out.prompt_token_ids[:1], skip_special_tokens=False))


def chat_prompt(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """The chat template applied (with the tools' definitions) and tokenized (in a worker thread: long
    conversations take a while)."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except Exception as e:  # the template's own raise_exception(): e.g. roles out of order
        raise ParameterError("messages", f"the model's chat template refused these messages: {e}") from e
    return text, tokenizer.encode(text, add_special_tokens=False)


def normalize_prompts(prompt: str | list, tokenizer: Tokenizer, echo: bool = False,
                      field: str = "prompt") -> list[tuple[str | None, list[int]]]:
    """Each prompt's text and ids. Token-id prompts have no text, unless `echo` shows it: then it is decoded."""
    prompts = _prompt_list(prompt, tokenizer, field)
    if echo:
        return [(text if text is not None else _decode(tokenizer, ids), ids) for text, ids in prompts]
    return prompts


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str | None:
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)
    except Exception:  # noqa: BLE001 - ids outside the vocabulary: prepare() names them
        return None


def _prompt_list(prompt: str | list, tokenizer: Tokenizer, field: str) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        return [(prompt, tokenizer.encode(prompt))]
    if not prompt:
        raise ParameterError(field, f"{field} must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]  # checked in prepare()
    if len(prompt) > MAX_PROMPTS:
        raise ParameterError(field, f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
    if all(isinstance(p, str) for p in prompt):
        return [(p, tokenizer.encode(p)) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [(None, list(p)) for p in prompt]
    raise ParameterError(field, f"{field} must be a string, a list of strings, a list of token ids, "
                         "or a list of lists of token ids")


def choice_deltas(prompt_index: int, out: RequestOutput, sent_finish: set[int],
                  prompt_logprobs: PromptLogprobs | None = None) -> list[ChoiceDelta]:
    """What is new in `out` for each of its choices; `sent_finish` (updated): choices whose finish was sent
    already (an output carries every choice of its request, finished ones too). `prompt_logprobs`: the
    prompt's, with the prompt's first output (each of its choices carries them)."""
    deltas = []
    n = len(out.outputs)
    for c in out.outputs:
        if c.index in sent_finish or (not c.token_ids_delta and not c.text_delta and not c.finished
                                      and prompt_logprobs is None):
            continue
        deltas.append(ChoiceDelta(prompt_index * n + c.index, c.text_delta, c.logprobs_delta or None,
                                  c.finish_reason,
                                  prompt_logprobs=prompt_logprobs))
        if c.finished:
            sent_finish.add(c.index)
    return deltas


def _choice(index: int, text: str, reason: FinishReason | None, logprobs: list | None,
            tools: ToolPlan | None, prompt_logprobs: PromptLogprobs | None = None) -> Choice:
    """A finished choice; with tools, its text split into content and calls ("tool_calls" when it holds any)."""
    if tools is None:
        return Choice(index, text, reason, logprobs, prompt_logprobs=prompt_logprobs)
    parsed = tools.parse_output(text)
    if parsed.tool_calls and reason is FinishReason.STOP:
        reason = FinishReason.TOOL_CALLS
    return Choice(index, parsed.content, reason, logprobs, parsed.tool_calls, prompt_logprobs)


class ToolDeltas:
    """A streamed chat's text deltas split, per choice, into content and calls (models/tools.py ToolCallStream):
    content at once, each call whole when it completes, the finish "tool_calls" when there were calls."""

    def __init__(self, tools: ToolPlan) -> None:
        self.parser = tools.parser
        self.index_to_stream: dict[int, ToolCallStream] = {}

    def split(self, delta: ChoiceDelta) -> ChoiceDelta | None:
        stream = self.index_to_stream.setdefault(delta.index, ToolCallStream(self.parser))
        part = stream.feed(delta.text)
        content, calls, reason = part.content, part.tool_calls, delta.finish_reason
        if reason is not None:
            last, _ = stream.finish()
            content, calls = content + last.content, calls + last.tool_calls
            if stream.calls and reason is FinishReason.STOP:
                reason = FinishReason.TOOL_CALLS
        if not content and not calls and reason is None and not delta.logprobs and delta.prompt_logprobs is None:
            return None
        return ChoiceDelta(delta.index, content, delta.logprobs, reason, calls, delta.prompt_logprobs)
