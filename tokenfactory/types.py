"""Shared nouns that cross module, thread and process boundaries.

Everything here is plain data: the engine, the server, the meter and the bench all speak in these
types, so none of them has to import another's internals.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Documented ranges (docs/server.md), checked where a value enters: pydantic at the API, SamplingParams offline.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 16
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary: the sampler caps it at the model's
MAX_TOKENS = 10**9
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
# A grammar's source (a JSON schema's text, a regex, a grammar): past this it is refused before any compile.
# 20 tool definitions with rich schemas are ~15 kB; a schema of 256 KiB is already far beyond what a model fills.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for each token's bias: -100 (never) .. 100 (only that token)
MAX_LOGIT_BIAS_TOKENS = 1024
POOLING_METHODS = ("last", "mean")  # embeddings: the last prompt token's hidden state, or the mean of all

# Priority bands: a tenant's band name -> Sequence.priority; lower is admitted first. Shared by the tenant
# store (which validates names) and the fair-share policies (which order by it).
BANDS: dict[str, int] = {"interactive": 0, "standard": 1, "batch": 2}


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the context window is full
    ABORT = "abort"  # the client went away or the caller aborted
    ERROR = "error"  # the engine failed while serving this request (RequestOutput.error says why)
    TOOL_CALLS = "tool_calls"  # the answer is tool calls (the request service parses them; never the engine)

    def __str__(self) -> str:
        return self.value


class GrammarKind(enum.StrEnum):
    """What constrains a request's output (constrained decoding, engine/grammar.py)."""

    JSON_SCHEMA = "json_schema"  # JSON valid against a schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"  # exactly one of a list of strings
    GRAMMAR = "grammar"  # a Lark grammar (llguidance's dialect: %json {schema} inlines a schema), or GBNF/EBNF

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class GrammarSpec:
    """A request's output constraint. `source` is the schema as JSON text, the regex, the choices as a JSON
    list, or the grammar text; the (kind, source) pair is the compile cache's key. `param` is the request field
    it came from (`response_format.json_schema.schema`, `guided_regex`, ...): errors name it. The cheap checks
    run here; whether the library can compile it is engine/grammar.py's `validate_grammar`."""

    kind: GrammarKind
    source: str = ""
    param: str = field(default="grammar", compare=False)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", GrammarKind(self.kind))
        except ValueError:
            raise ParameterError(self.param, f"{self.param}: the kind must be one of {', '.join(GrammarKind)}, "
                                 f"got {self.kind!r}") from None
        _check(isinstance(self.source, str), self.param, "must be a string")
        _check(len(self.source) <= MAX_GRAMMAR_CHARS, self.param,
               f"is too large: {len(self.source)} characters, at most {MAX_GRAMMAR_CHARS}")
        if self.kind is GrammarKind.JSON_OBJECT:
            return
        _check(bool(self.source.strip()), self.param, "must not be empty")
        if self.kind is GrammarKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.source)
            except ValueError as e:
                raise ParameterError(self.param, f"{self.param} is not valid JSON: {e}") from None
            _check(isinstance(schema, dict | bool), self.param, "must be a JSON schema (an object)")
        elif self.kind is GrammarKind.CHOICE:
            try:
                choices = json.loads(self.source)
            except ValueError:
                choices = None
            _check(isinstance(choices, list) and 1 <= len(choices) <= MAX_CHOICES
                   and all(isinstance(c, str) and c for c in choices), self.param,
                   f"must be a list of 1 to {MAX_CHOICES} non-empty strings")

    @classmethod
    def json_schema(cls, schema: Mapping[str, object] | bool | str, param: str = "json_schema") -> GrammarSpec:
        if isinstance(schema, str):
            return cls(GrammarKind.JSON_SCHEMA, schema, param)
        try:  # property order is kept: it is the order the model writes them in
            text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise ParameterError(param, f"{param} is not JSON: {e}") from None
        return cls(GrammarKind.JSON_SCHEMA, text, param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> GrammarSpec:
        return cls(GrammarKind.JSON_OBJECT, "", param)

    @classmethod
    def regex(cls, pattern: str, param: str = "regex") -> GrammarSpec:
        return cls(GrammarKind.REGEX, pattern, param)

    @classmethod
    def choice(cls, choices: Sequence[str], param: str = "choice") -> GrammarSpec:
        _check(not isinstance(choices, str) and isinstance(choices, Sequence), param, "must be a list of strings")
        return cls(GrammarKind.CHOICE, json.dumps(list(choices), ensure_ascii=False), param)

    @classmethod
    def grammar(cls, text: str, param: str = "grammar") -> GrammarSpec:
        return cls(GrammarKind.GRAMMAR, text, param)


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
    max_tokens: int | None = 16  # None: until the context window is full; 0: score the prompt, generate nothing
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen one)
    prompt_logprobs: int | None = None  # the same for each prompt token (the first has none: nothing precedes it)
    # Token id -> a bias added to its logit before sampling, in [-100, 100] (OpenAI's logit_bias). A mapping is
    # accepted and kept as (id, bias) pairs sorted by id, so the params stay immutable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculative: bool = True  # per-request opt-out of speculative decoding
    grammar: GrammarSpec | None = None  # constrained decoding: the output follows it (engine/grammar.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, int | float) and math.isfinite(value), name,
                   f"must be a finite number, got {value}")
        _check(1 <= self.n <= MAX_N, "n", f"must be between 1 and {MAX_N}, got {self.n}")
        _check(0.0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
               f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0 <= self.top_k <= MAX_TOP_K, "top_k", f"must be -1, 0 (off) or in [1, {MAX_TOP_K}], got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
               f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed",
               f"must be a 64-bit signed integer, in [{INT64_MIN}, {INT64_MAX}], got {self.seed}")
        _check(self.max_tokens is None or 0 <= self.max_tokens <= MAX_TOKENS, "max_tokens",
               f"must be between 0 and {MAX_TOKENS}, got {self.max_tokens}")
        _check(0 <= self.min_tokens <= MAX_TOKENS, "min_tokens", f"must be between 0 and {MAX_TOKENS}, "
               f"got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
               f"must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings, "
               f"got {len(self.stop)}")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")
        _check(all(isinstance(t, int) and 0 <= t <= MAX_TOP_K for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative token ids")
        _check(self.grammar is None or isinstance(self.grammar, GrammarSpec), "grammar",
               f"must be a GrammarSpec, got {type(self.grammar).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def prompt_only(self) -> bool:
        """Nothing is generated: the prompt is computed (its logprobs, an embedding) and the request ends."""
        return self.max_tokens == 0


def _logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """A mapping or pairs of token id -> bias, checked, as (id, bias) pairs sorted by id."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(token_id, bias) for token_id, bias in items]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ParameterError("logit_bias", "logit_bias must map token ids to biases") from None
    for token_id, bias in pairs:
        _check(isinstance(token_id, int) and not isinstance(token_id, bool) and 0 <= token_id <= MAX_TOP_K,
               "logit_bias", f"keys must be token ids (non-negative integers), got {token_id!r}")
        _check(isinstance(bias, int | float) and not isinstance(bias, bool) and math.isfinite(bias)
               and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias",
               f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r} for token "
               f"{token_id}")
    _check(len(pairs) <= MAX_LOGIT_BIAS_TOKENS, "logit_bias",
           f"may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(pairs)}")
    _check(len({t for t, _ in pairs}) == len(pairs), "logit_bias", "names a token id twice")
    return tuple(sorted((t, float(b)) for t, b in pairs))


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: the prompt is computed (prefill only, no token generated) and its hidden states
    pooled into one vector, by the engine's pooling method (the model's own, or `EngineConfig.pooling`)."""

    normalize: bool = True  # unit length (L2), as OpenAI's embeddings are
    dimensions: int | None = None  # keep the first `dimensions` values, then normalise (Matryoshka truncation)

    def __post_init__(self) -> None:
        _check(self.dimensions is None or (isinstance(self.dimensions, int) and self.dimensions >= 1),
               "dimensions", f"must be a positive integer, got {self.dimensions!r}")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParameterError(param, f"{param} {message}")


class MissingExtra(RuntimeError):
    """An optional dependency a command needs is not installed; the message says what to pip install."""


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
    rank: int | None = None  # 1: the most likely token (prompt logprobs carry it, as vLLM's do)


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
    error: str | None = None  # set when the engine failed this request alone (its outputs end with ERROR)
    error_param: str | None = None  # the request parameter that caused `error`, when one did (a client error)
    # Output tokens the grammar forced (appended without a decode step of their own; engine/grammar.py).
    num_forced_tokens: int = 0
    # An external backend's own count of its completion tokens (fleet/backend.py), and where the counts come
    # from: None for our engine's; "backend" (its usage) or "tokenizer" (it sent none: our tokenizer counted).
    num_completion_tokens_reported: int | None = None
    tokens_source: str | None = None
    replica: str | None = None  # the fleet's replica that made it (None: a single engine)
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing precedes it), else
    # the token's own logprob followed by the top ones. Set in every output once the prompt is computed.
    prompt_logprobs: list[list[Logprob] | None] | None = None
    embedding: list[float] | None = None  # a PoolingParams request's vector, in its last output

    @property
    def finished(self) -> bool:
        return self.error is not None or all(o.finished for o in self.outputs)

    @property
    def num_completion_tokens(self) -> int:
        if self.num_completion_tokens_reported is not None:
            return self.num_completion_tokens_reported
        return sum(len(c.token_ids) for c in self.outputs)


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
    # Constrained decoding: sequences under a grammar this step, and output tokens the grammar forced in it
    # (appended for the next step to compute as one chunk: decode steps that never run, so no joules).
    num_constrained: int = 0
    num_forced_tokens: int = 0
    # Set by a replica that meters its own node (fleet/node_energy.py): where the step ran and whose power
    # source measured it. None: the gateway's meter measures it.
    node: str | None = None
    energy_source: str | None = None

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(self.num_total_blocks, 1)
