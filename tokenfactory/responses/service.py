"""The Responses API over the request service: a response is one chat call (tools, structured outputs,
admission, metering and its ledger row are chat's, the row under the response's id), its input and output
kept per tenant when stored, continued with `previous_response_id`, or run in the background.

    api.create(call, body)              -> the Response object, or an async iterator of its stream's events
    api.retrieve/delete/cancel(principal, id), api.input_items(principal, id, after, limit, order)

A background response is stored `queued` and answered at once; its own task runs it under a `Call` of its
own (its cancel signal is the cancel route's, not the HTTP request's) and stores it when it ends: completed,
incomplete, failed or cancelled (billed for what was made, as any cancelled call). Like a batch line, one that a
stopping (or dying) server cuts off stays in_progress and runs again from the start at the next start, under the
same id, whose ledger row supersedes the cut-off attempt's (billed once); failed if its tenant is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pydantic

from tokenfactory.responses.protocol import ResponsesRequest, input_items, item_messages, responses_param
from tokenfactory.responses.render import EventWriter, ResponseState, call_item, message_item, new_id, response_usage
from tokenfactory.responses.store import RUNNING_STATUSES, ResponseStore, StoredResponse
from tokenfactory.service.call import Call, Principal
from tokenfactory.service.errors import APIError, Cancelled
from tokenfactory.service.protocol import ChatCompletionRequest
from tokenfactory.service.results import ChoiceDelta, CompletionResult, CompletionStream, StreamEnd, StreamFailed
from tokenfactory.service.service import RequestService
from tokenfactory.types import FinishReason, ParameterError

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 3600.0
CANCEL_WAIT_S = 30.0
MAX_LIST_LIMIT = 100


class ResponseEvents:
    """A streamed response's events: iterate once; `aclose()` (always call it) ends the chat stream under it,
    even if iteration never began (an async generator that never started runs no `finally`)."""

    def __init__(self, events: AsyncIterator[dict[str, Any]], stream: CompletionStream) -> None:
        self._events, self._stream = events, stream

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._events

    async def aclose(self) -> None:
        try:
            await self._events.aclose()  # type: ignore[attr-defined] - an async generator
        finally:
            await self._stream.aclose()


class ResponsesAPI:
    def __init__(self, service: RequestService, store: ResponseStore | None,
                 principal_of_tenant: Callable[[str], Principal | None] | None = None) -> None:
        """`principal_of_tenant` (blocking): whom a resumed background response runs as (None: the tenant is gone;
        without it, such responses fail at start-up)."""
        self.service, self.store, self.principal_of_tenant = service, store, principal_of_tenant
        self.id_to_task: dict[str, asyncio.Task] = {}
        self.id_to_call: dict[str, Call] = {}
        self.stopping = False
        self._sweeper: asyncio.Task | None = None

    # -- the app's lifetime -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.store is None:
            return
        for run in await asyncio.to_thread(self.store.running):
            await self._resume(run)
        self._sweeper = asyncio.ensure_future(self._sweep())

    async def _resume(self, run: StoredResponse) -> None:
        """A background response a stopped server left running, run again from the start under its id (the
        ledger's row for the cut-off attempt is superseded by this one's: billed once, as a batch line)."""
        lookup = self.principal_of_tenant
        principal = await asyncio.to_thread(lookup, run.tenant) if lookup is not None else None
        try:
            if principal is None or run.request_json is None:
                raise ParameterError("background", "the server stopped before this response ended and it cannot "
                                     "run again (its tenant is gone)")
            body = ResponsesRequest.model_validate_json(run.request_json)
            system = [{"role": "system", "content": body.instructions}] if body.instructions else []
            chat = body.chat_request(system + run.messages)
        except (ParameterError, pydantic.ValidationError) as e:
            failed = run.response | {"status": "failed", "error": {"code": "server_error", "message": str(e)}}
            await asyncio.to_thread(self.store.put, run.tenant, failed, run.input_items, run.messages)
            return
        state = ResponseState(body, run.response["model"], response_id=run.response_id,
                              created_at=int(run.response["created_at"]))
        logger.info("responses: background response %s runs again after a restart", run.response_id)
        self._spawn(Call(principal, run.response_id), chat, state, run.input_items, run.messages)

    def _spawn(self, call: Call, chat: ChatCompletionRequest, state: ResponseState, items: list[dict[str, Any]],
               conversation: list[dict[str, Any]]) -> None:
        self.id_to_call[state.response_id] = call
        task = asyncio.ensure_future(self._background(call, chat, state, items, conversation))
        self.id_to_task[state.response_id] = task
        task.add_done_callback(lambda _: self._forget(state.response_id))

    async def stop(self) -> None:
        """Background responses still running are cut off and left running in the store: the next start runs them
        again."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for call in self.id_to_call.values():
            call.cancelled.set()
        await asyncio.gather(*self.id_to_task.values(), return_exceptions=True)

    async def _sweep(self) -> None:
        assert self.store is not None
        while True:
            try:
                await asyncio.to_thread(self.store.sweep)
            except Exception:  # noqa: BLE001 - a database hiccup; the next sweep retries (reads skip expired rows)
                logger.exception("responses: the retention sweep failed")
            await asyncio.sleep(SWEEP_INTERVAL_S)

    # -- create -------------------------------------------------------------------------------------------

    async def create(self, call: Call, body: ResponsesRequest) -> dict[str, Any] | ResponseEvents:
        body.check_supported()
        served = self.service.model(body.model)
        if body.background and self.store is None:
            raise ParameterError("background", "background responses need a ledger to be kept in; this server "
                                 "runs without one")
        history = await self._history(call.principal, body.previous_response_id)
        items = listed_items(input_items(body.input))
        new_messages = item_messages(items)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        chat = body.chat_request(system + history + new_messages)
        state = ResponseState(body, served.name, created_at=int(time.time()))
        conversation = history + new_messages
        if body.background:
            state.status = "queued"
            await self._save(call.principal, state, items, conversation)
            self._spawn(Call(call.principal, state.response_id, call.priority), chat, state, items, conversation)
            return state.body()
        inner = Call(call.principal, state.response_id, call.priority, call.cancelled)
        result = await run_chat(self.service, inner, chat)
        if isinstance(result, CompletionStream):
            return ResponseEvents(self._events(call.principal, result, state, items, conversation), result)
        finish(state, result)
        await self._save(call.principal, state, items, conversation + output_messages(state))
        return state.body()

    def _forget(self, response_id: str) -> None:
        self.id_to_task.pop(response_id, None)
        self.id_to_call.pop(response_id, None)

    async def _history(self, principal: Principal, previous_id: str | None) -> list[dict[str, Any]]:
        if previous_id is None:
            return []
        found = await asyncio.to_thread(self.store.get, previous_id, self.visible_tenant(principal)) \
            if self.store is not None else None
        if found is None:
            raise APIError(404, f"previous response with id {previous_id!r} not found", "invalid_request_error",
                           "previous_response_id")
        if found.status in ("queued", "in_progress"):
            raise APIError(400, f"previous response {previous_id!r} is still {found.status}: continue it once it "
                           "has ended", "invalid_request_error", "previous_response_id")
        return found.messages

    async def _background(self, call: Call, chat: ChatCompletionRequest, state: ResponseState,
                          items: list[dict[str, Any]], conversation: list[dict[str, Any]]) -> None:
        state.status = "in_progress"
        await self._save(call.principal, state, items, conversation)
        try:
            result = await run_chat(self.service, call, chat)
            assert isinstance(result, CompletionResult)  # a background response does not stream
            finish(state, result)
            conversation = conversation + output_messages(state)
        except Cancelled:
            if self.stopping:
                return  # left in_progress (with its request): the next start runs it again
            state.status = "cancelled"
        except APIError as e:
            state.status, state.error = "failed", {"code": e.code or e.type, "message": e.message}
        except ParameterError as e:
            state.status, state.error = "failed", {"code": "invalid_request_error", "message": str(e)}
        except Exception:  # noqa: BLE001 - this response fails alone; the log has why
            logger.exception("responses: background response %s failed", state.response_id)
            state.status, state.error = "failed", {"code": "server_error", "message": "internal server error"}
        await self._save(call.principal, state, items, conversation)

    async def _events(self, principal: Principal, stream: CompletionStream, state: ResponseState,
                      items: list[dict[str, Any]], conversation: list[dict[str, Any]]
                      ) -> AsyncIterator[dict[str, Any]]:
        writer = EventWriter(state)
        try:
            for event in writer.start():
                yield event
            reason: FinishReason | None = None
            async for event in stream:
                if isinstance(event, ChoiceDelta):
                    for out in writer.text_delta(event.text) if event.text else []:
                        yield out
                    for _, call in event.tool_calls:
                        for out in writer.call(call):
                            yield out
                    reason = event.finish_reason or reason
                elif isinstance(event, StreamEnd):
                    state.usage = response_usage(event.usage)
                elif isinstance(event, StreamFailed):
                    state.status, state.error = "failed", {"code": event.code, "message": event.message}
            if state.status != "failed":
                set_status(state, reason)
            closing = writer.end()
            await self._save(principal, state, items, conversation + output_messages(state))
            for event in closing:
                yield event
        finally:
            await stream.aclose()

    async def _save(self, principal: Principal, state: ResponseState, items: list[dict[str, Any]],
                    conversation: list[dict[str, Any]]) -> None:
        if self.store is not None and state.request.store:
            running = state.status in RUNNING_STATUSES
            await asyncio.to_thread(self.store.put, principal.tenant.name, state.body(), items, conversation,
                                    state.request.model_dump_json() if running else None)

    # -- stored responses -------------------------------------------------------------------------------------

    def visible_tenant(self, principal: Principal) -> str | None:
        """The tenant whose responses the caller may see (None: any; an admin's key, or auth off)."""
        return None if principal.is_admin or not self.service.tenancy.auth_on else principal.tenant.name

    async def _stored(self, principal: Principal, response_id: str) -> Any:  # noqa: ANN401 - StoredResponse
        found = None
        if self.store is not None:
            found = await asyncio.to_thread(self.store.get, response_id, self.visible_tenant(principal))
        if found is None:
            raise APIError(404, f"no response with id {response_id!r}", "invalid_request_error", "response_id")
        return found

    async def retrieve(self, principal: Principal, response_id: str) -> dict[str, Any]:
        return (await self._stored(principal, response_id)).response

    async def delete(self, principal: Principal, response_id: str) -> dict[str, Any]:
        await self._stored(principal, response_id)
        if (call := self.id_to_call.get(response_id)) is not None:
            call.cancelled.set()  # a running background response deleted: nothing would read its answer
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self.id_to_task[response_id]), CANCEL_WAIT_S)
        assert self.store is not None
        await asyncio.to_thread(self.store.delete, response_id, self.visible_tenant(principal))
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, principal: Principal, response_id: str) -> dict[str, Any]:
        found = await self._stored(principal, response_id)
        if not found.response.get("background"):
            raise APIError(400, "only background responses can be cancelled", "invalid_request_error", "response_id")
        call, task = self.id_to_call.get(response_id), self.id_to_task.get(response_id)
        if call is not None and task is not None:
            call.cancelled.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), CANCEL_WAIT_S)
        return await self.retrieve(principal, response_id)

    async def input_items(self, principal: Principal, response_id: str, after: str | None, limit: int,
                          order: str) -> dict[str, Any]:
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise ParameterError("limit", f"limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}")
        if order not in ("asc", "desc"):
            raise ParameterError("order", f"order must be asc or desc, got {order!r}")
        items = (await self._stored(principal, response_id)).input_items
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise ParameterError("after", f"no input item with id {after!r} in response {response_id!r}")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


