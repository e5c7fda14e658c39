"""Shared nouns that cross module, thread and process boundaries.

Everything here is plain data: the engine, the server, the meter and the bench all speak in these
types, so none of them has to import another's internals.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the context window is full
    ABORT = "abort"  # the client went away or the caller aborted

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Validated on construction; a bad value raises a
    ValueError whose message names the parameter (the server turns it into a 400)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the context window is full
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen one)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculative: bool = True  # per-request opt-out of speculative decoding

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
               f"must be between 0 and 20, got {self.logprobs}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParameterError(param, f"{param} {message}")


class ParameterError(ValueError):
    """A ValueError that knows which parameter was wrong (the server reports it as `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Logprob:
    token_id: int
    logprob: float
    token: str


@dataclass
class CompletionOutput:
    """One of the n sequences of a request, as seen so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[Logprob]] | None = None  # per generated token: chosen first, then the top ones
    finish_reason: FinishReason | None = None
    # Streaming: what is new since the previous output for this request.
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[list[Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of a request's milestones, and its share of the work."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step (or at the end, for the offline API)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


@dataclass(frozen=True)
class SequenceWork:
    """What one sequence got in one step: the meter splits the step's energy by this."""

    request_id: str
    num_new_tokens: int  # tokens computed this step
    num_context_tokens: int  # tokens already in the KV cache before this step (attention reads them)
    is_prefill: bool


@dataclass(frozen=True)
class StepStats:
    """Per-step statistics, recorded by the step loop as data (never logged inside the loop)."""

    step_index: int
    start_time: float  # time.monotonic()
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int  # preemptions that happened in this step
    work: tuple[SequenceWork, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(self.num_total_blocks, 1)
