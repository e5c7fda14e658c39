"""The engine's one door: typed messages in, outputs and statistics snapshots out.

Everything outside the engine (the HTTP gateway, metrics, /health, admin routes, the meter's feedback to
the fair-share policy) talks to an `EngineClient`, never to the engine's scheduler, KV manager or
policies. The in-process implementation is `async_engine.AsyncEngine` (the engine in its own thread);
the fleet adds replicas in other processes and on Ray behind the same interface, so everything that
crosses it is plain, picklable data: no callbacks into live objects, no shared mutable state.

This module imports no torch: a gateway, or a test of one, can hold a client without a model.

    messages in      AddRequest, AbortRequest, SetTenantWeight, ChargeEnergy, DrainReplica, Shutdown
    outputs out      RequestOutput per request (generate), RequestError / EngineDeadError
    steps out        StepStats to each `subscribe_steps` listener (the meter), off the engine's thread, in
                     step order, and always before the final output of any request in that step
    snapshots out    EngineStats: immutable, one per step (stats()); ReplicaState per engine behind the client
    facts            ModelInfo: what the model is and what it accepts (validation needs no engine);
                     EngineFacts: what the engine holds (device, weights, KV) and where it runs

`ClientBase` holds what every client keeps the same way (info, tokenizer, facts, why it stopped, the step
listeners), so the four clients (AsyncEngine, RemoteEngine, HTTPBackend, Fleet) write it once.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tokenfactory.types import ParameterError, PoolingParams, RequestOutput, SamplingParams, StepStats

if TYPE_CHECKING:
    from tokenfactory.config import ModelConfig
    from tokenfactory.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

StepListener = Callable[[StepStats], None]
# `generate`'s direct consumer: called on the client's own thread with a non-final output while the request's
# reader waits for it; True when it consumed the output (it is not yielded), False to decline (it is yielded).
DirectOutputs = Callable[[RequestOutput], bool]

# -- messages in --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    """A request of one of two kinds: generation (`SamplingParams`; `max_tokens=0` scores the prompt only) or an
    embedding (`PoolingParams`: prefill only, its output carries `embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    params: SamplingParams | PoolingParams
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
class DrainReplica:
    """No new work to one replica behind the client (its streams finish), or take it back (`drain` False).
    Only a fleet has replicas to drain; any other client ignores it (its `replica_states()` says kind)."""

    replica_id: str
    drain: bool = True


@dataclass(frozen=True)
class Shutdown:
    """Stop after the current step; open streams end with EngineDeadError."""


Message = AddRequest | AbortRequest | SetTenantWeight | ChargeEnergy | Shutdown
Control = SetTenantWeight | ChargeEnergy | AbortRequest | DrainReplica  # what `send` takes


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
    pooling: str = "last"  # how embeddings pool the hidden states (types.POOLING_METHODS)

    @property
    def embedding_size(self) -> int:
        return self.config.hidden_size

    def check_prompt(self, token_ids: list[int], generates: bool = True) -> None:
        """Ids in the vocabulary, non-empty, and room for at least one generated token when `generates`."""
        self.check_token_ids(token_ids)
        self.check_prompt_length(len(token_ids), generates)

    def check_token_ids(self, token_ids: list[int]) -> None:
        vocab = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise ParameterError("prompt", f"prompt token ids must be integers in [0, {vocab})")

    def check_prompt_length(self, num_prompt_tokens: int, generates: bool = True) -> None:
        if num_prompt_tokens == 0:
            raise ParameterError("prompt", "the prompt is empty: it needs at least one model token")
        if not generates and num_prompt_tokens > self.max_model_len:
            raise ParameterError(
                "prompt", f"the prompt has {num_prompt_tokens} model tokens but this model's context window "
                f"(max_model_len) is {self.max_model_len} tokens; shorten the prompt")
        if generates and num_prompt_tokens >= self.max_model_len:
            raise ParameterError(
                "prompt", f"the prompt has {num_prompt_tokens} model tokens but this model's context window "
                f"(max_model_len) is {self.max_model_len} tokens, which must also leave room for at least "
                f"one generated token; shorten the prompt")

    def check_params(self, params: SamplingParams | PoolingParams) -> None:
        """What the params cannot check alone: values that depend on this model."""
        if isinstance(params, PoolingParams):
            if params.dimensions is not None and params.dimensions > self.embedding_size:
                raise ParameterError("dimensions", f"dimensions must be at most this model's embedding size, "
                                     f"{self.embedding_size}, got {params.dimensions}")
            return
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ParameterError("stop_token_ids", f"stop_token_ids must be token ids of this model, in "
                                 f"[0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t, _ in params.logit_bias):
            bad = next(t for t, _ in params.logit_bias if not 0 <= t < self.vocab_size)
            raise ParameterError("logit_bias", f"logit_bias keys must be token ids of this model, in "
                                 f"[0, {self.vocab_size}), got {bad}")


@dataclass(frozen=True)
class EngineFacts:
    """What an engine holds and where it runs: fixed once it is ready (the start-up banner, the dashboard's
    memory split, /fleet/replicas). None: this client cannot know it (an external server's weights)."""

    model_path: str
    device: str
    dtype: str | None = None
    weight_bytes: int | None = None  # resident (packed and any dense copy)
    kv_bytes: int | None = None
    kv_blocks: int | None = None
    kv_tokens: int | None = None
    max_model_len: int | None = None
    max_concurrent_seqs: float | None = None  # sequences of max_model_len tokens the KV cache holds at once
    pid: int | None = None  # a local process's or Ray actor's
    url: str | None = None  # an external server's
    node: str | None = None  # the Ray node (its address) a replica runs on
    node_id: str | None = None  # Ray's id of that node
    energy_source: str | None = None  # a replica that meters itself: its power source (None: the gateway's)
    router: str | None = None  # a fleet's routing policy

    @property
    def where(self) -> str:
        """pid 123 on node 10.0.0.5, a URL, or '' (in this process)."""
        parts = [f"pid {self.pid}"] if self.pid is not None else []
        if self.node is not None:
            parts.append(f"on node {self.node}")
        return self.url or " ".join(parts)


@dataclass(frozen=True)
class ReplicaState:
    """One engine behind a client as it stands: a single engine is one ("local"), a fleet has one per replica.
    The counters are the fleet's routing (zero for a single engine)."""

    replica_id: str
    kind: str  # engine | process | ray | backend (| local: an in-process engine inside a fleet)
    state: str  # ready | draining | down | restarting
    alive: bool
    stats: EngineStats
    facts: EngineFacts
    down_reason: str | None = None
    num_outstanding: int = 0
    outstanding_tokens: int = 0
    num_routed: int = 0
    num_rerouted_away: int = 0
    num_failed_mid_stream: int = 0
    num_restarts: int = 0
    last_route: str | None = None  # why the router last chose it

    @property
    def up(self) -> bool:
        """Taking new requests: alive and not draining."""
        return self.alive and self.state == "ready"


# -- what a worker in another process sends back (the fleet's replicas; engine/worker.py) ---------------------


@dataclass(frozen=True)
class WorkerReady:
    """A worker's first message: its model built and warmed up, and what it holds."""

    info: ModelInfo
    tokenizer: Tokenizer
    stats: EngineStats
    facts: EngineFacts


@dataclass(frozen=True)
class WorkerEvents:
    """What a worker made since its last batch: outputs, requests it failed alone, the steps' statistics (the
    meter's input), and its latest snapshot. An empty batch is a heartbeat."""

    outputs: tuple[RequestOutput, ...] = ()
    failures: tuple[RequestFailed, ...] = ()
    steps: tuple[StepStats, ...] = ()
    stats: EngineStats | None = None
    dead_reason: str | None = None  # set in the last batch of a worker whose engine stopped
    aborted: tuple[str, ...] = ()  # requests whose AbortRequest the worker applied (their steps are in this batch
    # or an earlier one): the reader that left waits for this


class EngineClient(Protocol):
    """The only way into an engine (see the module's docstring). Nothing outside engine/ reads anything of a
    client but these (tests/test_layering.py checks it)."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def facts(self) -> EngineFacts: ...

    @property
    def is_alive(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    def start(self) -> None: ...

    def subscribe_steps(self, listener: StepListener) -> None:
        """Call `listener` with every step's StepStats from now on: never on the engine's thread, in step
        order, and before the final output of any request in that step reaches its stream (the meter settles
        a request right after its final output: it has seen every step). A listener that raises is logged and
        skipped; the engine goes on. Keep it cheap: it delays final outputs, not steps."""
        ...

    def replica_states(self) -> tuple[ReplicaState, ...]:
        """Each engine behind this client (one for a single engine): for /fleet/replicas, /health, the dashboard."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None: ...

    def generate(self, request: AddRequest, direct: DirectOutputs | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs; leaving early aborts it. Raises RequestError (this request
        failed) or EngineDeadError (the engine stopped). `direct`: a consumer the client may offer non-final
        outputs to on its own thread while the reader waits for them (the in-process engine does; the others
        ignore it); each one it takes is not yielded."""
        ...

    def send(self, message: Control) -> None: ...

    def stats(self) -> EngineStats:
        """The latest snapshot (cheap: no call into the engine thread)."""
        ...


class ClientBase:
    """What every EngineClient keeps the same way: the model's info and tokenizer, its facts, why it stopped,
    and its step listeners (called through `publish_step`, each guarded). `kind` names it in replica_states."""

    kind = "engine"

    def __init__(self, info: ModelInfo, tokenizer: Tokenizer, facts: EngineFacts) -> None:
        self._info, self._tokenizer, self._facts = info, tokenizer, facts
        self._dead_reason: str | None = None
        self._step_listeners: list[StepListener] = []
        self.num_listener_errors = 0

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer  # immutable after load: the gateway tokenizes on its side

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def subscribe_steps(self, listener: StepListener) -> None:
        self._step_listeners = [*self._step_listeners, listener]  # copied: a publisher iterates without a lock

    def publish_step(self, step: StepStats) -> None:
        """Each listener in turn; one that raises is logged (its first failure in full) and the rest still run."""
        for listener in self._step_listeners:
            try:
                listener(step)
            except Exception:  # a listener's bug (the meter's, a policy's) must not stop the engine
                self.num_listener_errors += 1
                if self.num_listener_errors == 1 or self.num_listener_errors % 1000 == 0:
                    logger.exception("a step listener failed (%d failures so far)", self.num_listener_errors)

    def stats(self) -> EngineStats:
        raise NotImplementedError

    def replica_states(self) -> tuple[ReplicaState, ...]:
        alive = self.is_alive
        return (ReplicaState("local", self.kind, "ready" if alive else "down", alive, self.stats(),
                             self.facts, self.dead_reason),)
