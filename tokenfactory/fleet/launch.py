"""Building a fleet from `serve`'s flags: N local processes or Ray actors of the model, and external backends.

`--replicas N` alone starts N local processes; with `--ray [ADDRESS]` they are Ray actors (a local Ray when
no address is given). Each `--backend URL[,model=NAME][,device=PROFILE][,key_file=PATH|key_env=VAR|key=KEY]`
adds an external OpenAI-compatible server serving the same model (its key from a file or an environment
variable keeps it out of `ps`; a URL's `user:password@` is sent as basic auth and shown as `***@`).
Replicas start in parallel, each with its share of the machine's cores unless `--threads` says otherwise.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tokenfactory.engine.client import EngineClient
from tokenfactory.fleet.backend import HTTPBackend, redact_url, split_credentials
from tokenfactory.fleet.energy import BackendEnergy
from tokenfactory.fleet.fleet import Replica
from tokenfactory.fleet.ray_replica import RayPlacement
from tokenfactory.types import ParameterError

if TYPE_CHECKING:
    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.client import ModelInfo
    from tokenfactory.fleet.node_energy import NodeEnergy, ReplicaMetering
    from tokenfactory.meter.prices import Prices
    from tokenfactory.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendSpec:
    url: str  # without credentials (a URL's user:password@ is `basic_auth`)
    model: str | None = None  # its model's name in its API (default: the fleet's served name)
    device: str | None = None  # a catalog device (h100, a100, ...): its watts model the energy
    api_key: str | None = field(default=None, repr=False)
    tokenizer: str | None = None  # a GGUF file or HF folder: its model's tokenizer, for a model we do not run
    served: str | None = None  # our API's name for its model (default: --model's; with tokenizer=, `model`)
    basic_auth: tuple[str, str] | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, text: str) -> BackendSpec:
        """`URL[,model=NAME][,served=NAME][,device=PROFILE][,key_file=PATH|key_env=VAR|key=KEY][,tokenizer=PATH]`."""
        url, *options = [part.strip() for part in text.split(",")]
        if not url.startswith(("http://", "https://")):
            raise ParameterError("backend", f"--backend needs an http(s) URL first, got {redact_url(url)!r}")
        fields = _options("backend", options, {"model", "served", "device", "key", "key_env", "key_file", "tokenizer"})
        try:
            url, basic_auth = split_credentials(url)
        except ValueError as e:
            raise ParameterError("backend", f"--backend {redact_url(url)}: not a URL ({e})") from None
        return cls(url, fields.get("model"), fields.get("device"), backend_key(fields), fields.get("tokenizer"),
                   fields.get("served"), basic_auth)

    @property
    def display_url(self) -> str:
        return f"{self.url} (basic auth)" if self.basic_auth else self.url

    def group(self, default: str) -> str:
        """The served model it joins: `served=`, else another model's name (with its tokenizer), else ours."""
        return self.served or (self.model if self.tokenizer and self.model else default)


def backend_key(fields: dict[str, str]) -> str | None:
    """The backend's API key from `key_file=` (its first line), `key_env=` or `key=` (one of them)."""
    given = [k for k in ("key", "key_env", "key_file") if k in fields]
    if len(given) > 1:
        raise ParameterError("backend", f"give the backend's key once: {' and '.join(g + '=' for g in given)} both set")
    if "key_file" in fields:
        path = Path(fields["key_file"]).expanduser()
        try:
            text = path.read_text().strip()
        except OSError as e:
            raise ParameterError("backend", f"key_file={path}: cannot read it ({e.strerror})") from None
        key = text.splitlines()[0].strip() if text else ""
        if not key:
            raise ParameterError("backend", f"key_file={path} is empty")
        if path.stat().st_mode & 0o077:
            logger.warning("backend key file %s is readable by other users: chmod 600 it", path)
        return key
    if "key_env" in fields:
        key = os.environ.get(fields["key_env"], "").strip()
        if not key:
            raise ParameterError("backend", f"key_env={fields['key_env']}: that environment variable is not set")
        return key
    if fields.get("key"):
        logger.warning("--backend ...,key=...: the key is visible in `ps` to every user of this machine; "
                       "prefer key_file=PATH or key_env=VAR")
    return fields.get("key") or None



@dataclass(frozen=True)
class ModelSpec:
    """Another model served beside --model, by its own local replicas: `PATH[,name=NAME][,replicas=N]`."""

    path: str
    name: str | None = None
    replicas: int = 1

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        path, *options = [part.strip() for part in text.split(",")]
        fields = _options("fleet_model", options, {"name", "replicas"})
        try:
            replicas = int(fields.get("replicas", "1"))
        except ValueError:
            replicas = 0
        if replicas < 1:
            raise ParameterError("fleet_model", f"replicas= must be a whole number >= 1, got {fields['replicas']!r}")
        return cls(path, fields.get("name"), replicas)


