"""Energy measured where the work ran (fleet/node_energy.py, fleet/ray_cluster.py), without a Ray: a replica's
own meter turning its batches into labelled steps and RequestEnergy, the gateway's books per node (a lost
request's energy is null, a late report is unbilled, the books balance), the fleet meter keeping labelled steps
out of this machine's split, and the loopback check on real sockets."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.fake_engine import FAKE_MODEL_CONFIG
from tokenfactory.engine.client import RequestFailed, WorkerEvents
from tokenfactory.fleet.energy import FleetMeter
from tokenfactory.fleet.node_energy import MeteredEvents, NodeEnergy, ReplicaMeter, ReplicaMetering
from tokenfactory.fleet.ray_cluster import RayRefused, check_loopback, is_loopback, join
from tokenfactory.meter.attribution import Meter, RequestEnergy
from tokenfactory.meter.power import ConstantSource
from tokenfactory.meter.prices import load_prices
from tokenfactory.types import CompletionOutput, FinishReason, RequestOutput, SequenceWork, StepStats

PRICES = load_prices(None)


def step(i: int, *work: SequenceWork, node: str | None = None, source: str | None = None) -> StepStats:
    return StepStats(i, time.monotonic(), 0.01, sum(w.num_new_tokens for w in work if w.is_prefill),
                     sum(w.num_new_tokens for w in work if not w.is_prefill), len(work), 0, 10, 10, 0, tuple(work),
                     node=node, energy_source=source)


def final(rid: str, n: int) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2], [CompletionOutput(0, "x" * n, list(range(n)), None, FinishReason.LENGTH)])


def energy(rid: str, joules: float | None) -> RequestEnergy:
    return RequestEnergy(rid, joules, "modelled" if joules is not None else None, "cpu-package", 1.0, joules, 0.5,
                         1e9, 3, 7, 0.0, 0.0, 0.0)


def test_a_replica_meters_its_batches_and_reports_each_request_that_ended() -> None:
    meter = ReplicaMeter(ReplicaMetering(PRICES, "modelled"), FAKE_MODEL_CONFIG, 1, False, "node-a", "cpu")
    try:
        work = (SequenceWork("done", 4, 0, True), SequenceWork("cut", 4, 0, True), SequenceWork("bad", 2, 0, True))
        out = meter.meter_batch(WorkerEvents(outputs=(final("done", 3),), failures=(RequestFailed("bad", "broke"),),
                                             steps=(step(0, *work),), aborted=("cut",)))
    finally:
        meter.close()
    assert [(s.node, s.energy_source) for s in out.events.steps] == [("node-a", "modelled")]
    by_id = {e.request_id: e for e in out.energies}
    assert set(by_id) == {"done", "cut", "bad"} and by_id["done"].num_output_tokens == 3
    assert all(e.energy_source == "modelled" and e.energy_joules is not None and e.num_steps == 1
               for e in out.energies)
    assert out.totals is not None and out.totals.source == "modelled"


def books(nodes: NodeEnergy, node_id: str):
    return next(b for b in nodes.nodes() if b.node_id == node_id)


def test_the_gateway_books_per_node_a_lost_request_is_null_a_late_one_unbilled() -> None:
    nodes = NodeEnergy(PRICES)
    on_a = nodes.attach("r0", "node-a", "127.0.0.1", "modelled", FAKE_MODEL_CONFIG)
    nodes.attach("r1", "node-b", "127.0.0.1", "modelled", FAKE_MODEL_CONFIG)
    nodes.on_step(step(0, SequenceWork("a1", 8, 0, True), node="node-a", source="modelled"))
    nodes.on_step(step(0, SequenceWork("b1", 8, 0, True), node="node-b", source="modelled"))
    on_a(MeteredEvents(WorkerEvents(), (energy("a1", 4.0),)))
    assert nodes.owns("a1") and nodes.owns("b1") and not nodes.owns("elsewhere")
    got = nodes.finish_request("a1", 5)
    assert (got.energy_joules, got.energy_source, got.num_output_tokens) == (4.0, "modelled", 5)
    lost = nodes.finish_request("b1", 2)  # node-b died before it could report: unknown, not zero
    assert lost.energy_joules is None and lost.energy_source is None and lost.cost_usd is None
    assert lost.device_seconds == pytest.approx(0.01) and lost.num_steps == 1 and lost.flops > 0
    on_a(MeteredEvents(WorkerEvents(), (energy("a1", 1.5),)))  # a report after its settlement
    a, b = books(nodes, "node-a"), books(nodes, "node-b")
    assert (a.billed_joules, a.unbilled_joules, a.num_requests_billed) == (4.0, 1.5, 1)
    assert (b.billed_joules, b.num_requests_lost) == (0.0, 1)


def test_a_rerouted_request_is_billed_only_when_every_node_that_ran_it_reported() -> None:
    nodes = NodeEnergy(PRICES)
    nodes.attach("r0", "node-a", "127.0.0.1", "modelled", FAKE_MODEL_CONFIG)
    on_b = nodes.attach("r1", "node-b", "127.0.0.1", "modelled", FAKE_MODEL_CONFIG)
    nodes.on_step(step(0, SequenceWork("x", 8, 0, True), node="node-a", source="modelled"))  # then node-a died
    nodes.on_step(step(0, SequenceWork("x", 8, 0, True), node="node-b", source="modelled"))
    on_b(MeteredEvents(WorkerEvents(), (energy("x", 2.0),)))
    assert nodes.finish_request("x", 1).energy_joules is None  # part of its energy is unknown
    assert books(nodes, "node-b").unbilled_joules == 2.0 and books(nodes, "node-a").num_requests_lost == 1


def test_the_fleet_meter_keeps_labelled_steps_out_of_this_machines_split() -> None:
    local = Meter(ConstantSource(100.0), FAKE_MODEL_CONFIG, PRICES)
    nodes = NodeEnergy(PRICES)
    nodes.attach("r0", "node-a", "127.0.0.1", "modelled", FAKE_MODEL_CONFIG)
    fleet_meter = FleetMeter(local, [], nodes)
    fleet_meter.on_step(step(0, SequenceWork("remote", 8, 0, True), node="node-a", source="modelled"))
    fleet_meter.on_step(step(1, SequenceWork("here", 8, 0, True)))
    assert nodes.owns("remote") and not nodes.owns("here")
    here = fleet_meter.finish_request("here", 1)
    assert here.energy_source == "constant" and here.num_steps == 1
    assert fleet_meter.finish_request("remote", 1).energy_joules is None
    assert local.totals().busy_device_seconds == pytest.approx(0.01)  # the labelled step never reached it


def test_loopback_addresses_and_a_listener_on_every_interface_is_refused() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.0.2.2", "::ffff:10.0.0.1", "not-an-ip"]))
    code = ("import socket, sys, time; s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(); "
            "print('up', flush=True); time.sleep(60)")
    children = [subprocess.Popen([sys.executable, "-c", code, host], stdout=subprocess.PIPE, text=True)
                for host in ("127.0.0.1", "0.0.0.0")]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "up"
        assert len(check_loopback(children[0].pid)) == 1
        with pytest.raises(RayRefused, match=r"0\.0\.0\.0:\d+ is reachable from the network"):
            check_loopback(children[1].pid)
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_joining_a_cluster_without_its_token_is_refused_naming_how_to_make_one(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # restored after join() changes it
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RayRefused, match="needs its auth token.*RAY_AUTH_TOKEN_PATH.*ray get-auth-token --generate"):
        join("10.0.0.5:6379")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(RayRefused, match="needs its auth token"):
        join("10.0.0.5:6379")
