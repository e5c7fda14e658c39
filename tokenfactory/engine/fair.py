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

`vtc-joules` counts service in measured joules instead: each step's energy, read from a power
source after the step (the meter's own source), split across the step's tenants in proportion to
their forward FLOPs — the same split the meter uses for per-request energy (attribution.py):

       service of tenant t in a step = ΔE_step · F_t / Σ F                             [J]

Before a source is attached (`attach_energy`) or while it cannot measure, a step's FLOPs stand in
for its joules at a fixed 1 nJ/FLOP (the order of a CPU), so the order stays sensible.

Weights are set by the gateway (`set_weight`) from the tenant table; an unknown tenant weighs 1.
`set_weight` is called from the server's thread while the engine thread reads: a single dict
store, which is atomic in CPython; a new weight applies to service charged after it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from tokenfactory.engine.sequence import Sequence, SequenceStatus
from tokenfactory.meter.attribution import FlopShape, work_flops
from tokenfactory.meter.power import EnergyReading, PowerSource
from tokenfactory.types import ParameterError, StepStats

# Sequence.priority of each band; lower is admitted first.
BANDS: dict[str, int] = {"interactive": 0, "standard": 1, "batch": 2}
JOULES_PER_FLOP_FALLBACK = 1e-9  # J/FLOP while no energy is measured (order of a CPU core)


@dataclass(frozen=True)
class VTCConfig:
    prompt_weight: float = 1.0  # w_p: per prompt token
    output_weight: float = 2.0  # w_q: per output token (OSDI'24 §5 uses w_p = 1, w_q = 2)

    def __post_init__(self) -> None:
        if self.prompt_weight < 0 or self.output_weight < 0:
            raise ParameterError("prompt_weight", "VTC token weights must be >= 0")


def band_of(name: str) -> int:
    if name not in BANDS:
        raise ParameterError("priority", f"priority must be one of {', '.join(BANDS)}, got {name!r}")
    return BANDS[name]


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
    """VTC counted in measured joules: each step's energy split across tenants by forward FLOPs."""

    def __init__(self, config: VTCConfig | None = None) -> None:
        super().__init__(config)
        self.shape: FlopShape | None = None
        self.source: PowerSource | None = None
        self.last_reading: EnergyReading | None = None
        self.tenant_to_step_flops: dict[str, float] = {}

    def attach_energy(self, shape: FlopShape, source: PowerSource | None) -> None:
        """Count in joules read from `source` (None: FLOPs at the fallback rate)."""
        self.shape, self.source = shape, source
        self.last_reading = source.read() if source is not None else None

    def estimate(self, seq: Sequence) -> float:
        if self.shape is None:
            return super().estimate(seq)
        n = max(seq.num_prompt_tokens - self._mark(seq), 0)
        return work_flops(self.shape, n, 0) * JOULES_PER_FLOP_FALLBACK

    def on_service(self, seq: Sequence, num_prompt_tokens: int, num_output_tokens: int,
                   num_new_tokens: int) -> None:
        if self.shape is None:
            return super().on_service(seq, num_prompt_tokens, num_output_tokens, num_new_tokens)
        flops = work_flops(self.shape, num_new_tokens, seq.num_computed_tokens)
        self.tenant_to_step_flops[seq.tenant] = self.tenant_to_step_flops.get(seq.tenant, 0.0) + flops

    def on_step(self, stats: StepStats) -> None:
        """A step listener (engine.step_listeners): charge the step's measured joules."""
        step_flops, self.tenant_to_step_flops = self.tenant_to_step_flops, {}
        total = sum(step_flops.values())
        if total <= 0:
            return
        joules = total * JOULES_PER_FLOP_FALLBACK
        reading = self.source.read() if self.source is not None else None
        if reading is not None and self.last_reading is not None:
            elapsed = reading.timestamp - self.last_reading.timestamp
            delta = reading.joules - self.last_reading.joules
            # The window since the last reading may include idle time: keep the step's share of it.
            joules = delta * min(1.0, stats.duration_s / elapsed) if elapsed > 0 else joules
        self.last_reading = reading if reading is not None else self.last_reading
        for tenant, flops in step_flops.items():
            self.charge(tenant, joules * flops / total)


def attach_energy(engine: object, source: PowerSource | None) -> bool:
    """If the engine's policy counts joules, feed it `source` and its step listener. Returns whether
    it did. `engine` is an LLMEngine (typed loosely: this module must not import the engine)."""
    policy = engine.scheduler.waiting  # type: ignore[attr-defined]
    if not isinstance(policy, JoulesFairPolicy):
        return False
    policy.attach_energy(engine.model_config, source)  # type: ignore[attr-defined]
    engine.step_listeners.append(policy.on_step)  # type: ignore[attr-defined]
    return True
