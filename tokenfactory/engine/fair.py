"""Fair share between tenants in the engine's waiting queue: strict priority bands, then VTC.

Order of admission (the `SchedulingPolicy` seam of scheduler.py):

1. Strict priority bands by `Sequence.priority`, lower first: interactive (0) before standard (1)
   before batch (2). A flood of batch work never delays an interactive request by more than the
   sequences already running (running sequences are never preempted for priority).
2. Within a band, the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
   Models", OSDI'24, Algorithm 2 and §4.2 weighted VTC): each tenant t has a counter c_t of the
   service it received divided by its weight w_t; the waiting sequence of the tenant with the
   smallest counter goes first (ties: earlier arrival).

       service of a chunk = w_p · (new prompt tokens) + w_q · (new output tokens)      [tokens]
       c_t += service / w_t

   with w_p = 1, w_q = 2 as in the paper's evaluation (an output token costs more than an input
   token). Tokens are charged once: recomputing a preempted sequence's KV is not charged again.

3. Counter lift (the paper's fix for banked credit): when a tenant with nothing waiting or running
   in its band sends a request, c_t ← max(c_t, min c_v over the band's active tenants), so a tenant
   that was idle for an hour does not then monopolise the engine for an hour.

`vtc-joules` counts service in measured joules instead. The engine never reads a power source: the
meter measures each step's energy and splits it across the step's requests by forward FLOPs
(attribution.py), and sends those joules back through the engine client (`ChargeEnergy`), which this
policy charges to the requests' tenants:

       service of tenant t = Σ over its requests of the joules the meter attributed       [J]

Until the first such message (no meter attached, or its source cannot measure), a chunk's FLOPs stand in
for its joules at a fixed 1 nJ/FLOP (the order of a CPU), charged when it is scheduled, so the order
stays sensible; from the first message on, only measured joules are charged.

Weights come from the tenant table through the engine client (`SetTenantWeight`), applied on the
engine's thread between steps; an unknown tenant weighs 1; a new weight applies to service charged after it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

from tokenfactory.config import FlopShape, work_flops
from tokenfactory.engine.sequence import Sequence, SequenceStatus
from tokenfactory.types import ParameterError

JOULES_PER_FLOP_FALLBACK = 1e-9  # J/FLOP while no energy is measured (order of a CPU core)


@dataclass(frozen=True)
class VTCConfig:
    prompt_weight: float = 1.0  # w_p: per prompt token
    output_weight: float = 2.0  # w_q: per output token (OSDI'24 §5 uses w_p = 1, w_q = 2)

    def __post_init__(self) -> None:
        if self.prompt_weight < 0 or self.output_weight < 0:
            raise ParameterError("prompt_weight", "VTC token weights must be >= 0")


class FairPolicy:
    """Priority bands, then weighted VTC counted in tokens. See the module docstring."""

    SWEEP_EVERY = 4096  # on_scheduled calls between sweeps of finished sequences' charge marks

    def __init__(self, config: VTCConfig | None = None) -> None:
        self.config = config if config is not None else VTCConfig()
        self.band_to_tenant_to_queue: dict[int, dict[str, deque[Sequence]]] = {}
        self.tenant_to_counter: dict[str, float] = {}
        self.tenant_to_weight: dict[str, float] = {}
        # Positions already charged per sequence (prompt positions, then one per sampled token).
        self.seq_id_to_mark: dict[str, tuple[Sequence, int]] = {}
        # Sequences scheduled at least once, per (tenant, band); pruned to the running ones when read.
        self.tenant_band_to_scheduled: dict[tuple[str, int], dict[str, Sequence]] = {}
        self.num_waiting = 0
        self._calls = itertools.count()

    # -- weights and counters ---------------------------------------------------------------------------

    def set_weight(self, tenant: str, weight: float) -> None:
        if not weight > 0:
            raise ParameterError("weight", f"weight must be > 0, got {weight}")
        self.tenant_to_weight[tenant] = float(weight)

    def weight(self, tenant: str) -> float:
        return self.tenant_to_weight.get(tenant, 1.0)

    def counter(self, tenant: str) -> float:
        return self.tenant_to_counter.get(tenant, 0.0)

    def charge(self, tenant: str, service: float) -> None:
        """Add `service` (tokens or joules, unweighted) to the tenant's counter."""
        self.tenant_to_counter[tenant] = self.counter(tenant) + service / self.weight(tenant)

    # -- SchedulingPolicy ---------------------------------------------------------------------------------

    def add(self, seq: Sequence, front: bool = False) -> None:
        tenants = self.band_to_tenant_to_queue.setdefault(seq.priority, {})
        queue = tenants.get(seq.tenant)
        if queue is None:
            queue = tenants[seq.tenant] = deque()
        if not queue and not self._running(seq.tenant, seq.priority):
            self._lift(seq.tenant, seq.priority)
        if front:
            queue.appendleft(seq)
        else:
            queue.append(seq)
        self.num_waiting += 1

    def add_preempted(self, seq: Sequence) -> None:
        self.add(seq, front=True)

    def remove(self, seq: Sequence) -> None:
        tenants = self.band_to_tenant_to_queue[seq.priority]
        tenants[seq.tenant].remove(seq)
        if not tenants[seq.tenant]:
            del tenants[seq.tenant]
            if not tenants:
                del self.band_to_tenant_to_queue[seq.priority]
        self.num_waiting -= 1

    def __len__(self) -> int:
        return self.num_waiting

    def __iter__(self) -> Iterator[Sequence]:
        """Bands in order; within a band, repeatedly the head of the tenant whose counter, plus what
        this pass has already handed out (projected), is smallest."""
        snapshot = [(band, {t: list(q) for t, q in tenants.items()})
                    for band, tenants in sorted(self.band_to_tenant_to_queue.items())]
        return self._order(snapshot)

    def _order(self, snapshot: list[tuple[int, dict[str, list[Sequence]]]]) -> Iterator[Sequence]:
        for _, tenant_to_seqs in snapshot:
            queues = {t: deque(seqs) for t, seqs in tenant_to_seqs.items() if seqs}
            projected = {t: self.counter(t) for t in queues}
            while queues:
                tenant = min(queues, key=lambda t: (projected[t], queues[t][0].arrival_time))
                seq = queues[tenant].popleft()
                if not queues[tenant]:
                    del queues[tenant]
                yield seq
                projected[tenant] += self.estimate(seq) / self.weight(tenant)

    def estimate(self, seq: Sequence) -> float:
        """Service the sequence's admission is about to cost: its uncharged prompt."""
        mark = self._mark(seq)
        return self.config.prompt_weight * max(seq.num_prompt_tokens - mark, 0)

    def on_scheduled(self, seq: Sequence, num_new_tokens: int) -> None:
        self.tenant_band_to_scheduled.setdefault((seq.tenant, seq.priority), {})[seq.seq_id] = seq
        end = seq.num_computed_tokens + num_new_tokens
        if end == seq.num_tokens:
            end += 1  # this chunk samples the next (output) token
        mark = self._mark(seq)
        if end > mark:
            self.seq_id_to_mark[seq.seq_id] = (seq, end)
            prompt = max(min(end, seq.num_prompt_tokens) - mark, 0)
            output = end - mark - prompt
            self.on_service(seq, prompt, output, num_new_tokens)
        if next(self._calls) % self.SWEEP_EVERY == 0:
            self.seq_id_to_mark = {k: v for k, v in self.seq_id_to_mark.items() if not v[0].is_finished}

    def on_service(self, seq: Sequence, num_prompt_tokens: int, num_output_tokens: int,
                   num_new_tokens: int) -> None:
        """Charge newly served tokens (overridden by the joules policy)."""
        c = self.config
        self.charge(seq.tenant, c.prompt_weight * num_prompt_tokens + c.output_weight * num_output_tokens)

    # -- lift -------------------------------------------------------------------------------------------------

    def _mark(self, seq: Sequence) -> int:
        entry = self.seq_id_to_mark.get(seq.seq_id)
        return entry[1] if entry is not None and entry[0] is seq else 0

    def _running(self, tenant: str, band: int) -> bool:
        """The tenant has sequences running in this band."""
        key = (tenant, band)
        seqs = self.tenant_band_to_scheduled.get(key)
        if seqs is None:
            return False
        for seq_id in [i for i, s in seqs.items() if s.status is not SequenceStatus.RUNNING]:
            del seqs[seq_id]  # finished, or preempted back into the queue
        if not seqs:
            del self.tenant_band_to_scheduled[key]
        return bool(seqs)

    def _lift(self, tenant: str, band: int) -> None:
        waiting = set(self.band_to_tenant_to_queue.get(band, {}))
        running = {t for (t, b) in list(self.tenant_band_to_scheduled) if b == band and self._running(t, b)}
        active = (waiting | running) - {tenant}
        if active:
            floor = min(self.counter(t) for t in active)
            self.tenant_to_counter[tenant] = max(self.counter(tenant), floor)


