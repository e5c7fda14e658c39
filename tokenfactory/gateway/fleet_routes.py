"""The fleet's routes and metrics: `/fleet/replicas` (list, drain, undrain) and per-replica series in /metrics.

Replica management is an operator's: with `--auth` it needs an admin key, without it a loopback client.
Per replica, /metrics carries `tokenfactory:replica_up`, its running and waiting requests, KV usage, the
outstanding tokens the router counts, and counters of requests routed, re-routed away and failed mid-stream
(docs/fleet.md); the fleet's sums stay under the single-engine names, so a dashboard carries over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenfactory.fleet.fleet import Fleet, ReplicaStatus
from tokenfactory.gateway.auth import principal_of
from tokenfactory.gateway.dashboard import is_loopback
from tokenfactory.gateway.errors import APIError
from tokenfactory.service.tenancy import Tenancy

P = "tokenfactory:"


class ReplicaCollector(Collector):
    def __init__(self, fleets: Sequence[Fleet]) -> None:
        self.fleets = list(fleets)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        statuses = [s for fleet in self.fleets for s in fleet.status()]
        labels = ["model_name", "replica", "kind"]

        def family(cls: type, name: str, doc: str, value: object) -> GaugeMetricFamily | CounterMetricFamily:
            f = cls(P + name, doc, labels=labels)
            for s in statuses:
                f.add_metric([s.model, s.replica_id, s.kind], float(value(s)))  # type: ignore[operator]
            return f

        g, c = GaugeMetricFamily, CounterMetricFamily
        yield family(g, "replica_up", "1 while the replica takes new requests (alive, not draining)",
                     lambda s: s.alive and s.state == "ready")
        yield family(g, "replica_num_requests_running", "Sequences in the replica's batch",
                     lambda s: s.stats.num_running)
        yield family(g, "replica_num_requests_waiting", "Sequences waiting in the replica",
                     lambda s: s.stats.num_waiting)
        yield family(g, "replica_kv_cache_usage_perc", "The replica's KV-cache usage (1 = full)",
                     lambda s: s.stats.kv_cache_usage)
        yield family(g, "replica_outstanding_tokens", "Tokens the router counts as outstanding on the replica",
                     lambda s: s.outstanding_tokens)
        yield family(c, "replica_requests_routed", "Requests routed to the replica", lambda s: s.num_routed)
        yield family(c, "replica_requests_rerouted", "Requests moved away from the replica before any output",
                     lambda s: s.num_rerouted_away)
        yield family(c, "replica_requests_failed_mid_stream", "Requests that ended with an error because the "
                     "replica failed after their first output", lambda s: s.num_failed_mid_stream)
        yield family(c, "replica_restarts", "Times the replica was restarted", lambda s: s.num_restarts)


def status_json(s: ReplicaStatus) -> dict:
    d = dataclasses.asdict(s)
    stats = d.pop("stats")
    d["num_running"], d["num_waiting"] = stats["num_running"], stats["num_waiting"]
    d["kv_cache_usage"] = s.stats.kv_cache_usage
    d["num_prefix_hits"], d["num_prefix_queries"] = stats["num_prefix_hits"], stats["num_prefix_queries"]
    return d


def fleet_down(fleet: Fleet) -> dict[str, str]:
    """Replicas not taking requests, and why (for /health: the fleet serves on, degraded)."""
    return {s.replica_id: s.down_reason or s.state for s in fleet.status() if not (s.alive and s.state == "ready")}


def install_fleet_routes(app: FastAPI, fleets: Sequence[Fleet], registry: CollectorRegistry, tenancy: Tenancy
                         ) -> None:
    """The routes over every model's fleet; replica ids are unique across them (launch.py prefixes them)."""
    registry.register(ReplicaCollector(fleets))

    def owner(replica_id: str) -> Fleet:
        fleet = next((f for f in fleets if replica_id in f.replicas), None)
        if fleet is None:
            raise APIError(404, f"no replica {replica_id!r}; see GET /fleet/replicas", "not_found_error",
                           "replica_id")
        return fleet

    def check_operator(request: Request) -> None:
        if tenancy.auth_on:
            if not principal_of(request).is_admin:
                raise APIError(403, "managing replicas needs an admin key", "permission_error")
            return
        if not is_loopback(request.client.host if request.client else ""):
            raise APIError(403, "without --auth, replicas are managed from this machine only", "permission_error")

    @app.get("/fleet/replicas")
    async def list_replicas(request: Request) -> dict:
        check_operator(request)
        decisions = [{"model": f.model, **dataclasses.asdict(d)} for f in fleets for d in f.decisions[-20:]]
        return {"object": "list", "models": {f.model: {"router": f.router.name} for f in fleets},
                "data": [status_json(s) for f in fleets for s in f.status()], "recent_decisions": decisions}

    @app.post("/fleet/replicas/{replica_id}/drain")
    async def drain(replica_id: str, request: Request) -> dict:
        check_operator(request)
        fleet = owner(replica_id)
        fleet.drain(replica_id)
        return status_json(next(s for s in fleet.status() if s.replica_id == replica_id))

    @app.post("/fleet/replicas/{replica_id}/undrain")
    async def undrain(replica_id: str, request: Request) -> dict:
        check_operator(request)
        fleet = owner(replica_id)
        fleet.undrain(replica_id)
        return status_json(next(s for s in fleet.status() if s.replica_id == replica_id))