def _options(param: str, options: Sequence[str], known: set[str]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in known:
            raise ParameterError(param, f"option {option!r} is not one of {', '.join(k + '=' for k in sorted(known))}")
        fields[key] = value
    return fields


@dataclass(frozen=True)
class DevicePower:
    idle_watts: float
    busy_watts: float
    scope: str
    source: str  # where the figures come from, for the banner


def cpu_power(num_replicas: int, tdp_watts: float | None = None) -> DevicePower:
    """A local replica's share of this machine's modelled CPU power (the router's figures; the meter measures).

    Replicas on one CPU package share its static power: an idle replica's cores are not a device asleep that
    waking would power up, so its "idle" watts are its busy share (the energy router's waking cost is 0) and
    the router spreads onto idle cores, which finish sooner while the package's static power is paid anyway.
    Measured here (scripts/bench_fleet.py, 2 replicas, 2 streams): packing both streams onto one replica cost
    0.0275 J/token against 0.0188 spread (modelled source)."""
    from tokenfactory.meter.modelled import cpu_model_name, lookup_tdp

    power = lookup_tdp(cpu_model_name(), os.cpu_count() or 1, tdp_watts)
    share = power.tdp_watts / max(num_replicas, 1)
    return DevicePower(share, share, "cpu-package", power.basis)


def catalog_power(device: str) -> DevicePower:
    from tokenfactory.planner.catalog import load_catalog

    d = load_catalog().device(device)
    return DevicePower(d.idle_w.value, d.tdp_w.value, "gpu" if d.kind == "gpu" else "cpu-package",
                       f"catalog {d.name}: {d.tdp_w.value:g} W TDP, {d.idle_w.value:g} W idle")


@dataclass(frozen=True)
class RayOptions:
    """Replicas as Ray actors: on which Ray (`address` None: a local one, loopback only: fleet/ray_cluster.py),
    placed how, and metering their own nodes how (fleet/node_energy.py)."""

    address: str | None = None
    placement: RayPlacement = field(default_factory=RayPlacement)
    metering: ReplicaMetering | None = None  # None: their steps go to the gateway's meter


def replica_starter(config: EngineConfig, threads: int, ray: RayOptions | None, hang_timeout_s: float,
                    energy: NodeEnergy | None = None) -> tuple[str, Callable[[str], EngineClient]]:
    """(kind, start(replica_id)): a Ray actor with its threads as num_cpus (a GPU with --device cuda) on the Ray
    `ray` names (connected once per process), reporting its node's energy to `energy`; or a spawned local
    process."""
    if ray is not None:
        from tokenfactory.fleet.ray_cluster import connect
        from tokenfactory.fleet.ray_replica import Placer, start_ray_replica

        connect(ray.address)
        placer = Placer(ray.placement)

        def start_ray(name: str) -> EngineClient:
            return start_ray_replica(name, config, threads, num_cpus=threads,
                                     num_gpus=1.0 if config.device.startswith("cuda") else 0.0,
                                     hang_timeout_s=hang_timeout_s, placer=placer, metering=ray.metering,
                                     energy=energy)
        return "ray", start_ray
    from tokenfactory.fleet.process import start_process_replica

    def start_process(name: str) -> EngineClient:
        return start_process_replica(name, config, threads, hang_timeout_s)
    return "process", start_process


def local_replica(name: str, kind: str, start: Callable[[str], EngineClient], client: EngineClient,
                  config: EngineConfig, power: DevicePower) -> Replica:
    """A started local replica as the fleet keeps it: it restarts the way it was started."""
    return Replica(name, client, kind, idle_watts=power.idle_watts, busy_watts=power.busy_watts,
                   restart=_restarter(start, name))


def start_local_replicas(config: EngineConfig, num_replicas: int, ray: RayOptions | None, threads: int | None,
                         hang_timeout_s: float, power: DevicePower, prefix: str = "", num_sharing: int | None = None,
                         energy: NodeEnergy | None = None) -> list[Replica]:
    """N replicas of `config` (local processes, or Ray actors with `ray`), started in parallel; each restarts
    the same way when it dies. `prefix` keeps replica ids unique across models; `num_sharing`: local replicas
    sharing this machine's cores in all."""
    threads = threads or max(1, (os.cpu_count() or 1) // (num_sharing or num_replicas))
    kind, start = replica_starter(config, threads, ray, hang_timeout_s, energy)
    names = [f"{prefix}{kind[0]}{i}" for i in range(num_replicas)]
    with concurrent.futures.ThreadPoolExecutor(num_replicas) as pool:
        clients = list(pool.map(start, names))
    return [local_replica(name, kind, start, client, config, power)
            for name, client in zip(names, clients, strict=True)]


def _restarter(start: Callable[[str], EngineClient], name: str) -> Callable[[], EngineClient]:
    return lambda: start(name)


def backend_replicas(specs: Sequence[BackendSpec], served_name: str, info: ModelInfo, tokenizer: Tokenizer,
                     prices_for: Callable[[str | None], Prices], first_index: int = 0
                     ) -> tuple[list[Replica], list[BackendEnergy]]:
    replicas, energies = [], []
    for i, spec in enumerate(specs, first_index):
        name = f"b{i}"
        backend = HTTPBackend(name, spec.url, spec.model or spec.served or served_name, info, tokenizer,
                              spec.api_key, basic_auth=spec.basic_auth, device=spec.device or "unknown")
        power = catalog_power(spec.device) if spec.device else cpu_power(1)
        energy = BackendEnergy(name, power.busy_watts, power.scope, prices_for(spec.device))
        backend.request_listeners.append(energy.on_request)
        replicas.append(Replica(name, backend, "backend", idle_watts=power.idle_watts, busy_watts=power.busy_watts))
        energies.append(energy)
    return replicas, energies