class JoulesFairPolicy(FairPolicy):
    """VTC counted in the joules the meter measured (ChargeEnergy), FLOPs standing in until it does."""

    MAX_REMEMBERED_REQUESTS = 65_536  # energy may arrive after a request finished: whose it was

    def __init__(self, config: VTCConfig | None = None, shape: FlopShape | None = None) -> None:
        super().__init__(config)
        self.shape = shape
        self.measured = False  # a meter has charged measured joules at least once
        self.request_to_tenant: OrderedDict[str, str] = OrderedDict()

    def estimate(self, seq: Sequence) -> float:
        if self.shape is None:
            return super().estimate(seq)
        n = max(seq.num_prompt_tokens - self._mark(seq), 0)
        return work_flops(self.shape, n, 0) * JOULES_PER_FLOP_FALLBACK

    def on_service(self, seq: Sequence, num_prompt_tokens: int, num_output_tokens: int,
                   num_new_tokens: int) -> None:
        self.request_to_tenant[seq.request_id] = seq.tenant
        self.request_to_tenant.move_to_end(seq.request_id)
        while len(self.request_to_tenant) > self.MAX_REMEMBERED_REQUESTS:
            self.request_to_tenant.popitem(last=False)
        if self.measured:
            return
        if self.shape is None:
            return super().on_service(seq, num_prompt_tokens, num_output_tokens, num_new_tokens)
        self.charge(seq.tenant, work_flops(self.shape, num_new_tokens, seq.num_computed_tokens)
                    * JOULES_PER_FLOP_FALLBACK)

    def charge_energy(self, request_id_to_joules: dict[str, float]) -> None:
        """Measured joules per request (the meter's attribution of one settlement)."""
        self.measured = True
        for request_id, joules in request_id_to_joules.items():
            tenant = self.request_to_tenant.get(request_id)
            if tenant is not None:
                self.charge(tenant, joules)
