"""Replicas behind one `Fleet` per served model (docs/fleet.md): local processes or Ray actors of --model and
each --fleet-model, and each --backend, which joins its model's fleet or serves a model of its own."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from tokenfactory.serve.engine import Started, build_accounting, load_checked, model_info
from tokenfactory.serve.flags import engine_config_from_args


def start_fleet(args: argparse.Namespace) -> Started:
    """Replicas in local processes or on Ray, and external backends, behind one Fleet per model (docs/fleet.md):
    --model's (the default), each --fleet-model's, and each backend model we do not run ourselves."""
    from tokenfactory.fleet.fleet import Fleet
    from tokenfactory.fleet.launch import cpu_power

    config = engine_config_from_args(args)
    joins_default = [b for b in args.backend if b.group("") in ("", args.served_model_name)]
    from_zero = bool(getattr(args, "autoscaler", None)) and getattr(args, "min_replicas", 1) == 0
    if args.replicas < 0 or (args.replicas == 0 and not joins_default and not from_zero):
        raise ValueError("--replicas must be >= 1, or 0 with a --backend of the same model")
    num_local = args.replicas + sum(m.replicas for m in args.fleet_model)
    power_model = cpu_power(max(num_local, 1), args.cpu_tdp_watts)
    ray, nodes = ray_options(args)
    groups = [_model_group(args, config, args.replicas, None, power_model, num_local, ray=ray, energy=nodes)]
    for k, spec in enumerate(args.fleet_model, 1):
        groups.append(_model_group(args, dataclasses.replace(config, model=spec.path), spec.replicas, spec.name,
                                   power_model, num_local, prefix=f"m{k}-", ray=ray, energy=nodes))
    ray_line = _ray_line(ray)  # read again now that the replicas (Ray workers) listen too
    name = groups[0].name
    energies = _add_backends(args, groups)  # the backends' modelled energy joins this machine's meter
    accounting, power, prices = build_accounting(args, groups[0].info.config, config.device.split(":")[0], name,
                                                 energies, nodes)
    from tokenfactory.serve.autoscale import hold_s

    fleets = {g.name: Fleet(g.name, g.replicas, _router(args), info=g.info, tokenizer=g.tokenizer,
                            hold_s=hold_s(args) if g.name == name else 0.0) for g in groups}
    for fleet in fleets.values():
        fleet.subscribe_steps(accounting.meter.on_step)  # one meter: this machine's power, every step
        fleet.start()
    from tokenfactory.serve.autoscale import describe, start_autoscaler

    autoscaling = start_autoscaler(args, fleets[name], config, power_model, ray, nodes)  # the default model's
    banner = [f"  model   {groups[0].model_path}", *([f"  ray     {ray_line}"] if ray_line else [])]
    if autoscaling is not None:
        banner.append(f"  scaling {describe(autoscaling)}")
    for fleet in fleets.values():
        banner.append(f"  fleet   {fleet.model}: {len(fleet.replicas)} replicas, router {fleet.router.name}")
        for r in fleet.replicas.values():
            facts = r.client.facts
            banner.append(f"    {r.replica_id:6} {r.kind:8} {facts.device:6} {facts.where}; routing watts "
                          f"{r.idle_watts:.0f} idle / {r.busy_watts:.0f} busy")
    return Started(fleets.pop(name), accounting, name, banner, power, prices, extra_models=fleets,
                   autoscaling=autoscaling, nodes=nodes)


@dataclass
class _ModelGroup:
    """One served model's replicas while the fleet is being built."""

    name: str
    info: Any  # ModelInfo
    tokenizer: Any
    model_path: str
    replicas: list


