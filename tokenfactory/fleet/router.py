"""Routing policies: which replica gets a request. Each returns its choice as data (`RouteDecision`, with the
score of every candidate and the reason), and the fleet applies it; the simulator can run the same code.

    least-work   the fewest outstanding tokens (prompt tokens not yet prefilled + expected tokens still to
                 generate, of the requests routed there): tokens, not requests, because one 4k-token prompt
                 is more work than ten short chats.
    prefix       the replica whose recent prompts share the longest prefix with this one (an approximate
                 per-replica prefix index over 16-token blocks, as SGLang's router keeps a radix tree of
                 what it sent where), unless that replica is overloaded: then least-work.
    energy       the lowest predicted marginal joules per output token, subject to a TTFT bound:
                 adding a sequence to a busy replica costs  P_busy · (T(B+1) − T(B))  per step, waking an
                 idle one costs  (P_busy − P_idle) · T(1)  — so batching onto a busy efficient replica
                 beats waking an idle one, until the predicted TTFT would break the bound.

T(B) is each replica's step time at B sequences, fitted online from its own steps (`StepModel`). Session
stickiness (`Sticky`) wraps any policy: a `user` keeps its replica while that replica is eligible.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

EXPECTED_OUTPUT_TOKENS = 256  # what an unbounded max_tokens is expected to cost, for outstanding work
PREFIX_BLOCK_TOKENS = 16


@dataclass
class StepModel:
    """T(B) = base_s + per_seq_s · B, fitted by least squares over a replica's recent steps."""

    base_s: float = 0.02
    per_seq_s: float = 0.001
    max_samples: int = 256
    samples: list[tuple[int, float]] = field(default_factory=list)

    def observe(self, num_seqs: int, duration_s: float) -> None:
        self.samples.append((num_seqs, duration_s))
        if len(self.samples) > self.max_samples:
            del self.samples[: len(self.samples) - self.max_samples]
        n = len(self.samples)
        if n < 4:
            return
        mean_b = sum(b for b, _ in self.samples) / n
        mean_t = sum(t for _, t in self.samples) / n
        var_b = sum((b - mean_b) ** 2 for b, _ in self.samples)
        if var_b > 0:
            slope = sum((b - mean_b) * (t - mean_t) for b, t in self.samples) / var_b
            self.per_seq_s = max(slope, 1e-6)
            self.base_s = max(mean_t - self.per_seq_s * mean_b, 1e-5)
        else:
            self.base_s = max(mean_t - self.per_seq_s * mean_b, 1e-5)

    def step_s(self, num_seqs: int) -> float:
        return self.base_s + self.per_seq_s * max(num_seqs, 1)


@dataclass(frozen=True)
class ReplicaView:
    """What a policy sees of one replica: the gateway's own counts and the replica's latest snapshot."""

    replica_id: str
    model: str
    num_running: int  # sequences in its batch (its snapshot)
    num_waiting: int
    max_num_seqs: int
    outstanding_tokens: int  # of the requests the fleet routed there and has not seen finish
    num_outstanding: int
    idle_watts: float
    busy_watts: float
    step: StepModel
    prefill_tokens_per_s: float = 4000.0


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    model: str
    prompt_token_ids: Sequence[int]
    max_tokens: int | None
    user: str | None = None
    tenant: str = "anonymous"

    @cached_property
    def block_hashes(self) -> list[int]:  # the prefix index's key, computed once per request
        return block_hashes(self.prompt_token_ids)

    @property
    def expected_tokens(self) -> int:
        out = EXPECTED_OUTPUT_TOKENS if self.max_tokens is None else min(self.max_tokens, EXPECTED_OUTPUT_TOKENS)
        return len(self.prompt_token_ids) + out


@dataclass(frozen=True)
class RouteDecision:
    replica_id: str
    policy: str
    reason: str
    scores: Mapping[str, float] = field(default_factory=dict)  # per candidate; lower is better


class RoutingPolicy(Protocol):
    """Chooses among `replicas` (non-empty: the eligible ones, all serving the request's model). `routed` is
    called once a request is sent, `forget` when a replica leaves the fleet; neither may raise."""

    name: str

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision: ...

    def routed(self, request: RouteRequest, replica_id: str) -> None: ...

    def forget(self, replica_id: str) -> None: ...


