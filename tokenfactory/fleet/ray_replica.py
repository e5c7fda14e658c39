"""A replica as a Ray actor (`serve --ray [ADDRESS]`): Ray places it with its CPU/GPU resources where the
placement says, keeps its process, and tells us when it dies; the engine inside runs the same `serve_worker` as
a local process, and meters its own node (fleet/node_energy.py).

Inside the actor a thread of our own builds, warms up and steps the engine (AsyncEngine.launch says why it
must be one thread), and a metering thread turns each batch the engine emits into `MeteredEvents` (its steps
through the replica's meter, labelled with the node and source; the RequestEnergy of each request that ended):
the power source is read off the engine's thread, as in process. Ray's threads only move data: `send(seq,
messages)` puts messages in the worker's inbox (in `seq` order: a threaded actor does not promise the order of
calls), and `poll(timeout)` returns the batches made since the last poll, or nothing after `timeout` (so a hung
engine is silent, not heartbeating). On this side, `RayTransport` keeps one poll in flight, hands each batch's
energy to the gateway's books before the batch's outputs, and turns a dead actor (or node) into `WorkerLost`.

Placement (`RayPlacement`): `spread` asks Ray for its SPREAD strategy (replicas on different nodes while there
are nodes); `pack` puts a replica on the node that already holds most of this fleet's replicas, or before any
has landed on the biggest node that fits one (`pack_node`), while it has room (a soft node affinity: Ray places
it elsewhere when that node is full or gone); `resources` are custom node
resources every replica needs (`ray start --resources '{"big_box": 1}'` labels a node), so a fleet can be kept
to the nodes an operator chose.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenfactory.engine.client import Message, Shutdown, WorkerEvents, WorkerReady
from tokenfactory.fleet.remote import RemoteEngine, WorkerLost
from tokenfactory.types import ParameterError

if TYPE_CHECKING:
    from tokenfactory.config import EngineConfig
    from tokenfactory.fleet.node_energy import MeteredEvents, NodeEnergy, ReplicaMetering

logger = logging.getLogger(__name__)

PLACEMENTS = ("spread", "pack")


@dataclass(frozen=True)
class RayPlacement:
    """Where a fleet's Ray replicas go (see the module's docstring)."""

    strategy: str = "spread"
    resources: Mapping[str, float] = field(default_factory=dict)  # custom node resources each replica needs

    def __post_init__(self) -> None:
        if self.strategy not in PLACEMENTS:
            raise ParameterError("ray_placement", f"ray_placement must be one of {', '.join(PLACEMENTS)}, "
                                 f"got {self.strategy!r}")
        if any(v <= 0 for v in self.resources.values()):
            raise ParameterError("ray_resource", "each --ray-resource amount must be > 0")


class EngineActorImpl:
    """The actor's body (wrapped by `ray.remote` in `actor_class`)."""

    def __init__(self, config: EngineConfig, threads: int | None, metering: ReplicaMetering | None = None,
                 num_cpus: float = 1.0, uses_gpu: bool = False) -> None:
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._emitted: queue.SimpleQueue[WorkerEvents | None] = queue.SimpleQueue()  # the engine's, unmetered
        self._events: queue.SimpleQueue[MeteredEvents | WorkerReady | WorkerEvents] = queue.SimpleQueue()
        self._next_seq, self._held = 0, {}
        self._order = threading.Lock()
        threading.Thread(target=self._run, args=(config, threads, metering, num_cpus, uses_gpu),
                         name="tokenfactory-engine", daemon=True).start()

    def _run(self, config: EngineConfig, threads: int | None, metering: ReplicaMetering | None, num_cpus: float,
             uses_gpu: bool) -> None:
        import ray

        from tokenfactory.engine.worker import serve_worker, worker_ready
        from tokenfactory.fleet.node_energy import ReplicaMeter
        from tokenfactory.fleet.process import build_engine

        try:
            engine = build_engine(config, threads)
            node_id = ray.get_runtime_context().get_node_id()
            meter = (ReplicaMeter(metering, engine.model_config, num_cpus, uses_gpu, node_id, str(engine.device))
                     if metering is not None else None)
        except BaseException as e:  # noqa: BLE001 - told to the driver, which refuses to start the replica
            self._events.put(WorkerEvents(dead_reason=f"{type(e).__name__}: {e}"))
            return
        ready = worker_ready(engine)
        where = dataclasses.replace(ready.facts, node=ray.util.get_node_ip_address(), node_id=node_id,
                                    energy_source=meter.source if meter is not None else None)
        self._events.put(dataclasses.replace(ready, facts=where))
        threading.Thread(target=self._meter, args=(meter,), name="tokenfactory-meter", daemon=True).start()

        def recv(timeout_s: float | None) -> list[Message]:
            messages = []
            try:
                messages.append(self._inbox.get(timeout=timeout_s) if timeout_s else self._inbox.get_nowait())
                while True:
                    messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

        try:
            serve_worker(engine, recv, self._emitted.put)
        finally:
            self._emitted.put(None)

    def _meter(self, meter: Any) -> None:  # noqa: ANN401 - a ReplicaMeter, or None: the gateway meters
        """The metering thread: each emitted batch through the replica's meter, in order."""
        from tokenfactory.fleet.node_energy import MeteredEvents

        while (events := self._emitted.get()) is not None:
            metered = MeteredEvents(events)
            if meter is not None:
                try:
                    metered = meter.meter_batch(events)
                except Exception:  # noqa: BLE001 - a meter's bug costs this batch's energy (null), never its outputs
                    logger.exception("replica meter: a batch could not be metered")
                    metered = MeteredEvents(meter.label(events))  # still this node's steps, not the gateway's
            self._events.put(metered)
        if meter is not None:
            meter.close()

    def ready(self, timeout_s: float) -> WorkerReady | WorkerEvents | None:
        try:
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def send(self, seq: int, messages: list[Message]) -> None:
        with self._order:
            self._held[seq] = messages
            while self._next_seq in self._held:
                for m in self._held.pop(self._next_seq):
                    self._inbox.put(m)
                self._next_seq += 1

    def poll(self, timeout_s: float) -> list[MeteredEvents | WorkerEvents]:
        batches = []
        try:
            batches.append(self._events.get(timeout=timeout_s))
            while True:
                batches.append(self._events.get_nowait())
        except queue.Empty:
            return batches

    def pid(self) -> int:
        import os

        return os.getpid()


