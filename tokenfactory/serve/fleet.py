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
    groups = [_model_group(args, config, args.replicas, None, power_model, num_local)]
    for k, spec in enumerate(args.fleet_model, 1):
        groups.append(_model_group(args, dataclasses.replace(config, model=spec.path), spec.replicas, spec.name,
                                   power_model, num_local, prefix=f"m{k}-"))
    name = groups[0].name
    energies = _add_backends(args, groups)  # the backends' modelled energy joins this machine's meter
    accounting, power, prices = build_accounting(args, groups[0].info.config, config.device.split(":")[0], name,
                                                 energies)
    from tokenfactory.serve.autoscale import hold_s

    fleets = {g.name: Fleet(g.name, g.replicas, _router(args), info=g.info, tokenizer=g.tokenizer,
                            hold_s=hold_s(args) if g.name == name else 0.0) for g in groups}
    for fleet in fleets.values():
        fleet.subscribe_steps(accounting.meter.on_step)  # one meter: this machine's power, every step
        fleet.start()
    from tokenfactory.serve.autoscale import describe, start_autoscaler

    autoscaling = start_autoscaler(args, fleets[name], config, power_model)  # the default model's replicas
    banner = [f"  model   {groups[0].model_path}"]
    if autoscaling is not None:
        banner.append(f"  scaling {describe(autoscaling)}")
    for fleet in fleets.values():
        banner.append(f"  fleet   {fleet.model}: {len(fleet.replicas)} replicas, router {fleet.router.name}")
        for r in fleet.replicas.values():
            facts = r.client.facts
            banner.append(f"    {r.replica_id:6} {r.kind:8} {facts.device:6} {facts.where}; routing watts "
                          f"{r.idle_watts:.0f} idle / {r.busy_watts:.0f} busy")
    return Started(fleets.pop(name), accounting, name, banner, power, prices, extra_models=fleets,
                   autoscaling=autoscaling)


@dataclass
class _ModelGroup:
    """One served model's replicas while the fleet is being built."""

    name: str
    info: Any  # ModelInfo
    tokenizer: Any
    model_path: str
    replicas: list


def _model_group(args: argparse.Namespace, config, num_replicas: int, name: str | None, power_model,  # noqa: ANN001
                 num_local: int, prefix: str = "") -> _ModelGroup:
    from tokenfactory.fleet.launch import start_local_replicas

    replicas = start_local_replicas(config, num_replicas, args.ray or None, args.ray is not None,
                                    getattr(args, "threads", None), args.replica_timeout, power_model, prefix,
                                    num_local) if num_replicas else []
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