def overloaded(view: ReplicaView, replicas: Sequence[ReplicaView], ratio: float = 1.5, slack_tokens: int = 2048
               ) -> bool:
    """SGLang's cache-aware rule: a replica is overloaded when its load exceeds the lightest one's by both an
    absolute and a relative margin, or when its batch is full with a queue behind it."""
    lightest = min(r.outstanding_tokens for r in replicas)
    if view.num_running >= view.max_num_seqs and view.num_waiting > 0:
        return True
    return view.outstanding_tokens > lightest + slack_tokens and view.outstanding_tokens > ratio * lightest


class LeastWork:
    """Ties (an idle fleet) go round the tied replicas in turn, so sequential traffic spreads too."""

    name = "least-work"

    def __init__(self) -> None:
        self.num_ties = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        scores = {r.replica_id: float(r.outstanding_tokens) for r in replicas}
        least = min((r.outstanding_tokens, r.num_outstanding) for r in replicas)
        tied = sorted((r for r in replicas if (r.outstanding_tokens, r.num_outstanding) == least),
                      key=lambda r: r.replica_id)
        best = tied[self.num_ties % len(tied)]
        if len(tied) > 1:
            self.num_ties += 1
        return RouteDecision(best.replica_id, self.name,
                             f"fewest outstanding tokens ({best.outstanding_tokens})", scores)

    def routed(self, request: RouteRequest, replica_id: str) -> None:
        pass

    def forget(self, replica_id: str) -> None:
        pass


