"""The real fleet as an autoscaler's `ReplicaPool`, and the controller's thread for `serve --autoscaler`.

`FleetPool` turns `Fleet.status()` into `ReplicaLoad`s (tokens/s from the snapshots' generated-token counters
between ticks), starts a replica with the factory on a thread of its own (a process replica loads its model
for seconds; the controller keeps ticking, and counts it as `starting`, so it is not started twice), adds it
with `Fleet.add_replica` once it is ready, and measures that cold start. `stop` is `Fleet.remove_replica` of a
drained replica with nothing outstanding, also on its own thread. The last replica is stopped only with
`allow_zero` (`--min-replicas 0`): the fleet then holds requests (`Fleet.hold_s`) until the controller, seeing
them held, starts one.

The step listener feeds the latency window: every step that decoded gave each of its decoding sequences one
token, so its duration is a TPOT sample.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenfactory.fleet.autoscaler import Controller, LatencyWindow, ReplicaLoad
from tokenfactory.fleet.fleet import Fleet, Replica
from tokenfactory.types import StepStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ColdStart:
    replica_id: str
    option: str
    seconds: float
    joules: float  # seconds x the replica's idle watts: what it cost before serving (modelled)
    ok: bool
    error: str | None = None


class FleetPool:
    """A `ReplicaPool` over a real `Fleet` (see the module's docstring)."""

    def __init__(self, fleet: Fleet, factory: Callable[[str, str], Replica], option: str = "local",
                 clock: Callable[[], float] = time.monotonic, prefix: str = "a", allow_zero: bool = False) -> None:
        """`allow_zero`: the last replica may be stopped too (scale to zero; the fleet holds requests meanwhile)."""
        self.fleet, self.model, self.factory, self.option = fleet, fleet.model, factory, option
        self.allow_zero = allow_zero
        self.clock, self.prefix = clock, prefix
        self.starting: dict[str, str] = {}  # replica id -> option
        self.stopping: set[str] = set()
        self.cold_starts: list[ColdStart] = []
        self.id_to_option: dict[str, str] = {}
        self._last_tokens: dict[str, tuple[float, int]] = {}
        self._num_started = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def loads(self, now: float) -> list[ReplicaLoad]:
        out = []
        for s in self.fleet.status():
            if s.replica_id in self.stopping:
                continue
            prev_t, prev_n = self._last_tokens.get(s.replica_id, (now, s.stats.num_generation_tokens_total))
            rate = (s.stats.num_generation_tokens_total - prev_n) / (now - prev_t) if now > prev_t else 0.0
            self._last_tokens[s.replica_id] = (now, s.stats.num_generation_tokens_total)
            state = {"ready": "ready", "draining": "draining"}.get(s.state, "starting")  # down/restarting: back soon
            out.append(ReplicaLoad(s.replica_id, state, self.id_to_option.get(s.replica_id, self.option),
                                   s.stats.num_running, s.stats.num_waiting, s.stats.max_num_seqs,
                                   s.stats.kv_cache_usage, s.num_outstanding, rate, None))
        with self._lock:
            out += [ReplicaLoad(rid, "starting", option, 0, 0, 1, 0.0, 0, 0.0, None)
                    for rid, option in self.starting.items()]
        return out

    def start(self, option: str) -> str:
        with self._lock:
            while (rid := f"{self.prefix}{self._num_started}") in self.fleet.replicas:
                self._num_started += 1
            self._num_started += 1
            self.starting[rid] = option
        self._spawn(self._start, rid, option, name=f"scale-up-{rid}")
        return rid

    def _start(self, replica_id: str, option: str) -> None:
        t0 = self.clock()
        try:
            replica = self.factory(replica_id, option)
            self.fleet.add_replica(replica)
        except Exception as e:  # noqa: BLE001 - a replica that cannot start is reported; the policy retries
            logger.warning("autoscaler: replica %s did not start: %s", replica_id, e)
            self.cold_starts.append(ColdStart(replica_id, option, self.clock() - t0, 0.0, False, str(e)))
        else:
            seconds = self.clock() - t0
            self.id_to_option[replica_id] = option
            self.cold_starts.append(ColdStart(replica_id, option, seconds, seconds * replica.idle_watts, True))
        finally:
            with self._lock:
                self.starting.pop(replica_id, None)

    def drain(self, replica_id: str) -> None:
        if replica_id in self.fleet.replicas:
            self.fleet.drain(replica_id)

    def undrain(self, replica_id: str) -> None:
        if replica_id in self.fleet.replicas:
            self.fleet.undrain(replica_id)

    def stop(self, replica_id: str) -> None:
        live = [r for r in self.fleet.replicas if r not in self.stopping]
        floor = 0 if self.allow_zero else 1
        if replica_id not in self.fleet.replicas or replica_id in self.stopping or len(live) <= floor:
            return
        self.stopping.add(replica_id)
        self._spawn(self._stop, replica_id, name=f"scale-down-{replica_id}")

    def _stop(self, replica_id: str) -> None:
        try:
            self.fleet.remove_replica(replica_id)
        finally:
            self.stopping.discard(replica_id)

    def _spawn(self, target: Callable[..., None], *args: str, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def wait(self, timeout_s: float = 60.0) -> None:
        """Until every start and stop under way has finished (tests, shutdown)."""
        for t in list(self._threads):
            t.join(timeout_s)


def observe_steps(fleet: Fleet, latency: LatencyWindow, clock: Callable[[], float] = time.monotonic) -> None:
    """Each step that decoded is a TPOT sample for the latency window (the module's docstring says why)."""
    def on_step(step: StepStats) -> None:  # on a replica's receiver thread: it must not raise
        if step.num_decode_tokens:
            latency.observe(clock(), None, step.duration_s)
    fleet.subscribe_steps(on_step)


class ControllerThread:
    """Ticks a controller every `interval_s` on the monotonic clock until stopped."""

    def __init__(self, controller: Controller, interval_s: float) -> None:
        self.controller, self.interval_s = controller, interval_s
        self.before_tick: Callable[[float], None] | None = None  # e.g. the gateway's TTFT histogram into the window
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                now = time.monotonic()
                if self.before_tick is not None:
                    self.before_tick(now)
                self.controller.tick(now)
            except Exception:  # noqa: BLE001 - one bad tick must not end autoscaling
                logger.exception("autoscaler tick failed")
