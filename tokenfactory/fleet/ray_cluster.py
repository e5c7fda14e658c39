"""Ray for the fleet, safe by default: a local Ray bound to loopback only, or a cluster joined with its token.

A Ray that anyone can reach runs anyone's code (a job submitted to it is a process on its nodes: the
"ShadowRay" class of incidents). So:

- **Local** (`serve --ray` with no address, the test suite's session Ray): Ray 2.60 binds its servers (GCS,
  raylet, object manager, agents, each worker's gRPC port) to every interface whenever it runs as a cluster.
  In its single-machine mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, what it does on macOS and Windows) the node's
  address is 127.0.0.1 and every one of them binds loopback. tokenfactory starts a local Ray only that way, with
  Ray's token auth on (a fresh token for this run, in the environment its processes inherit; never written to
  disk), then reads the sockets its processes listen on from the system (`psutil`) and refuses to go on if any
  is bound elsewhere. `check_loopback()` reads them again once the replicas (Ray workers) are up.
- **Joining** (`serve --ray ADDRESS`): token auth (`RAY_AUTH_MODE=token`) with the cluster's token from the
  environment (`RAY_AUTH_TOKEN`) or a file (`RAY_AUTH_TOKEN_PATH`, else Ray's `~/.ray/auth_token`), never from a
  flag: a flag shows in `ps`. Without one it refuses, naming the command that makes one; `RAY_AUTH_MODE=disabled`
  joins a cluster without auth, and the banner says so. What a remote cluster binds is its operator's.

Ray is process-global, so is the session: `connect` starts or joins it once per process.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

LOCAL_MODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's single-machine mode, every server on 127.0.0.1
TOKEN_COMMAND = "ray get-auth-token --generate"  # writes ~/.ray/auth_token (Ray >= 2.52) and prints the token


class RayRefused(RuntimeError):
    """A local Ray that would listen beyond loopback, or a cluster joined without its token."""


@dataclass(frozen=True)
class RaySession:
    """The Ray this process is a driver of."""

    address: str
    local: bool  # started here (loopback only), or joined
    auth: str  # "token" or "disabled"
    token_from: str  # where the token came from: "this run", RAY_AUTH_TOKEN, a file, or "none"
    listening: tuple[str, ...] = ()  # a local Ray's sockets as the system lists them ("127.0.0.1:6379", ...)

    def describe(self) -> str:
        auth = f"token auth (token from {self.token_from})" if self.auth == "token" else (
            "NO AUTH (RAY_AUTH_MODE=disabled): anyone who reaches the cluster can run code on it")
        if self.local:
            return (f"local at {self.address}, bound to 127.0.0.1 only ({len(self.listening)} listening sockets "
                    f"read from the system, all loopback); {auth}")
        return f"cluster at {self.address}; {auth}"


_SESSION: RaySession | None = None


def session() -> RaySession | None:
    return _SESSION


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, and an IPv4-mapped 127.x (a dual-stack socket bound to loopback)."""
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def process_tree(root_pid: int | None = None) -> dict[int, str]:
    """pid -> name of a process and all its descendants (a local Ray's GCS, raylet, agents and workers are
    the driver's)."""
    import psutil

    root = psutil.Process(root_pid or os.getpid())
    procs = [root, *root.children(recursive=True)]
    names = {}
    for p in procs:
        try:
            names[p.pid] = p.name()
        except psutil.Error:
            continue
    return names


def listening_sockets(pids: dict[int, str]) -> list[tuple[str, str, int]]:
    """(process name, ip, port) of every TCP socket listening, and UDP socket bound, by those processes."""
    import socket

    import psutil

    found = []
    for c in psutil.net_connections(kind="inet"):
        if c.pid in pids and c.laddr and (c.status == psutil.CONN_LISTEN or c.type == socket.SOCK_DGRAM):
            found.append((pids[c.pid], c.laddr.ip, c.laddr.port))
    return sorted(found)


def check_loopback(root_pid: int | None = None) -> tuple[str, ...]:
    """The listening sockets of this process's tree, all on loopback; RayRefused naming any that is not."""
    sockets = listening_sockets(process_tree(root_pid))
    exposed = [f"{name} on {ip}:{port}" for name, ip, port in sockets if not is_loopback(ip)]
    if exposed:
        raise RayRefused("a local Ray must listen on 127.0.0.1 only, but " + ", ".join(exposed) + " is reachable "
                         "from the network; not starting (docs/fleet.md, 'What tokenfactory secures')")
    return tuple(f"{ip}:{port}" for _, ip, port in sockets)