def block_hashes(token_ids: Sequence[int], block: int = PREFIX_BLOCK_TOKENS) -> list[int]:
    """Chained hashes of the prompt's full blocks: equal hash i means an equal prefix of (i+1)·block tokens
    (up to a collision of Python's tuple hash, which an approximate index can afford; ints are not salted)."""
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - block + 1, block):
        parent = hash((parent, *token_ids[start:start + block]))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Which replicas recently received which prefix blocks; approximate, bounded (LRU over blocks)."""

    def __init__(self, max_blocks: int = 100_000) -> None:
        self.max_blocks = max_blocks
        self.hash_to_replicas: OrderedDict[int, set[str]] = OrderedDict()

    def insert(self, hashes: Sequence[int], replica_id: str) -> None:
        for h in hashes:
            owners = self.hash_to_replicas.get(h)
            if owners is None:
                owners = self.hash_to_replicas[h] = set()
            else:
                self.hash_to_replicas.move_to_end(h)
            owners.add(replica_id)
        while len(self.hash_to_replicas) > self.max_blocks:
            self.hash_to_replicas.popitem(last=False)

    def matched_blocks(self, hashes: Sequence[int], replica_id: str) -> int:
        n = 0
        for h in hashes:
            owners = self.hash_to_replicas.get(h)
            if owners is None or replica_id not in owners:
                break
            n += 1
        return n

    def forget(self, replica_id: str) -> None:
        for owners in self.hash_to_replicas.values():
            owners.discard(replica_id)


class PrefixAffinity:
    name = "prefix"

    def __init__(self, fallback: RoutingPolicy | None = None, max_blocks: int = 100_000) -> None:
        self.index = PrefixIndex(max_blocks)
        self.fallback = fallback if fallback is not None else LeastWork()

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        hashes = request.block_hashes
        matched = {r.replica_id: self.index.matched_blocks(hashes, r.replica_id) for r in replicas}
        scores = {rid: -float(m * PREFIX_BLOCK_TOKENS) for rid, m in matched.items()}
        candidates = [r for r in replicas if matched[r.replica_id] > 0 and not overloaded(r, replicas)]
        if not candidates:
            d = self.fallback.choose(request, replicas)
            why = "no replica holds a prefix of this prompt" if not any(matched.values()) else \
                "the replicas holding its prefix are overloaded"
            return RouteDecision(d.replica_id, self.name, f"{why}: {d.reason}", scores)
        best = max(candidates, key=lambda r: (matched[r.replica_id], -r.outstanding_tokens))
        return RouteDecision(best.replica_id, self.name,
                             f"longest cached prefix ({matched[best.replica_id] * PREFIX_BLOCK_TOKENS} tokens)", scores)

    def routed(self, request: RouteRequest, replica_id: str) -> None:
        self.index.insert(request.block_hashes, replica_id)

    def forget(self, replica_id: str) -> None:
        self.index.forget(replica_id)


class EnergyAware:
    """Lowest predicted marginal joules per output token within a TTFT bound (see the module's docstring)."""

    name = "energy"

    def __init__(self, ttft_bound_s: float = 2.0) -> None:
        self.ttft_bound_s = ttft_bound_s

    @staticmethod
    def batch(view: ReplicaView) -> int:
        return max(view.num_running, min(view.num_outstanding, view.max_num_seqs))

    def marginal_joules_per_token(self, view: ReplicaView) -> float:
        b = self.batch(view)
        if b == 0:  # waking it: the step's whole busy power is this request's
            return (view.busy_watts - view.idle_watts) * view.step.step_s(1)
        return view.busy_watts * (view.step.step_s(b + 1) - view.step.step_s(b))

    def predicted_ttft_s(self, request: RouteRequest, view: ReplicaView) -> float:
        queued_prefill = view.outstanding_tokens + len(request.prompt_token_ids)
        wait = queued_prefill / view.prefill_tokens_per_s
        if self.batch(view) >= view.max_num_seqs:  # a full batch: it waits for a sequence to finish
            wait += view.step.step_s(view.max_num_seqs) * EXPECTED_OUTPUT_TOKENS / 2
        return wait + view.step.step_s(self.batch(view) + 1)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        joules = {r.replica_id: self.marginal_joules_per_token(r) for r in replicas}
        ttft = {r.replica_id: self.predicted_ttft_s(request, r) for r in replicas}
        within = [r for r in replicas if ttft[r.replica_id] <= self.ttft_bound_s]
        if not within:
            best = min(replicas, key=lambda r: ttft[r.replica_id])
            return RouteDecision(best.replica_id, self.name, f"no replica meets the TTFT bound "
                                 f"{self.ttft_bound_s:g} s: the soonest ({ttft[best.replica_id]:.2f} s)", joules)
        best = min(within, key=lambda r: (joules[r.replica_id], ttft[r.replica_id], r.replica_id))
        return RouteDecision(best.replica_id, self.name,
                             f"{joules[best.replica_id]:.3g} J/token marginal, TTFT {ttft[best.replica_id]:.2f} s "
                             f"predicted", joules)

    def routed(self, request: RouteRequest, replica_id: str) -> None:
        pass

    def forget(self, replica_id: str) -> None:
        pass


class Sticky:
    """A `user` keeps the replica it was last sent to while that replica is eligible; else `inner` decides."""

    def __init__(self, inner: RoutingPolicy, max_users: int = 100_000) -> None:
        self.inner, self.name, self.max_users = inner, inner.name + "+sticky", max_users
        self.user_to_replica: OrderedDict[str, str] = OrderedDict()

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> RouteDecision:
        kept = self.user_to_replica.get(request.user) if request.user else None
        if kept is not None and any(r.replica_id == kept and not overloaded(r, replicas) for r in replicas):
            return RouteDecision(kept, self.name, f"session of user {request.user!r}")
        return self.inner.choose(request, replicas)

    def routed(self, request: RouteRequest, replica_id: str) -> None:
        self.inner.routed(request, replica_id)
        if request.user:
            self.user_to_replica[request.user] = replica_id
            self.user_to_replica.move_to_end(request.user)
            while len(self.user_to_replica) > self.max_users:
                self.user_to_replica.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        self.inner.forget(replica_id)
        for user in [u for u, r in self.user_to_replica.items() if r == replica_id]:
            del self.user_to_replica[user]


ROUTERS: dict[str, Callable[[], RoutingPolicy]] = {"least-work": LeastWork, "prefix": PrefixAffinity,
                                                   "energy": EnergyAware}


def make_router(name: str, sticky: bool = False) -> RoutingPolicy:
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
    policy = ROUTERS[name]()
    return Sticky(policy) if sticky else policy
