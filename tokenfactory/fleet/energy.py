"""Energy and cost of the requests an external backend served, and the gateway's one meter over the fleet.

Our own replicas on this machine (local processes) send their steps to the gateway's `Meter` as `StepStats`
(they share its power source, so one meter splits the machine's energy across all their steps); Ray replicas
meter their own node and send each request's RequestEnergy (fleet/node_energy.py). An external backend sends no
steps: unless a power source for its device is given, its energy is *modelled* and labelled so, from the
catalog's figures for its device profile:

    device_seconds(r) = ∫ dt / n(t)   over r's time in the backend, n(t) its requests in flight from us
    energy(r)         = device_seconds(r) · P_busy                                     [J = s · W]

P_busy is the device's TDP from the catalog (`planner/data`), an upper bound stated as such; the backend's
own idle time is not ours to bill. `FleetMeter` is what the gateway's accounting holds: a request a backend
served is finished by that backend's model, every other by the meter.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenfactory.fleet.node_energy import NodeEnergy
from tokenfactory.meter.attribution import Meter, RequestEnergy
from tokenfactory.meter.prices import Prices
from tokenfactory.types import StepStats


@dataclass
class _Flight:
    device_seconds: float = 0.0


class BackendEnergy:
    """Modelled energy of one backend's requests (see the module's docstring)."""

    def __init__(self, replica_id: str, busy_watts: float, scope: str, prices: Prices,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.replica_id, self.busy_watts, self.scope, self.prices = replica_id, busy_watts, scope, prices
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, _Flight] = {}
        self._done: dict[str, _Flight] = {}
        self._last = clock()
        self.total_joules = 0.0
        self.total_device_seconds = 0.0

    def on_request(self, request_id: str, started: bool) -> None:
        with self._lock:
            self._advance()
            if started:
                self._in_flight[request_id] = self._done.pop(request_id, None) or _Flight()
            elif (flight := self._in_flight.pop(request_id, None)) is not None:
                self._done[request_id] = flight

    def _advance(self) -> None:
        now = self._clock()
        if self._in_flight:
            share = (now - self._last) / len(self._in_flight)
            for flight in self._in_flight.values():
                flight.device_seconds += share
        self._last = now

    def owns(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._done or request_id in self._in_flight

    def finish_request(self, request_id: str, num_output_tokens: int | None = None) -> RequestEnergy:
        with self._lock:
            self._advance()
            flight = self._done.pop(request_id, None) or self._in_flight.pop(request_id, None) or _Flight()
        seconds = flight.device_seconds
        joules = seconds * self.busy_watts
        self.total_joules += joules
        self.total_device_seconds += seconds
        prices = self.prices
        cost_device, cost_energy = prices.device_cost_usd(seconds), prices.energy_cost_usd(joules)
        return RequestEnergy(request_id=request_id, energy_joules=joules, energy_source="modelled",
                             energy_scope=self.scope, energy_overhead_factor=prices.energy_overhead_factor,
                             facility_energy_joules=joules * prices.energy_overhead_factor, device_seconds=seconds,
                             flops=0.0, num_steps=0, num_output_tokens=num_output_tokens,
                             cost_device_usd=cost_device, cost_energy_usd=cost_energy,
                             cost_usd=cost_device + cost_energy)


class FleetMeter:
    """The gateway's meter over a fleet: backends' requests by their model, Ray replicas' by their own node's
    meter (`nodes`, fleet/node_energy.py), the rest by `meter` (this machine's power source). A step labelled
    with an energy source was metered where it ran: it goes to the node books, never into this machine's split.
    Everything else (totals, listeners, close) is the meter's."""

    def __init__(self, meter: Meter, backends: Sequence[BackendEnergy], nodes: NodeEnergy | None = None) -> None:
        self.meter, self.backends, self.nodes = meter, list(backends), nodes

    def on_step(self, step: StepStats) -> None:
        if step.energy_source is not None:
            if self.nodes is not None:
                self.nodes.on_step(step)
            return
        self.meter.on_step(step)

    def finish_request(self, request_id: str, num_output_tokens: int | None = None) -> RequestEnergy:
        for backend in self.backends:
            if backend.owns(request_id):
                return backend.finish_request(request_id, num_output_tokens)
        if self.nodes is not None and self.nodes.owns(request_id):
            return self.nodes.finish_request(request_id, num_output_tokens)
        return self.meter.finish_request(request_id, num_output_tokens)

    def __getattr__(self, name: str) -> object:
        return getattr(self.meter, name)