def ray_options(args: argparse.Namespace):  # noqa: ANN201 - (RayOptions | None, NodeEnergy | None)
    """With --ray: Ray connected (a local one bound to loopback, or the cluster joined with its token; RayRefused
    otherwise), the replicas' placement and metering, and the gateway's books of their nodes' energy."""
    if getattr(args, "ray", None) is None:
        return None, None
    from pathlib import Path

    from tokenfactory.fleet.launch import RayOptions
    from tokenfactory.fleet.node_energy import NodeEnergy, ReplicaMetering
    from tokenfactory.fleet.ray_cluster import connect
    from tokenfactory.fleet.ray_replica import RayPlacement
    from tokenfactory.meter.prices import load_prices
    from tokenfactory.serve.engine import accelerator_name

    connect(args.ray or None)
    device_type = args.device.split(":")[0]
    prices = load_prices(Path(args.prices) if args.prices else None, device=args.device_profile,
                         device_name=accelerator_name(device_type), device_type=device_type)
    resources = {}
    for item in getattr(args, "ray_resource", []):
        key, _, amount = item.partition("=")
        try:
            resources[key] = float(amount) if amount else 0.001
        except ValueError as e:
            raise ValueError(f"--ray-resource {item!r}: the amount must be a number") from e
    metering = ReplicaMetering(prices, getattr(args, "replica_power_source", "auto"), args.cpu_tdp_watts)
    options = RayOptions(args.ray or None, RayPlacement(getattr(args, "ray_placement", "spread"), resources), metering)
    return options, NodeEnergy(prices)


def _ray_line(ray) -> str | None:  # noqa: ANN001 - RayOptions | None
    """The banner's Ray line; a local Ray's sockets read again (RayRefused if one is off loopback)."""
    if ray is None:
        return None
    from tokenfactory.fleet.ray_cluster import check_loopback, session

    current = session()
    assert current is not None
    if current.local:
        current = dataclasses.replace(current, listening=check_loopback())
    return (f"{current.describe()}; replicas placed {ray.placement.strategy}"
            + (f" on nodes with {', '.join(ray.placement.resources)}" if ray.placement.resources else "")
            + f", each metering its own node ({ray.metering.power_source})")


def _model_group(args: argparse.Namespace, config, num_replicas: int, name: str | None, power_model,  # noqa: ANN001
                 num_local: int, prefix: str = "", ray=None, energy=None) -> _ModelGroup:  # noqa: ANN001
    from tokenfactory.fleet.launch import start_local_replicas

    replicas = start_local_replicas(config, num_replicas, ray, getattr(args, "threads", None), args.replica_timeout,
                                    power_model, prefix, num_local, energy) if num_replicas else []
    if replicas:
        client = replicas[0].client
        info, tokenizer, model_path = client.info, client.tokenizer, client.facts.model_path
    else:
        config, loaded = load_checked(args)
        info, tokenizer, model_path = model_info(config, loaded), loaded.tokenizer, str(loaded.path)
    from tokenfactory.models.loader import served_name

    explicit = name or (args.served_model_name if not prefix else None)
    return _ModelGroup(served_name(model_path, explicit), info, tokenizer, model_path, replicas)


def _add_backends(args: argparse.Namespace, groups: list[_ModelGroup]) -> list:
    """Each --backend joins the group of its model, or starts a group of its own (with its tokenizer=)."""
    from pathlib import Path

    from tokenfactory.fleet.launch import backend_replicas
    from tokenfactory.meter.prices import load_prices
    from tokenfactory.models.loader import load_model

    prices_path = Path(args.prices) if args.prices else None

    def prices_for(device: str | None):  # noqa: ANN202 - Prices
        return load_prices(prices_path, device_name=device, device_type="cuda" if device else "cpu")

    energies = []
    for i, spec in enumerate(args.backend):
        served = spec.group(groups[0].name)
        group = next((g for g in groups if g.name == served), None)
        if group is None:
            if not spec.tokenizer:
                raise ValueError(f"--backend {spec.url} serves {served!r}, which no replica here runs: give its "
                                 f"tokenizer (tokenizer=PATH to a GGUF file or Hugging Face folder)")
            loaded = load_model(spec.tokenizer)
            info = model_info(None, loaded)
            group = _ModelGroup(served, info, loaded.tokenizer, str(loaded.path), [])
            groups.append(group)
        replicas, found = backend_replicas([spec], group.name, group.info, group.tokenizer, prices_for, i)
        group.replicas += replicas
        energies += found
    return energies


def _router(args: argparse.Namespace):  # noqa: ANN202 - RoutingPolicy
    from tokenfactory.fleet.router import make_router

    return make_router(args.router, args.sticky_sessions)