_ACTOR_CLASS: Any = None


def actor_class() -> Any:
    """`EngineActorImpl` as a Ray actor class (Ray imported only when a Ray fleet is asked for)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray

        _ACTOR_CLASS = ray.remote(max_concurrency=4)(EngineActorImpl)
    return _ACTOR_CLASS


class RayTransport:
    """Messages to an engine actor, its batches back (see fleet/remote.py's Transport). `on_energy` (the
    gateway's NodeEnergy books) gets each metered batch before RemoteEngine delivers its outputs."""

    POLL_S = 0.5

    def __init__(self, actor: Any, on_energy: Callable[[MeteredEvents], None] | None = None) -> None:  # noqa: ANN401
        import ray

        self._ray, self.actor = ray, actor
        self.on_energy = on_energy
        self._seq = itertools.count()
        self._seq_lock = threading.Lock()
        self._poll: Any = None
        self._pending: list[MeteredEvents | WorkerEvents] = []

    def send(self, message: Message) -> None:
        with self._seq_lock:  # the sequence numbers in the order the calls are submitted
            self.actor.send.remote(next(self._seq), [message])

    def recv(self, timeout_s: float) -> WorkerEvents | None:
        if not self._pending:
            if self._poll is None:
                self._poll = self.actor.poll.remote(self.POLL_S)
            done, _ = self._ray.wait([self._poll], timeout=timeout_s)
            if not done:
                return None
            ref, self._poll = self._poll, None
            try:
                self._pending = list(self._ray.get(ref))
            except self._ray.exceptions.RayError as e:
                raise WorkerLost(f"the Ray actor is gone ({type(e).__name__})") from e
            if not self._pending:
                return None  # the actor is there, the engine said nothing: silence counts toward a hang
        batch = self._pending.pop(0)
        if isinstance(batch, WorkerEvents):
            return batch  # the actor's last word before it started (a failed build)
        if self.on_energy is not None and (batch.energies or batch.totals is not None or batch.events.steps):
            self.on_energy(batch)
        return batch.events

    def close(self, timeout_s: float) -> None:
        try:
            self._ray.get(self.actor.poll.remote(0.0), timeout=min(timeout_s, 5.0))
        except Exception:  # noqa: BLE001, S110 - it is being stopped either way
            pass
        self.kill()

    def kill(self) -> None:
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001, S110 - already gone
            pass


class Placer:
    """Ray options for each replica of one fleet. `pack` chooses its node when asked, not when a replica is up:
    a fleet's replicas start in parallel, so the second asks before the first has landed. Its node is the one
    holding most of the fleet's live replicas, else the one it chose before while that is alive, else the alive
    node with the most CPUs that has every resource a replica asks for (ties: the lowest node id)."""

    def __init__(self, placement: RayPlacement) -> None:
        self.placement = placement
        self.replica_to_node: dict[str, str] = {}
        self._target: str | None = None
        self._lock = threading.Lock()

    def options(self, replica_id: str, num_cpus: float = 1.0, num_gpus: float = 0.0) -> dict[str, Any]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts: dict[str, Any] = {"resources": dict(self.placement.resources)} if self.placement.resources else {}
        if self.placement.strategy == "spread":
            return opts | {"scheduling_strategy": "SPREAD"}
        node_to_resources = {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
        needs = {"CPU": num_cpus, "GPU": num_gpus, **self.placement.resources}
        with self._lock:
            self.replica_to_node.pop(replica_id, None)  # a restart: where it was does not count
            node = pack_node(self.replica_to_node.values(), self._target, node_to_resources, needs)
            self._target = node
        if node is None:
            return opts  # no node fits now: Ray queues it until one does
        return opts | {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}

    def placed(self, replica_id: str, node_id: str | None) -> None:
        if node_id is not None:
            with self._lock:
                self.replica_to_node[replica_id] = node_id


def pack_node(placed: Iterable[str], target: str | None, node_to_resources: Mapping[str, Mapping[str, float]],
              needs: Mapping[str, float]) -> str | None:
    """The node `pack` sends the next replica to (see Placer), as data: the placed replicas' nodes, the node
    chosen before, each alive node's total resources, and what a replica needs."""
    counts = collections.Counter(n for n in placed if n in node_to_resources)
    if counts:
        return min(counts, key=lambda n: (-counts[n], n))
    if target in node_to_resources:
        return target
    fits = [n for n, have in node_to_resources.items() if all(have.get(k, 0.0) >= v for k, v in needs.items() if v)]
    return min(fits, key=lambda n: (-node_to_resources[n].get("CPU", 0.0), n)) if fits else None


def start_ray_replica(name: str, config: EngineConfig, threads: int | None = None, num_cpus: float = 1.0,
                      num_gpus: float = 0.0, hang_timeout_s: float = 10.0, ready_timeout_s: float = 600.0,
                      placer: Placer | None = None, metering: ReplicaMetering | None = None,
                      energy: NodeEnergy | None = None) -> RemoteEngine:
    """Place an engine actor with its resources; returns once its engine is ready (raises if it cannot be).
    With `metering` the replica meters its node and reports to `energy` (the gateway's books)."""
    import ray

    options = placer.options(name, num_cpus, num_gpus) if placer is not None else {}
    actor = actor_class().options(num_cpus=num_cpus, num_gpus=num_gpus, name=None, **options).remote(
        config, threads, metering, num_cpus, num_gpus > 0)
    transport = RayTransport(actor)
    try:
        first = ray.get(actor.ready.remote(ready_timeout_s), timeout=ready_timeout_s + 60)
    except ray.exceptions.RayError as e:
        transport.kill()
        raise RuntimeError(f"replica {name} could not start on Ray: {e}") from e
    if not isinstance(first, WorkerReady):
        transport.kill()
        reason = first.dead_reason if isinstance(first, WorkerEvents) else f"not ready in {ready_timeout_s:g} s"
        raise RuntimeError(f"replica {name} could not start on Ray: {reason}")
    facts = dataclasses.replace(first.facts, pid=ray.get(actor.pid.remote()))
    if placer is not None:
        placer.placed(name, facts.node_id)
    if energy is not None and facts.energy_source is not None and facts.node_id is not None:
        transport.on_energy = energy.attach(name, facts.node_id, facts.node or "?", facts.energy_source,
                                            first.info.config)
    return RemoteEngine(name, transport, dataclasses.replace(first, facts=facts), hang_timeout_s, kind="ray")


__all__ = ["EngineActorImpl", "Placer", "RayPlacement", "RayTransport", "Shutdown", "actor_class", "pack_node",
           "start_ray_replica"]
