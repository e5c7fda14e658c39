"""Energy measured where the work ran: a Ray replica meters its own node, the gateway keeps the books per node.

A replica on another machine cannot be metered by the gateway's power source (that reads the gateway's
machine). So a Ray replica runs its own `Meter` on its node (`ReplicaMeter`, in the actor): NVML for the GPU
Ray gave it, else the modelled source for its share of the node's CPUs (its own process's CPU time against
that share's TDP; RAPL only when asked, since it counts the whole package that replicas on one node share).
What crosses to the gateway, in each batch, before the batch's outputs (`MeteredEvents`):

    steps       each step's StepStats, labelled with the node and the source (for the router, the autoscaler)
    energies    each request that ended in the batch (finished, failed alone, or aborted): its RequestEnergy
    totals      the replica meter's MeterTotals, at most once a second: the node's books

`NodeEnergy` is the gateway's side: the settlement's `finish_request` gets the replica's RequestEnergy (it
arrived before the request's end reached the gateway: engine/client.py's ordering), with the gateway's token
count. A request whose replica was lost with its node before it could say (a node killed under load) has no
measured energy: null, never 0 (its device-seconds and FLOPs from the steps the gateway saw). The books
balance per node as each replica's meter balances its own (meter/attribution.py):

    Σ ledger joules of the node's requests + unbilled + idle + unattributed + unsettled = the node's energy

where `unbilled` is what the node measured for requests that are in no ledger row with it: reported after the
gateway had settled them, or part of a request that also ran on a node that was lost (its energy: null).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenfactory.config import FlopShape, work_flops
from tokenfactory.engine.client import WorkerEvents
from tokenfactory.meter.attribution import Meter, MeterConfig, MeterTotals, RequestEnergy
from tokenfactory.meter.power import PowerConfig
from tokenfactory.meter.prices import Prices
from tokenfactory.types import ParameterError, StepStats

logger = logging.getLogger(__name__)

REPLICA_SOURCES = ("auto", "nvml", "rapl", "modelled")
TOTALS_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ReplicaMetering:
    """How a replica meters its node (serve's --replica-power-source, the gateway's prices)."""

    prices: Prices
    power_source: str = "auto"  # auto: nvml for its GPU, else modelled for its CPU share
    cpu_tdp_watts: float | None = None  # the node's CPU TDP, for the modelled source (None: the table's)

    def __post_init__(self) -> None:
        if self.power_source not in REPLICA_SOURCES:
            raise ParameterError("replica_power_source", f"replica_power_source must be one of "
                                 f"{', '.join(REPLICA_SOURCES)}, got {self.power_source!r}")


@dataclass(frozen=True)
class MeteredEvents:
    """A replica's batch with what its own meter made of it (see the module's docstring)."""

    events: WorkerEvents
    energies: tuple[RequestEnergy, ...] = ()
    totals: MeterTotals | None = None


def visible_gpus() -> tuple[int, ...] | None:
    """The NVML indices of the GPUs this process may use (CUDA_VISIBLE_DEVICES as Ray sets it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return None
    try:
        return tuple(int(part) for part in visible.split(","))
    except ValueError:  # UUIDs: NVML cannot be narrowed by index
        return None


class ReplicaMeter:
    """The actor's meter over its own node (see the module's docstring). Off the engine thread: the actor's
    metering thread calls `meter_batch` for each batch the engine emitted, in order."""

    def __init__(self, metering: ReplicaMetering, model: FlopShape, num_cpus: float, uses_gpu: bool,
                 node_id: str, device: str) -> None:
        from tokenfactory.meter.sources import open_power_source

        share = max(1, round(num_cpus))
        name = metering.power_source
        if name == "auto":
            name = "nvml" if uses_gpu else "modelled"
        config = PowerConfig(source=name, cpu_tdp_watts=metering.cpu_tdp_watts, cpu_share=share,
                             gpu_indices=visible_gpus() if name == "nvml" else None)
        source = open_power_source(config)
        self.meter = Meter(source, model, metering.prices, MeterConfig(device=device)).start()
        self.node_id, self.source = node_id, source.name
        self._last_totals = float("-inf")

    def label(self, events: WorkerEvents) -> WorkerEvents:
        """The batch with its steps labelled with this node and source (never the gateway's meter's)."""
        return dataclasses.replace(events, steps=tuple(
            dataclasses.replace(s, node=self.node_id, energy_source=self.source) for s in events.steps))

    def meter_batch(self, events: WorkerEvents) -> MeteredEvents:
        """Steps into the meter (labelled), then each request that ended into its RequestEnergy."""
        events = self.label(events)
        for step in events.steps:
            try:
                self.meter.on_step(step)
            except Exception:  # a meter's bug costs that step's energy, never the replica
                logger.exception("replica meter: a step could not be metered")
        ended = [(o.request_id, o.num_completion_tokens) for o in events.outputs if o.finished]
        ended += [(f.request_id, None) for f in events.failures] + [(rid, None) for rid in events.aborted]
        energies = tuple(self.meter.finish_request(rid, n) for rid, n in ended)
        now = time.monotonic()
        totals = None
        if energies or now - self._last_totals >= TOTALS_INTERVAL_S:
            totals, self._last_totals = self.meter.totals(), now
        return MeteredEvents(events, energies, totals)

    def close(self) -> None:
        self.meter.close()


@dataclass
class _Seen:
    """What the gateway saw of a request's steps on a self-metering replica (for one lost with its node)."""

    node_ids: set[str] = field(default_factory=set)
    device_seconds: float = 0.0
    flops: float = 0.0
    num_steps: int = 0


@dataclass
class ReplicaBooks:
    """One self-metering replica (one start of it) as the gateway knows it."""

    replica_id: str
    node_id: str
    node: str
    source: str
    flop_shape: FlopShape
    totals: MeterTotals | None = None
    num_reported: int = 0  # RequestEnergy records received


@dataclass
class _Billed:
    joules: float = 0.0
    num_requests: int = 0
    num_lost: int = 0
    unbilled_joules: float = 0.0


@dataclass(frozen=True)
class NodeBooks:
    """A node's energy, summed over the replicas that meter it (GET /fleet/nodes, tests)."""

    node_id: str
    node: str
    sources: tuple[str, ...]
    replicas: tuple[str, ...]
    energy_joules: float | None  # read from the node's sources since its replicas started
    attributed_joules: float | None
    idle_joules: float | None
    unattributed_joules: float | None
    unsettled_joules: float | None
    billed_joules: float  # settled into ledger rows by the gateway
    unbilled_joules: float  # measured here, in no ledger row: reported after the request was settled, or part
    # of a request whose energy is partly unknown (it also ran on a node that was lost)
    num_requests_billed: int
    num_requests_lost: int  # ended with the node before their energy came back: energy null


class NodeEnergy:
    """The gateway's books of the self-metering replicas (see the module's docstring). Thread-safe: receivers
    record, the event loop finishes requests."""

    MAX_SETTLED_REMEMBERED = 100_000

    def __init__(self, prices: Prices) -> None:
        self.prices = prices
        self._lock = threading.Lock()
        self._replicas: dict[str, ReplicaBooks] = {}  # by replica id and node (a restart elsewhere: a new entry)
        self._node_to_shape: dict[str, FlopShape] = {}
        self._request_id_to_parts: dict[str, list[tuple[str, RequestEnergy]]] = {}
        self._seen: dict[str, _Seen] = {}
        self._settled: OrderedDict[str, None] = OrderedDict()  # recently finished here: a later report is late
        self._node_to_billed: dict[str, _Billed] = {}

    def attach(self, replica_id: str, node_id: str, node: str, source: str, flop_shape: FlopShape
               ) -> Callable[[MeteredEvents], None]:
        """A replica (or its restart) starts reporting; returns what its transport calls with each batch."""
        key = f"{replica_id}@{node_id}"
        with self._lock:
            self._replicas[key] = ReplicaBooks(replica_id, node_id, node, source, flop_shape)
            self._node_to_shape[node_id] = flop_shape
        return lambda batch: self.record(key, batch)

    def record(self, key: str, batch: MeteredEvents) -> None:
        with self._lock:
            books = self._replicas[key]
            if batch.totals is not None:
                books.totals = batch.totals
            for energy in batch.energies:
                books.num_reported += 1
                if energy.request_id in self._settled:  # settled here already: the node spent it, nobody billed
                    self._billed(books.node_id).unbilled_joules += energy.energy_joules or 0.0
                else:
                    self._request_id_to_parts.setdefault(energy.request_id, []).append((books.node_id, energy))

    def on_step(self, step: StepStats) -> None:
        """A labelled step of a self-metering replica: what it did for each request, in case its node is lost."""
        with self._lock:
            shape = self._node_to_shape.get(step.node or "")
            if shape is None:
                return
            request_id_to_flops: dict[str, float] = {}
            for w in step.work:
                request_id_to_flops[w.request_id] = request_id_to_flops.get(w.request_id, 0.0) + work_flops(
                    shape, w.num_new_tokens, w.num_context_tokens)
            total = sum(request_id_to_flops.values())
            for rid, flops in request_id_to_flops.items():
                seen = self._seen.setdefault(rid, _Seen())
                seen.node_ids.add(step.node or "")
                seen.flops += flops
                seen.num_steps += 1
                seen.device_seconds += step.duration_s * (flops / total if total > 0 else 1 / len(request_id_to_flops))

    def owns(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._request_id_to_parts or request_id in self._seen

    def finish_request(self, request_id: str, num_output_tokens: int | None = None) -> RequestEnergy:
        """The replicas' RequestEnergy (their sum, if a re-routed request ran on two) with the gateway's token
        count; a request lost with its node: null energy, the device-seconds and FLOPs of the steps seen."""
        with self._lock:
            parts = self._request_id_to_parts.pop(request_id, [])
            seen = self._seen.pop(request_id, None)
            self._settled[request_id] = None
            while len(self._settled) > self.MAX_SETTLED_REMEMBERED:
                self._settled.popitem(last=False)
            reported = {node_id for node_id, _ in parts}
            if parts and (seen is None or seen.node_ids <= reported):
                for node_id, energy in parts:
                    billed = self._billed(node_id)
                    billed.joules += energy.energy_joules or 0.0
                    billed.num_requests += 1
                return dataclasses.replace(merge_parts([e for _, e in parts]), num_output_tokens=num_output_tokens)
            for node_id, energy in parts:  # measured, but part of the request's energy is unknown: in no row
                self._billed(node_id).unbilled_joules += energy.energy_joules or 0.0
            for node_id in (seen.node_ids - reported) if seen is not None else ():
                self._billed(node_id).num_lost += 1
        seen = seen or _Seen()
        cost_device = self.prices.device_cost_usd(seen.device_seconds)
        return RequestEnergy(request_id=request_id, energy_joules=None, energy_source=None, energy_scope=None,
                             energy_overhead_factor=self.prices.energy_overhead_factor, facility_energy_joules=None,
                             device_seconds=seen.device_seconds, flops=seen.flops, num_steps=seen.num_steps,
                             num_output_tokens=num_output_tokens, cost_device_usd=cost_device, cost_energy_usd=None,
                             cost_usd=None)

    def _billed(self, node_id: str) -> _Billed:
        return self._node_to_billed.setdefault(node_id, _Billed())

    def nodes(self) -> list[NodeBooks]:
        with self._lock:
            by_node: dict[str, list[ReplicaBooks]] = {}
            for books in self._replicas.values():
                by_node.setdefault(books.node_id, []).append(books)
            return [self._node(node_id, group) for node_id, group in sorted(by_node.items())]

    def _node(self, node_id: str, group: Sequence[ReplicaBooks]) -> NodeBooks:
        totals = [b.totals for b in group if b.totals is not None]

        def total(name: str) -> float | None:
            values = [getattr(t, name) for t in totals]
            return None if not values or None in values else sum(values)
        measured = [sum(t.energy_joules_by_source.values()) for t in totals if t.energy_joules_by_source]
        billed = self._node_to_billed.get(node_id, _Billed())
        return NodeBooks(node_id, group[0].node, tuple(sorted({b.source for b in group})),
                         tuple(b.replica_id for b in group), sum(measured) if measured else None,
                         total("attributed_joules"), total("idle_joules"), total("unattributed_joules"),
                         total("unsettled_joules"), billed.joules, billed.unbilled_joules, billed.num_requests,
                         billed.num_lost)


def merge_parts(parts: Sequence[RequestEnergy]) -> RequestEnergy:
    """One request's energy from the replicas that ran it (one, unless it was re-routed): sums, null if any is."""
    if len(parts) == 1:
        return parts[0]

    def total(name: str) -> float | None:
        values = [getattr(p, name) for p in parts]
        return None if None in values else sum(values)
    return dataclasses.replace(
        parts[-1], energy_joules=total("energy_joules"), facility_energy_joules=total("facility_energy_joules"),
        device_seconds=sum(p.device_seconds for p in parts), flops=sum(p.flops for p in parts),
        num_steps=sum(p.num_steps for p in parts), cost_device_usd=sum(p.cost_device_usd for p in parts),
        cost_energy_usd=total("cost_energy_usd"), cost_usd=total("cost_usd"),
        energy_source=parts[-1].energy_source if total("energy_joules") is not None else None)
