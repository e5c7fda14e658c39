"""The replicas' routes and metrics: `/fleet/replicas` (list, drain, undrain) and per-replica series in /metrics.

Built on what every engine client offers (`replica_states()`: one for a single engine, one per replica of a
fleet; `DrainReplica` sent through the client), so the gateway does not care what stands behind a model.
Replica management is an operator's: with `--auth` it needs an admin key, without it a loopback client.
Per replica, /metrics carries `tokenfactory:replica_up`, its running and waiting requests, KV usage, the
outstanding tokens the router counts, and counters of requests routed, re-routed away and failed mid-stream
(docs/fleet.md); the fleet's sums stay under the single-engine names, so a dashboard carries over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenfactory.engine.client import DrainReplica, EngineClient, ReplicaState
from tokenfactory.fleet.node_energy import NodeBooks, NodeEnergy
from tokenfactory.gateway.auth import principal_of
from tokenfactory.gateway.dashboard import is_loopback
from tokenfactory.gateway.errors import APIError
from tokenfactory.service.tenancy import Tenancy

P = "tokenfactory:"

Models = Callable[[], Mapping[str, EngineClient]]  # served name -> its client, read at each call


def states_of(models: Mapping[str, EngineClient]) -> list[tuple[str, ReplicaState]]:
    """(model, state) of every engine behind every served model."""
    return [(name, s) for name, client in models.items() for s in client.replica_states()]


class ReplicaCollector(Collector):
    def __init__(self, models: Models) -> None:
        self.models = models

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        states = states_of(self.models())
        labels = ["model_name", "replica", "kind"]

        def family(cls: type, name: str, doc: str, value: Callable[[ReplicaState], float]
                   ) -> GaugeMetricFamily | CounterMetricFamily:
            f = cls(P + name, doc, labels=labels)
            for model, s in states:
                f.add_metric([model, s.replica_id, s.kind], float(value(s)))
            return f

        g, c = GaugeMetricFamily, CounterMetricFamily
        yield family(g, "replica_up", "1 while the replica takes new requests (alive, not draining)", lambda s: s.up)
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


def status_json(model: str, s: ReplicaState) -> dict:
    d = {"model": model, **dataclasses.asdict(s)}
    stats, facts = d.pop("stats"), d.pop("facts")
    d |= {k: facts[k] for k in ("device", "pid", "url", "node", "node_id", "energy_source")}
    d["num_running"], d["num_waiting"] = stats["num_running"], stats["num_waiting"]
    d["kv_cache_usage"] = s.stats.kv_cache_usage
    d["num_prefix_hits"], d["num_prefix_queries"] = stats["num_prefix_hits"], stats["num_prefix_queries"]
    return d


def replicas_down(models: Mapping[str, EngineClient]) -> dict[str, str]:
    """Replicas not taking requests, and why (for /health: the others serve on, degraded). A single engine is
    not listed: when it stops, the model is down (its own /health line)."""
    return {s.replica_id: s.down_reason or s.state for _, s in states_of(models)
            if not s.up and s.kind != "engine"}


def check_operator(tenancy: Tenancy, request: Request) -> None:
    if tenancy.auth_on:
        if not principal_of(request).is_admin:
            raise APIError(403, "managing replicas needs an admin key", "permission_error")
        return
    if not is_loopback(request.client.host if request.client else ""):
        raise APIError(403, "without --auth, replicas are managed from this machine only", "permission_error")


def install_fleet_routes(app: FastAPI, models: Models, registry: CollectorRegistry, tenancy: Tenancy) -> None:
    """The routes over every served model's replicas; replica ids are unique across them (launch.py prefixes
    them)."""
    registry.register(ReplicaCollector(models))

    def owner(replica_id: str) -> tuple[str, EngineClient, ReplicaState]:
        for name, client in models().items():
            for s in client.replica_states():
                if s.replica_id == replica_id and s.kind != "engine":
                    return name, client, s
        raise APIError(404, f"no replica {replica_id!r} that can be drained; see GET /fleet/replicas",
                       "not_found_error", "replica_id")

    @app.get("/fleet/replicas")
    async def list_replicas(request: Request) -> dict:
        check_operator(tenancy, request)
        served = models()
        return {"object": "list", "models": {n: {"router": c.facts.router} for n, c in served.items()},
                "data": [status_json(n, s) for n, s in states_of(served)]}

    def set_draining(replica_id: str, drain: bool) -> dict:
        name, client, _ = owner(replica_id)
        client.send(DrainReplica(replica_id, drain))
        return status_json(name, next(s for s in client.replica_states() if s.replica_id == replica_id))

    @app.post("/fleet/replicas/{replica_id}/drain")
    async def drain(replica_id: str, request: Request) -> dict:
        check_operator(tenancy, request)
        return set_draining(replica_id, True)

    @app.post("/fleet/replicas/{replica_id}/undrain")
    async def undrain(replica_id: str, request: Request) -> dict:
        check_operator(tenancy, request)
        return set_draining(replica_id, False)


class NodeCollector(Collector):
    """Each Ray node's energy as its replicas' own meters measured it (fleet/node_energy.py)."""

    def __init__(self, nodes: NodeEnergy) -> None:
        self.nodes = nodes

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        books = self.nodes.nodes()
        labels = ["node_id", "node", "energy_source"]

        def family(name: str, doc: str, value: Callable[[NodeBooks], float | None]) -> CounterMetricFamily:
            f = CounterMetricFamily(P + name, doc, labels=labels)
            for b in books:
                if (v := value(b)) is not None:
                    f.add_metric([b.node_id[:12], b.node, "+".join(b.sources)], float(v))
            return f

        yield family("node_energy_joules", "Energy read from the node's own power source by its replicas' meters",
                     lambda b: b.energy_joules)
        yield family("node_billed_joules", "The node's energy settled into ledger rows", lambda b: b.billed_joules)
        yield family("node_idle_joules", "The node's energy while its replicas were idle", lambda b: b.idle_joules)
        yield family("node_requests_lost", "Requests whose energy was lost with the node (null in their rows)",
                     lambda b: b.num_requests_lost)


def install_node_routes(app: FastAPI, nodes: NodeEnergy, registry: CollectorRegistry, tenancy: Tenancy) -> None:
    """GET /fleet/nodes: each Ray node's books (its energy by source, billed, idle, unattributed, lost), and the
    node_* series in /metrics."""
    registry.register(NodeCollector(nodes))

    @app.get("/fleet/nodes")
    async def list_nodes(request: Request) -> dict:
        check_operator(tenancy, request)
        return {"object": "list", "data": [dataclasses.asdict(b) for b in nodes.nodes()]}
