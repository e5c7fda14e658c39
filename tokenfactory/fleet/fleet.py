"""The fleet: one `EngineClient` over many replicas of a model, so the gateway above it does not change.

    gateway (auth, admission, fair share, ledger)
        └─ Fleet.generate(request) ── router.choose(views) ─► RouteDecision ─► replica.client.generate
              replicas: in process (AsyncEngine), local processes / Ray actors (RemoteEngine), external
              OpenAI-compatible servers (HTTPBackend)

A request goes to the replica the routing policy chooses among the *routable* ones (alive, not draining).
If that replica dies before the request's first output, the request is re-routed to another (it has cost the
client nothing yet); after its first output, the request ends with a `RequestError` that names the replica,
so a streaming client gets an error event instead of a hang, and its ledger row is written as `failed`.

A supervisor thread checks the replicas every `check_interval_s`: a dead one leaves the routing set at once
(its streams already ended), and is restarted when it has a `restart` factory, with a back-off; it comes
back when its new worker is ready. `drain(replica_id)` stops new work to a replica and lets its streams
finish. Tenant weights go to every replica; an abort or the meter's joules to the replica holding the
request. The gateway owns admission, so limits and budgets hold across the fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenfactory.engine.client import (
    AbortRequest,
    AddRequest,
    ChargeEnergy,
    ClientBase,
    Control,
    DirectOutputs,
    DrainReplica,
    EngineClient,
    EngineDeadError,
    EngineFacts,
    EngineStats,
    ModelInfo,
    ReplicaState,
    RequestError,
    SetTenantWeight,
)
from tokenfactory.fleet.router import (
    EXPECTED_OUTPUT_TOKENS,
    ReplicaView,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    StepModel,
    make_router,
)
from tokenfactory.types import RequestOutput, StepStats

if TYPE_CHECKING:
    from tokenfactory.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class Replica:
    """One replica as the fleet keeps it. `restart` builds a fresh client (None: it stays down when it dies)."""

    replica_id: str
    client: EngineClient
    kind: str  # local | process | ray | backend
    idle_watts: float = 10.0
    busy_watts: float = 60.0
    restart: Callable[[], EngineClient] | None = None
    state: str = "ready"  # ready | draining | down | restarting
    step_model: StepModel = field(default_factory=StepModel)
    request_id_to_tokens: dict[str, int] = field(default_factory=dict)  # outstanding work of routed requests
    num_routed: int = 0
    num_rerouted_away: int = 0
    num_failed_mid_stream: int = 0
    num_restarts: int = 0
    down_reason: str | None = None
    down_since: float | None = None
    last_route: str | None = None

    @property
    def routable(self) -> bool:
        return self.state == "ready" and self.client.is_alive

    def view(self, model: str) -> ReplicaView:
        s = self.client.stats()
        outstanding = sum(self.request_id_to_tokens.values())
        if self.kind == "backend":  # its /metrics may show work that did not come through us: count it too
            foreign = s.num_running + s.num_waiting - len(self.request_id_to_tokens)
            outstanding += max(foreign, 0) * EXPECTED_OUTPUT_TOKENS
        return ReplicaView(self.replica_id, model, s.num_running, s.num_waiting, s.max_num_seqs, outstanding,
                           len(self.request_id_to_tokens), self.idle_watts, self.busy_watts, self.step_model)


class NoReplicaError(EngineDeadError):
    """No replica can take the request now (all down, draining or restarting)."""


class Fleet(ClientBase):
    """An EngineClient over replicas of one model (see the module's docstring)."""

    kind = "fleet"

    def __init__(self, model: str, replicas: Sequence[Replica], router: RoutingPolicy | None = None,
                 max_reroutes: int = 2, check_interval_s: float = 0.5, restart_backoff_s: float = 2.0,
                 info: ModelInfo | None = None, tokenizer: Tokenizer | None = None, hold_s: float = 0.0) -> None:
        """`info` and `tokenizer` (else the first replica's) let a fleet start, or scale to, zero replicas;
        `hold_s` > 0: a request that finds no routable replica waits that long for one (scale from zero)."""
        if not replicas and (info is None or tokenizer is None):
            raise ValueError("a fleet needs at least one replica, or the model's info and tokenizer")
        first = replicas[0].client if replicas else None
        info = info if info is not None else first.info  # type: ignore[union-attr]
        super().__init__(info, tokenizer if tokenizer is not None else first.tokenizer,  # type: ignore[union-attr]
                         first.facts if first is not None else EngineFacts(info.path, info.device, info.dtype))
        self.model = model
        self.replicas: dict[str, Replica] = {r.replica_id: r for r in replicas}
        self.router = router if router is not None else make_router("least-work")
        self.max_reroutes = max_reroutes
        self.check_interval_s, self.restart_backoff_s = check_interval_s, restart_backoff_s
        self.decisions: list[RouteDecision] = []  # the most recent ones, for tests
        self.request_id_to_replica: dict[str, str] = {}
        # Scale from zero: with hold_s > 0, a request that finds no routable replica waits that long for one
        # (an autoscaler starting it, a restart) instead of failing; num_held is the autoscaler's signal.
        self.hold_s = hold_s
        self.num_held = 0
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="fleet-supervisor", daemon=True)
        self._weights: dict[str, float] = {}
        for r in replicas:
            self._attach(r)

    # -- EngineClient ------------------------------------------------------------------------------------

    @property
    def facts(self) -> EngineFacts:
        """The model's (the first replica's, as the fleet started), its router, and what its replicas hold
        together (None where one of them cannot say)."""
        held = [r.client.facts for r in list(self.replicas.values())]

        def total(name: str) -> int | None:
            values = [getattr(f, name) for f in held]
            return None if not values or None in values else sum(values)
        return dataclasses.replace(self._facts, weight_bytes=total("weight_bytes"), kv_bytes=total("kv_bytes"),
                                   kv_blocks=total("kv_blocks"), kv_tokens=total("kv_tokens"), pid=None, url=None,
                                   node=None, node_id=None, router=self.router.name)

    @property
    def is_alive(self) -> bool:
        return self.hold_s > 0 or any(r.client.is_alive or r.state == "restarting" for r in self.replicas.values())

    @property
    def dead_reason(self) -> str | None:
        if self.is_alive:
            return None
        reasons = [f"{r.replica_id}: {r.down_reason or r.client.dead_reason}" for r in self.replicas.values()]
        return "every replica is down (" + "; ".join(reasons) + ")"

    def start(self) -> None:
        for r in self.replicas.values():
            r.client.start()
        if not self._supervisor.is_alive():
            self._supervisor.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        for r in self.replicas.values():
            r.client.shutdown(timeout)

    def send(self, message: Control) -> None:
        if isinstance(message, DrainReplica):
            if message.replica_id in self.replicas:
                (self.drain if message.drain else self.undrain)(message.replica_id)
        elif isinstance(message, SetTenantWeight):
            self._weights[message.tenant] = message.weight
            for r in self.replicas.values():
                r.client.send(message)
        elif isinstance(message, AbortRequest):
            if (r := self._replica_of(message.request_id)) is not None:
                r.client.send(message)
        else:
            by_replica: dict[str, dict[str, float]] = {}
            for rid, joules in message.request_id_to_joules.items():
                if (owner := self.request_id_to_replica.get(rid)) is not None:
                    by_replica.setdefault(owner, {})[rid] = joules
            for owner, joules_by_request in by_replica.items():
                self.replicas[owner].client.send(ChargeEnergy(joules_by_request))

    def stats(self) -> EngineStats:
        """The fleet's sum (max for the per-step figures); alive while any replica is."""
        snaps = [r.client.stats() for r in self.replicas.values()]
        total = {f.name: sum(getattr(s, f.name) for s in snaps) for f in dataclasses.fields(EngineStats)
                 if f.type in ("int", int)}
        total["num_waiting"] += self.num_held  # requests held for a replica to come up count as waiting
        steps = [s.last_step_s for s in snaps if s.last_step_s is not None]
        return EngineStats(time=max((s.time for s in snaps), default=time.monotonic()),
                           last_step_s=max(steps) if steps else None,
                           speculative=None, alive=self.is_alive, dead_reason=self.dead_reason, **total)

    def generate(self, request: AddRequest,
                 direct: DirectOutputs | None = None) -> AsyncIterator[RequestOutput]:
        # `direct` (EngineClient.generate): not taken: a replica's outputs come through the loop.
        return self._generate(request)

    async def _generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        route = RouteRequest(request.request_id, self.model, request.prompt_token_ids, request.params.max_tokens,
                             request.user, request.tenant)
        expected_out = route.expected_tokens - len(request.prompt_token_ids)
        excluded: set[str] = set()
        while True:
            replica = await self._route_or_hold(route, excluded)
            inner = replica.client.generate(request)
            produced = False
            try:
                async for out in inner:
                    produced = True  # its prefill is done: what is left is the tokens still to generate
                    generated = max((len(c.token_ids) for c in out.outputs), default=0)
                    replica.request_id_to_tokens[request.request_id] = max(expected_out - generated, 0)
                    out.replica = replica.replica_id  # each output is this stream's own object
                    yield out
                return
            except EngineDeadError as e:
                if produced:
                    replica.num_failed_mid_stream += 1
                    raise RequestError(f"replica {replica.replica_id} failed while serving this request: {e}") from e
                if len(excluded) >= self.max_reroutes:
                    raise
                replica.num_rerouted_away += 1
                excluded.add(replica.replica_id)  # it never started: try another replica
                logger.warning("request %s re-routed away from %s: %s", request.request_id, replica.replica_id, e)
            finally:
                await inner.aclose()
                replica.request_id_to_tokens.pop(request.request_id, None)
                self.request_id_to_replica.pop(request.request_id, None)

    # -- routing -----------------------------------------------------------------------------------------

    async def _route_or_hold(self, route: RouteRequest, excluded: set[str]) -> Replica:
        """A replica now, or (with hold_s) once one can take work; NoReplicaError when none comes in time."""
        try:
            return self._route(route, excluded)
        except NoReplicaError:
            if self.hold_s <= 0:
                raise
        deadline = time.monotonic() + self.hold_s
        self.num_held += 1
        try:
            while True:
                await asyncio.sleep(0.05)
                try:
                    return self._route(route, excluded)
                except NoReplicaError:
                    if time.monotonic() >= deadline:
                        raise NoReplicaError(f"no replica of {self.model} could take the request within "
                                             f"{self.hold_s:g} s") from None
        finally:
            self.num_held -= 1

    def _route(self, route: RouteRequest, excluded: set[str]) -> Replica:
        candidates = [r for r in self.replicas.values() if r.routable and r.replica_id not in excluded]
        if not candidates:
            raise NoReplicaError(self.dead_reason or f"no replica of {self.model} can take requests now "
                                 f"({', '.join(f'{r.replica_id}: {r.state}' for r in self.replicas.values())})")
        decision = self.router.choose(route, [r.view(self.model) for r in candidates])
        replica = self.replicas[decision.replica_id]
        self.decisions.append(decision)
        del self.decisions[:-256]
        replica.last_route = f"{decision.policy}: {decision.reason}"
        self.router.routed(route, replica.replica_id)
        replica.num_routed += 1
        replica.request_id_to_tokens[route.request_id] = route.expected_tokens
        self.request_id_to_replica[route.request_id] = replica.replica_id
        return replica

    def _replica_of(self, request_id: str) -> Replica | None:
        owner = self.request_id_to_replica.get(request_id)
        return self.replicas.get(owner) if owner is not None else None

    # -- membership --------------------------------------------------------------------------------------

    def drain(self, replica_id: str) -> None:
        """No new work to `replica_id`; its streams finish."""
        self.replicas[replica_id].state = "draining"

    def undrain(self, replica_id: str) -> None:
        r = self.replicas[replica_id]
        if r.state == "draining":
            r.state = "ready"

    def add_replica(self, replica: Replica) -> None:
        """A new replica (already started) joins the routing set."""
        if replica.replica_id in self.replicas:
            raise ValueError(f"replica {replica.replica_id!r} is already in the fleet")
        self._attach(replica)
        replica.client.start()
        for tenant, weight in self._weights.items():
            replica.client.send(SetTenantWeight(tenant, weight))
        self.replicas[replica.replica_id] = replica

    def remove_replica(self, replica_id: str, timeout_s: float = 10.0) -> None:
        """Take a replica out and stop it; drain it first (and wait for `num_outstanding` 0) to lose nothing."""
        replica = self.replicas.pop(replica_id)
        self.router.forget(replica_id)
        replica.client.shutdown(timeout_s)

    def status(self) -> list[ReplicaState]:
        return [ReplicaState(r.replica_id, r.kind, r.state, r.client.is_alive, r.client.stats(), r.client.facts,
                             r.down_reason or r.client.dead_reason, len(r.request_id_to_tokens),
                             sum(r.request_id_to_tokens.values()), r.num_routed, r.num_rerouted_away,
                             r.num_failed_mid_stream, r.num_restarts, r.last_route)
                for r in list(self.replicas.values())]

    def replica_states(self) -> tuple[ReplicaState, ...]:
        return tuple(self.status())

    def _attach(self, replica: Replica) -> None:
        client = replica.client
        client.subscribe_steps(lambda step: self._on_step(replica, client, step))

    def _on_step(self, replica: Replica, client: EngineClient, step: StepStats) -> None:
        if replica.client is client:  # not a late step of the client it had before a restart (still metered)
            replica.step_model.observe(len({w.request_id for w in step.work}), step.duration_s)
        self.publish_step(step)

    def _supervise(self) -> None:
        while not self._stop.wait(self.check_interval_s):
            for r in list(self.replicas.values()):
                if r.state in ("ready", "draining") and not r.client.is_alive:
                    r.state, r.down_reason, r.down_since = "down", r.client.dead_reason, time.monotonic()
                    self.router.forget(r.replica_id)
                    logger.warning("replica %s left the fleet: %s", r.replica_id, r.down_reason)
                if r.state == "down" and r.restart is None and r.client.is_alive:  # a backend that came back
                    r.state, r.down_reason, r.down_since = "ready", None, None
                    logger.warning("replica %s is back", r.replica_id)
                if (r.state == "down" and r.restart is not None and r.down_since is not None
                        and time.monotonic() - r.down_since >= self.restart_backoff_s * (1 + min(r.num_restarts, 5))):
                    r.state = "restarting"
                    threading.Thread(target=self._restart, args=(r,), name=f"restart-{r.replica_id}",
                                     daemon=True).start()

    def _restart(self, replica: Replica) -> None:
        assert replica.restart is not None
        try:
            client = replica.restart()
        except Exception as e:  # noqa: BLE001 - stays down; tried again after the back-off
            logger.warning("replica %s did not restart: %s", replica.replica_id, e)
            replica.state, replica.down_reason, replica.down_since = "down", f"restart failed: {e}", time.monotonic()
            replica.num_restarts += 1
            return
        if self._stop.is_set():  # the fleet shut down while this replica was starting
            client.shutdown()
            return
        replica.client, replica.num_restarts = client, replica.num_restarts + 1
        self._attach(replica)
        client.start()
        for tenant, weight in self._weights.items():
            client.send(SetTenantWeight(tenant, weight))
        replica.state, replica.down_reason, replica.down_since = "ready", None, None
        logger.warning("replica %s is back", replica.replica_id)
