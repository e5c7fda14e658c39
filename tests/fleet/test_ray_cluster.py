"""Past one machine on Ray (fleet/ray_cluster.py, fleet/ray_replica.py, fleet/node_energy.py), for real:

- `serve --ray` with no address starts a Ray that listens on loopback only: every socket of the server's
  process tree, read from the system, is on 127.0.0.1, with nothing set up by this test's environment;
- joining a cluster without its token fails with a message that says how to get one;
- a multi-node Ray on loopback (ray.cluster_utils.Cluster in a child process, token auth on: a head with no CPUs
  and three two-CPU worker nodes, two with a custom resource), one for the module:
  - `--ray-placement pack --ray-resource tf_pack`: both replicas on one node that has the resource, its books
    the sum of their two meters, balanced against the ledger;
  - `--ray-placement spread`: two replicas on different nodes, each metering its own node; the official openai
    client streams through the gateway while one replica's node has its raylet killed: every call ends, every
    request has exactly one ledger row, the replica comes back on another node, and each node's books (read
    from the replicas' own sources) balance against the ledger.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_util import start_server
from tokenfactory.fleet.ray_cluster import listening_sockets, process_tree
from tokenfactory.layers.cpu_kernels import cache_root

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def clean_env(home: Path) -> dict[str, str]:
    """This process's environment without any Ray setting (the suite's own Ray mode and token) and a HOME
    without ~/.ray: what serve does, it must do itself. The CPU kernels stay where they are built already
    (a fresh HOME would build them again, minutes on a loaded machine)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    home.mkdir(exist_ok=True)
    return env | {"HOME": str(home), "TOKENFACTORY_KERNEL_CACHE": str(cache_root())}


def test_a_local_ray_started_by_serve_listens_on_loopback_only(tmp_path) -> None:
    server = start_server(tmp_path, "--replicas", "1", "--ray", "--power-source", "modelled", "--machine-profile",
                          "off", timeout=600, env=clean_env(tmp_path / "home"))
    try:
        assert "bound to 127.0.0.1 only" in server.log() and "token auth (token from this run)" in server.log()
        sockets = listening_sockets(process_tree(server.proc.pid))  # psutil: the system's own table
        names = {name for name, _, _ in sockets}
        assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names), sockets
        loopback = ("127.0.0.1", "::ffff:127.0.0.1", "::1")
        assert not [s for s in sockets if s[1] not in loopback], f"listening beyond loopback: {sockets}"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert r.usage.completion_tokens == 4
        [replica] = httpx.get(server.url + "/fleet/replicas", timeout=10).json()["data"]
        assert replica["kind"] == "ray" and replica["node"] == "127.0.0.1" and replica["energy_source"] == "modelled"
    finally:
        server.stop()


