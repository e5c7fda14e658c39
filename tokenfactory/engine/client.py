"""The engine's one door: typed messages in, outputs and statistics snapshots out.

Everything outside the engine (the HTTP gateway, metrics, /health, admin routes, the meter's feedback to
the fair-share policy) talks to an `EngineClient`, never to the engine's scheduler, KV manager or
policies. The in-process implementation is `async_engine.AsyncEngine` (the engine in its own thread);
the fleet adds replicas in other processes and on Ray behind the same interface, so everything that
crosses it is plain, picklable data: no callbacks into live objects, no shared mutable state.

This module imports no torch: a gateway, or a test of one, can hold a client without a model.

    messages in      AddRequest, AbortRequest, SetTenantWeight, ChargeEnergy, Shutdown
    outputs out      RequestOutput per request (generate), RequestError / EngineDeadError
    snapshots out    EngineStats: immutable, one per step (stats())
    facts            ModelInfo: what the model is and what it accepts (validation needs no engine)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tokenfactory.types import ParameterError, RequestOutput, SamplingParams, StepStats

if TYPE_CHECKING:
    from tokenfactory.config import ModelConfig
    from tokenfactory.models.tokenizer import Tokenizer

# -- messages in --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    arrival_time: float
    tenant: str
    priority: int
    user: str | None = None  # the API's `user`: a fleet may keep a session on one replica


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class SetTenantWeight:
    """The fair-share weight of a tenant's future service (admin routes, the tenant table)."""

    tenant: str
    weight: float


@dataclass(frozen=True)
class ChargeEnergy:
    """Joules the meter attributed to requests (per step, as it measured them): the joule-counting fair
    share charges their tenants. The engine never reads a power source itself."""

    request_id_to_joules: Mapping[str, float]


@dataclass(frozen=True)
class Shutdown:
    """Stop after the current step; open streams end with EngineDeadError."""


Message = AddRequest | AbortRequest | SetTenantWeight | ChargeEnergy | Shutdown


class EngineDeadError(RuntimeError):
    """The engine stopped: every request fails until a restart."""


class RequestError(RuntimeError):
    """The engine failed this request alone; it goes on serving the others. `param`: the request parameter to
    blame when the client's input caused it (a grammar that cannot be compiled): the HTTP layer's 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestFailed:
    """A request the engine could not take or failed (a worker's batch, a stream's last item), or every
    request of an engine that stopped (`fatal`)."""

    request_id: str
    message: str
    fatal: bool = False
    param: str | None = None  # the parameter to blame, when the client's input caused it


# -- what comes out ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeculativeMetrics:
    """What /metrics shows: the counters, the current decision and its evidence."""

    method: str
    num_speculative_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_emitted_tokens: int
    accepted_by_position: tuple[int, ...]
    drafted_by_position: tuple[int, ...]
    time_saved_s: float
    enabled: bool
    acceptance_rate: float
    break_even_acceptance: float  # at the current batch size
    break_even_batch: int  # largest batch at which drafting pays at the method's acceptance (0: none)
    batch_size: int
    step_base_s: float  # cost model at the current batch B: T(B), a plain decode step (seconds)
    step_per_token_s: float  # (T(B (1 + k)) - T(B)) / (B k): a draft row's verification (seconds)
    draft_per_token_s: float  # the proposer's seconds per draft token
    num_decision_changes: int


@dataclass(frozen=True)
class GrammarMetrics:
    """Constrained decoding's counters (engine/grammar.py), for /metrics."""

    num_requests: int  # constrained requests submitted
    num_compiles: int  # grammars compiled (cache misses)
    num_cache_hits: int
    num_failures: int  # requests failed for their grammar: invalid, too costly, past the time limit
    compile_seconds: float  # summed over compiles
    num_forced_tokens: int  # output tokens appended without a decode step of their own
    num_spec_skipped: int  # (sequence, step) pairs speculative decoding stepped aside for


@dataclass(frozen=True)
class EngineStats:
    """The engine as one step left it: counts, KV blocks, token and cache counters, timings."""

    time: float  # time.monotonic() of the snapshot
    num_steps: int
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences waiting in the scheduler, plus requests not yet taken from the inbox
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_prefix_queries: int  # prompt tokens looked up in the prefix cache
    num_prefix_hits: int
    num_preemptions: int
    num_failed_requests: int  # failed alone by fault isolation
    last_step_s: float | None
    last_step_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    speculative: SpeculativeMetrics | None = None
    grammar: GrammarMetrics | None = None
    alive: bool = True
    dead_reason: str | None = None

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / max(self.num_kv_blocks, 1)


@dataclass(frozen=True)
class ModelInfo:
    """What a client needs to know of the model to validate a request before sending it."""

    path: str
    max_model_len: int
    vocab_size: int
    config: ModelConfig  # the model's shape (FLOPs for the meter, planner figures)
    device: str = "cpu"
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # The machine profile the engine runs with (engine/tuning.py MachineProfile.summary), None when off.
    machine_profile: dict[str, Any] | None = None

    def check_prompt(self, token_ids: list[int]) -> None:
        """Ids in the vocabulary, non-empty, and room for at least one generated token."""
        self.check_token_ids(token_ids)
        self.check_prompt_length(len(token_ids))

    def check_token_ids(self, token_ids: list[int]) -> None:
        vocab = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise ParameterError("prompt", f"prompt token ids must be integers in [0, {vocab})")

    def check_prompt_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens == 0:
            raise ParameterError("prompt", "the prompt is empty: it needs at least one model token")
        if num_prompt_tokens >= self.max_model_len:
            raise ParameterError(
                "prompt", f"the prompt has {num_prompt_tokens} model tokens but this model's context window "
                f"(max_model_len) is {self.max_model_len} tokens, which must also leave room for at least "
                f"one generated token; shorten the prompt")

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: values that depend on this model."""
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ParameterError("stop_token_ids", f"stop_token_ids must be token ids of this model, in "
                                 f"[0, {self.vocab_size})")


# -- what a worker in another process sends back (the fleet's replicas; engine/worker.py) ---------------------


@dataclass(frozen=True)
class WorkerReady:
    """A worker's first message: its model built and warmed up. `facts` are the start-up banner's figures."""

    info: ModelInfo
    tokenizer: Tokenizer
    stats: EngineStats
    facts: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerEvents:
    """What a worker made since its last batch: outputs, requests it failed alone, the steps' statistics (the
    meter's input), and its latest snapshot. An empty batch is a heartbeat."""

    outputs: tuple[RequestOutput, ...] = ()
    failures: tuple[RequestFailed, ...] = ()
    steps: tuple[StepStats, ...] = ()
    stats: EngineStats | None = None
    dead_reason: str | None = None  # set in the last batch of a worker whose engine stopped


class EngineClient(Protocol):
    """The only way into an engine (see the module's docstring)."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def is_alive(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...

    def generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs; leaving early aborts it. Raises RequestError (this request
        failed) or EngineDeadError (the engine stopped)."""
        ...

    def send(self, message: SetTenantWeight | ChargeEnergy | AbortRequest) -> None: ...

    def stats(self) -> EngineStats:
        """The latest snapshot (cheap: no call into the engine thread)."""
        ...