async def run_chat(service: RequestService, call: Call, chat: ChatCompletionRequest
                   ) -> CompletionResult | CompletionStream:
    """The chat call; an error naming one of chat's fields names it as the Responses request does."""
    try:
        return await service.chat(call, chat)
    except ParameterError as e:
        raise ParameterError(responses_param(e.param), str(e)) from e
    except APIError as e:
        if e.param is None:
            raise
        raise APIError(e.status, e.message, e.type, responses_param(e.param), e.code, e.headers) from e


# -- results as output items (pure) -------------------------------------------------------------------------


def finish(state: ResponseState, result: CompletionResult) -> None:
    """A chat result's first choice as the response's output: its text a message, each call an item."""
    choice = result.choices[0]
    if choice.text or not choice.tool_calls:
        state.output.append(message_item(new_id("msg"), choice.text or ""))
    state.output.extend(call_item(new_id("fc"), call) for call in choice.tool_calls)
    state.usage = response_usage(result.usage)
    set_status(state, choice.finish_reason)


def set_status(state: ResponseState, reason: FinishReason | None) -> None:
    if reason is FinishReason.LENGTH:
        state.status, state.incomplete_reason = "incomplete", "max_output_tokens"
    else:
        state.status = "completed"


def output_messages(state: ResponseState) -> list[dict[str, Any]]:
    """The response's output as the chat messages a continuation replays: one assistant turn."""
    text = "".join(part["text"] for item in state.output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in state.output if item["type"] == "function_call"]
    if not text and not calls:
        return []
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def listed_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as input_items.list returns them: each with an id, messages' text as content parts."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        listed = {**item, "type": kind}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            listed["content"] = [{"type": part, "text": item["content"]}]
        listed.setdefault("id", new_id({"message": "msg", "function_call": "fc"}.get(kind, "item")))
        if kind == "message":
            listed.setdefault("status", "completed")
        out.append(listed)
    return out