def connect(address: str | None, num_cpus: int | None = None, resources: dict[str, float] | None = None,
            object_store_memory: int | None = None) -> RaySession:
    """Start a local Ray (`address` None) or join the one at `address`; once per process."""
    global _SESSION
    if _SESSION is not None:
        return _SESSION
    _SESSION = start_local(num_cpus, resources, object_store_memory) if not address else join(address)
    return _SESSION


def start_local(num_cpus: int | None = None, resources: dict[str, float] | None = None,
                object_store_memory: int | None = None) -> RaySession:
    """A Ray on this machine, every server on 127.0.0.1, token auth on; RayRefused if it listens elsewhere."""
    import sys

    if "ray" in sys.modules and os.environ.get(LOCAL_MODE_ENV) != "0":
        logger.warning("ray was imported before %s=0 was set: its servers may bind every interface (checked "
                       "below)", LOCAL_MODE_ENV)
    os.environ[LOCAL_MODE_ENV] = "0"
    token_from = _token_source()
    if os.environ.get("RAY_AUTH_MODE", "token") != "disabled":
        if token_from == "none":  # a token for this run only, inherited by Ray's processes, never on disk
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
            token_from = "this run"
        _token_auth_on()
    import ray

    info = ray.init(num_cpus=num_cpus, resources=resources, object_store_memory=object_store_memory,
                    include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        listening = check_loopback()
    except RayRefused:
        ray.shutdown()
        raise
    auth = "disabled" if os.environ.get("RAY_AUTH_MODE") == "disabled" else "token"
    return RaySession(info.address_info["address"], True, auth, token_from if auth == "token" else "none",
                      listening)


def join(address: str) -> RaySession:
    """The cluster at `address`, with its token from the environment or a file (RayRefused without one)."""
    host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    if is_loopback(host) or host == "localhost":
        os.environ[LOCAL_MODE_ENV] = "0"  # a Ray on this machine: our driver binds loopback too
    elif os.environ.get(LOCAL_MODE_ENV) == "0":
        del os.environ[LOCAL_MODE_ENV]  # other nodes must reach this driver
    token_from = _token_source()
    auth = "disabled" if os.environ.get("RAY_AUTH_MODE") == "disabled" else "token"
    if auth == "token":
        if token_from == "none":
            raise RayRefused(
                f"joining the Ray cluster at {address} needs its auth token, and none was found: put it in a file "
                f"readable only by you and set RAY_AUTH_TOKEN_PATH to it (or Ray's default ~/.ray/auth_token), "
                f"or set RAY_AUTH_TOKEN; never on the command line. On the head, `{TOKEN_COMMAND}` makes one "
                f"(start the cluster with RAY_AUTH_MODE=token). docs/fleet.md has the two-machine recipe")
        _token_auth_on()
    else:
        logger.warning("joining the Ray cluster at %s WITHOUT authentication (RAY_AUTH_MODE=disabled)", address)
    import ray

    try:
        info = ray.init(address=address, log_to_driver=False, configure_logging=False)
    except ray.exceptions.AuthenticationError as e:
        raise RayRefused(f"the Ray cluster at {address} refused our token (from {token_from}): {e.message}") from e
    except ConnectionError as e:  # a wrong token looks like this too: the cluster does not answer us
        raise RayRefused(f"cannot join the Ray cluster at {address} (it is not reachable, or it refused our token "
                         f"from {token_from}): {e}") from e
    return RaySession(info.address_info["address"], False, auth, token_from)


def _token_auth_on() -> None:
    """RAY_AUTH_MODE=token for this process and the Ray processes it starts. Ray reads its config once; when it
    was imported before, refresh it, and its cached token, as its own `ray.init` does when it turns auth on."""
    import sys

    os.environ["RAY_AUTH_MODE"] = "token"
    if "ray" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def _token_source() -> str:
    """Where Ray will read its token from, by its own order; "none" when nowhere."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return f"RAY_AUTH_TOKEN_PATH ({path})" if Path(path).expanduser().is_file() else "none"
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if default.is_file() else "none"
