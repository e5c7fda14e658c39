"""`--ray-placement pack`'s choice of node as data (fleet/ray_replica.py's `pack_node`); the real placement on a
multi-node Ray is in test_ray_cluster.py."""

from __future__ import annotations

from tokenfactory.fleet.ray_replica import pack_node

NODES = {"a": {"CPU": 2.0}, "b": {"CPU": 8.0}, "c": {"CPU": 8.0, "big_box": 1.0}, "gpu": {"CPU": 4.0, "GPU": 1.0}}


def test_pack_starts_on_the_biggest_node_that_fits_and_stays_there() -> None:
    assert pack_node([], None, NODES, {"CPU": 1.0, "GPU": 0.0}) == "b"  # most CPUs; tie with c: lowest id
    assert pack_node([], None, NODES, {"CPU": 1.0, "big_box": 0.001}) == "c"  # only c has the resource
    assert pack_node([], None, NODES, {"CPU": 1.0, "GPU": 1.0}) == "gpu"
    assert pack_node([], None, NODES, {"CPU": 16.0}) is None  # nothing fits now: Ray queues it
    # the second replica asks before the first has landed: the node chosen before, not a new choice
    assert pack_node([], "a", NODES, {"CPU": 1.0}) == "a"


def test_pack_follows_where_the_replicas_landed_and_forgets_dead_nodes() -> None:
    assert pack_node(["a", "c", "a"], "b", NODES, {"CPU": 1.0}) == "a"  # most of the fleet's replicas
    alive = {n: r for n, r in NODES.items() if n != "a"}
    assert pack_node(["a", "a", "c"], "a", alive, {"CPU": 1.0}) == "c"  # a is gone: its replicas do not count
    assert pack_node(["a"], "a", alive, {"CPU": 1.0}) == "b"  # nothing alive placed, the old choice dead