def test_joining_a_cluster_without_its_token_fails_with_a_clear_message(tmp_path, ray_address) -> None:
    env = clean_env(tmp_path / "home")
    out = subprocess.run([sys.executable, "-m", "tokenfactory.cli", "serve", "--replicas", "1", "--ray", ray_address,
                          "--data-dir", str(tmp_path / "data")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert "cannot start: joining the Ray cluster at" in out.stderr and "needs its auth token" in out.stderr
    assert "RAY_AUTH_TOKEN_PATH" in out.stderr and "ray get-auth-token --generate" in out.stderr


CLUSTER = """
import json, sys
from ray.cluster_utils import Cluster

store = 80 << 20
cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 0, "object_store_memory": store})
workers = [cluster.add_node(num_cpus=2, object_store_memory=store, resources=resources)
           for resources in ({}, {"tf_pack": 4}, {"tf_pack": 4})]
cluster.wait_for_nodes()
nodes = {n.node_id: n for n in workers}
print(json.dumps({"address": cluster.address, "workers": list(nodes), "pack_nodes": list(nodes)[1:]}), flush=True)
for line in sys.stdin:
    node = nodes.pop(line.strip())
    node.all_processes["raylet"][0].process.kill()  # the raylet SIGKILLed: its workers go with it
    print("killed", flush=True)
cluster.shutdown()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, dict]]:
    """Head (no CPUs) + three two-CPU worker nodes on loopback, two of them with a custom resource (tf_pack),
    token auth on, health checks fast enough for a test; one cluster for this module's tests (a node lost in
    one leaves the others two)."""
    tmp_path = tmp_path_factory.mktemp("cluster")
    token = tmp_path / "auth_token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    env = clean_env(tmp_path / "home") | {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every node on 127.0.0.1 (ray_cluster.py)
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",
        "RAY_health_check_timeout_ms": "1000"}
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "cluster.log", "w"), text=True)  # noqa: SIM115
    try:
        line = proc.stdout.readline()
        assert line, (tmp_path / "cluster.log").read_text()[-3000:]
        yield proc, json.loads(line) | {"env": env | {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
    finally:
        proc.stdin.close()  # the helper shuts the cluster down
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ledger(server) -> list[dict]:
    with sqlite3.connect(server.data_dir / "ledger.db") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("select * from requests")]


def replicas(server) -> dict[str, dict]:
    return {r["replica_id"]: r for r in httpx.get(server.url + "/fleet/replicas", timeout=10).json()["data"]}


def nodes(server) -> dict[str, dict]:
    return {n["node_id"]: n for n in httpx.get(server.url + "/fleet/nodes", timeout=10).json()["data"]}


def wait_for(what: str, check, timeout_s: float = 120.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.5)
    return value


def test_pack_puts_a_fleet_on_one_node_with_its_resource_metering_it_once(tmp_path, cluster) -> None:
    _, info = cluster
    server = start_server(tmp_path, "--replicas", "2", "--ray", info["address"], "--ray-placement", "pack",
                          "--ray-resource", "tf_pack", "--threads", "1", "--replica-power-source", "modelled",
                          "--power-source", "constant", "--power-watts", "5",  # this machine's: none of the rows'
                          "--machine-profile", "off", timeout=600, env=info["env"])
    try:
        assert "replicas placed pack on nodes with tf_pack" in server.log()
        placed = replicas(server)
        [node_id] = {r["node_id"] for r in placed.values()}  # both replicas on one node
        assert node_id in info["pack_nodes"], (node_id, info)  # one with the resource asked for
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for i in range(4):  # an idle fleet's ties go round the replicas: both meter something
            assert client.completions.create(model=MODEL, prompt=f"Hi {i}", max_tokens=6).usage.completion_tokens
        rows = wait_for("four ledger rows", lambda: len(r := ledger(server)) == 4 and r)
        assert {r["replica"] for r in rows} == {"r0", "r1"}, rows
        assert all(r["energy_source"] == "modelled" and r["energy_joules"] > 0 for r in rows)  # the node's meters
        books = wait_for("the node's books to balance", lambda: (b := nodes(server)).get(node_id) and abs(
            b[node_id]["billed_joules"] + b[node_id]["unbilled_joules"] - b[node_id]["attributed_joules"]) < 1e-6
            and b, 30)
        assert list(books) == [node_id]  # one node: its two replicas' meters in one set of books
        b = books[node_id]
        assert sorted(b["replicas"]) == ["r0", "r1"] and b["sources"] == ["modelled"]
        assert b["num_requests_billed"] == 4 and b["billed_joules"] == pytest.approx(
            sum(r["energy_joules"] for r in rows), rel=1e-6)
    finally:
        server.stop()


def test_a_fleet_on_a_multi_node_ray_loses_a_node_under_load(tmp_path, cluster) -> None:
    cluster, info = cluster
    server = None
    try:
        server = start_server(tmp_path, "--replicas", "2", "--ray", info["address"], "--ray-placement", "spread",
                              "--threads", "1", "--replica-timeout", "5", "--power-source", "modelled",
                              "--max-num-seqs", "8", "--machine-profile", "off", timeout=600, env=info["env"])
        assert f"cluster at {info['address']}; token auth" in server.log()
        placed = replicas(server)
        assert {r["kind"] for r in placed.values()} == {"ray"}
        where = {rid: r["node_id"] for rid, r in placed.items()}
        assert len(set(where.values())) == 2 and set(where.values()) <= set(info["workers"]), where
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def one(i: int) -> str:
            try:
                stream = client.completions.create(model=MODEL, prompt=f"Story {i}: once upon a time",
                                                   max_tokens=48, stream=True)
                return "".join(c.choices[0].text for c in stream if c.choices)
            except openai.APIError as e:  # the stream of a request on the lost node ends with an error event
                return f"error: {e}"

        for i in range(4):  # one at a time: an idle fleet's ties go round the replicas, so both meter something
            assert not one(i).startswith("error")
        victim = "r0"
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            calls = [pool.submit(one, 100 + i) for i in range(8)]
            time.sleep(1.0)
            cluster.stdin.write(where[victim] + "\n")
            cluster.stdin.flush()
            assert cluster.stdout.readline().strip() == "killed"
            results = [c.result(timeout=240) for c in calls]  # every call ends, with text or an error
        assert any(not r.startswith("error") for r in results)
        back = wait_for("the lost replica back on another node", lambda: (r := replicas(server)[victim])["state"]
                        == "ready" and r["node_id"] != where[victim] and r)
        assert back["num_restarts"] >= 1 and back["node_id"] in info["workers"]
        assert not one(200).startswith("error")

        rows = wait_for("a ledger row for every request", lambda: len(r := ledger(server)) == 4 + 8 + 1 and r)
        assert len({r["request_id"] for r in rows}) == len(rows)
        assert {r["status"] for r in rows} <= {"finished", "failed"}
        measured = [r for r in rows if r["energy_joules"] is not None]
        assert measured and all(r["energy_source"] == "modelled" and r["energy_joules"] > 0 for r in measured)
        lost = [r for r in rows if r["energy_joules"] is None]  # cut off with the node: unknown, never 0
        assert all(r["energy_source"] is None for r in lost)

        def settled() -> dict | None:  # each live node's latest report covers every request it billed
            books = nodes(server)
            live = [b for nid, b in books.items() if nid != where[victim]]
            ok = all(b["attributed_joules"] is not None and abs(b["billed_joules"] + b["unbilled_joules"]
                                                                - b["attributed_joules"]) < 1e-6 for b in live)
            return books if ok else None
        books = wait_for("the live nodes' books to balance", settled, 30)
        assert set(books) >= {where["r1"], back["node_id"]}
        for node_id, b in books.items():
            assert b["sources"] == ["modelled"] and b["energy_joules"] > 0
            if node_id != where[victim]:  # a dead node's last report is not its last word
                parts = b["attributed_joules"] + b["idle_joules"] + b["unattributed_joules"] + b["unsettled_joules"]
                assert parts == pytest.approx(b["energy_joules"], rel=1e-6)
        assert sum(b["billed_joules"] for b in books.values()) == pytest.approx(
            sum(r["energy_joules"] for r in measured), rel=1e-6)
        assert sum(b["num_requests_lost"] for b in books.values()) == len(lost)
    finally:
        if server is not None:
            server.stop()
