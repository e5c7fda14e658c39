"""What the request service returns: typed results, never rendered JSON.

    CompletionResult   a finished chat or text completion: its choices and its `Usage`
    CompletionStream   the same, streamed: `StreamStart`, then `ChoiceDelta`s, then `StreamEnd` (the usage) or
                       `StreamFailed`; closing it early aborts what has not finished and settles it as aborted
    Usage              model tokens, and the request's metered `RequestEnergy` (joules, their source, dollars)

The gateway renders them in OpenAI's shapes (gateway/render.py); the Batch API writes the same rendering
into its output file and sums the typed usage into the job's totals.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from tokenfactory.meter.attribution import RequestEnergy
from tokenfactory.models.tools import ToolCall
from tokenfactory.types import FinishReason, Logprob, RequestOutput

Kind = Literal["chat", "text"]


@dataclass(frozen=True)
class CompressionUsage:
    """Context compression's part of the usage (service/compression.py)."""

    compressed_prompt_tokens: int
    summary_tokens: int
    summary_request_id: str


@dataclass(frozen=True)
class Usage:
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    tokens_source: str | None = None  # an external backend served it: whose counts these are
    energy: RequestEnergy | None = None  # None: this server runs without a meter
    compression: CompressionUsage | None = None
    # Output tokens a grammar forced (no decode step of their own); None: the request had no grammar.
    num_forced_tokens: int | None = None

    @property
    def num_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_completion_tokens

    @classmethod
    def of(cls, finals: list[RequestOutput], energy: RequestEnergy | None,
           compression: CompressionUsage | None = None, constrained: bool = False) -> Usage:
        sources = {o.tokens_source for o in finals if o.tokens_source is not None}
        return cls(sum(len(o.prompt_token_ids) for o in finals), sum(o.num_completion_tokens for o in finals),
                   sum(o.num_cached_tokens for o in finals), "+".join(sorted(sources)) or None, energy, compression,
                   sum(o.num_forced_tokens for o in finals) if constrained else None)


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt's logprobs (SamplingParams.prompt_logprobs): its first token's text (nothing precedes it, so it
    has no logprob), then per later token its own Logprob followed by the top ones."""

    first_token: str
    entries: list[list[Logprob]]

    @classmethod
    def of(cls, out: RequestOutput, first_token: str) -> PromptLogprobs | None:
        if out.prompt_logprobs is None or any(e is None for e in out.prompt_logprobs[1:]):
            return None
        return cls(first_token, [e for e in out.prompt_logprobs[1:] if e is not None])


@dataclass(frozen=True)
class Choice:
    index: int
    text: str | None  # None: an answer that is only tool calls
    finish_reason: FinishReason | None
    logprobs: list[list[Logprob]] | None
    tool_calls: tuple[ToolCall, ...] = ()
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True)
class PromptRendering:
    """How a request shows its prompt's logprobs: `echo_logprobs` top ones per prompt token inside the completion's
    logprobs (echo with logprobs), `prompt_logprobs` top ones in vLLM's separate field; None: not shown."""

    echo_logprobs: int | None = None
    prompt_logprobs: int | None = None


NO_PROMPT_LOGPROBS = PromptRendering()


@dataclass(frozen=True)
class CompletionResult:
    kind: Kind
    request_id: str
    model: str
    created: int
    choices: tuple[Choice, ...]
    usage: Usage
    prompt: PromptRendering = NO_PROMPT_LOGPROBS


@dataclass(frozen=True)
class EmbeddingResult:
    request_id: str
    model: str
    created: int
    embeddings: tuple[list[float], ...]  # one per input, in order
    usage: Usage


@dataclass(frozen=True)
class TokenizeResult:
    token_ids: list[int]
    max_model_len: int
    token_strs: list[str] | None  # each token decoded alone (return_token_strs)


@dataclass(frozen=True)
class StreamStart:
    """The stream's opening: each choice's index and the text it starts with (its echoed prompt, or "")."""

    choice_to_prefix: tuple[tuple[int, str], ...]
    echo: bool = False


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    text: str
    logprobs: list[list[Logprob]] | None
    finish_reason: FinishReason | None
    tool_calls: tuple[tuple[int, ToolCall], ...] = ()  # calls completed in this delta, with their index
    prompt_logprobs: PromptLogprobs | None = None  # with a choice's first delta, when the request asked for them


@dataclass(frozen=True)
class StreamEnd:
    usage: Usage


@dataclass(frozen=True)
class StreamFailed:
    message: str
    code: str  # request_failed | engine_unavailable
    param: str | None = None  # the request field to blame, when the client's input caused it


StreamEvent = StreamStart | ChoiceDelta | StreamEnd | StreamFailed


class DirectDeltas:
    """Where a stream's plain deltas may go without the event loop: `consumer` (set by whoever writes the stream
    out) is called on the engine's thread with a `ChoiceDelta` while the stream's reader waits for it, and says
    whether it took it (False: the delta comes through the stream's events instead)."""

    def __init__(self) -> None:
        self.consumer: Callable[[ChoiceDelta], bool] | None = None


class CompletionStream:
    """A streamed completion: iterate its events once; `aclose()` (always call it) ends it — aborting the
    engine requests that have not finished and settling the request as aborted if it did not finish."""

    def __init__(self, kind: Kind, request_id: str, model: str, created: int, events: AsyncIterator[StreamEvent],
                 on_close: Callable[[], Awaitable[None]], prompt: PromptRendering = NO_PROMPT_LOGPROBS,
                 direct: DirectDeltas | None = None) -> None:
        self.kind, self.request_id, self.model, self.created = kind, request_id, model, created
        self._events, self._on_close = events, on_close
        self.prompt = prompt
        self._direct = direct

    def send_directly(self, consumer: Callable[[ChoiceDelta], bool]) -> bool:
        """Offer this stream's plain deltas (those of one choice, not its first or last, no tool calls held back)
        to `consumer` on the engine's thread, before iterating: what it takes is not among the events. False
        when this stream cannot (several prompts or choices, or tool calls parsed out of its text). An engine
        client that offers no outputs (all but the in-process engine) never calls it."""
        if self._direct is None:
            return False
        self._direct.consumer = consumer
        return True

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._events

    async def aclose(self) -> None:
        try:
            await self._events.aclose()  # type: ignore[attr-defined]
        finally:
            await self._on_close()
