"""One engine in this process, as `serve` and `batch run` start it: the model loaded and checked to fit (the
doctor's pre-flight), the meter and ledger, the engine built, warmed up and stepped on its own thread."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenfactory.serve.flags import engine_config_from_args, fleet_mode

logger = logging.getLogger("tokenfactory.serve")

def make_engine(config, loaded, threads: int | None = None):  # noqa: ANN001, ANN201
    """The LLMEngine (imported lazily), on the calling thread: the one that will step it."""
    from tokenfactory.engine.engine import LLMEngine

    if threads:
        import torch

        torch.set_num_threads(threads)
    return LLMEngine(config, loaded)


def load_checked(args: argparse.Namespace):  # noqa: ANN201 - (EngineConfig, LoadedModel)
    """The engine's config and its model, loaded and checked to fit (the doctor's pre-flight)."""
    import dataclasses
    import functools

    from tokenfactory.engine.memory import free_memory_bytes, kv_budget_after_weights, resolve_device, resolve_dtype
    from tokenfactory.engine.placement import planned_weight_bytes
    from tokenfactory.layers.quant import effective_dense
    from tokenfactory.layers.weight_bytes import auto_dense, dense_order
    from tokenfactory.models.loader import load_model
    from tokenfactory.planner.doctor import preflight, raise_on_errors

    config = engine_config_from_args(args)
    loaded = load_model(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[str(dtype)[6:]]
    config = dataclasses.replace(config, quantization_dense=effective_dense(config.quantization_dense, device.type,
                                                                            dtype))
    # The bytes the weights will take once placed and quantized (--quantization, its dense copies counted), and
    # the KV budget as the engine will size it: a share of what is free after them (#18).
    base = config

    @functools.cache
    def planned(dense: str) -> int:
        return planned_weight_bytes(loaded, dataclasses.replace(base, quantization_dense=dense), device, dtype)

    weights, lean = planned(config.quantization_dense), planned("on-the-fly")
    free = free_memory_bytes(device)
    auto = getattr(args, "quantization_dense", "copy") == "auto"
    if auto and device.type == "cuda" and lean < weights:  # a copy beside the codes, more than unquantized? (#30)
        unquantized = planned_weight_bytes(loaded, dataclasses.replace(config, quantization="none"), device, dtype)
        if auto_dense(device.type, weights, lean, unquantized, copy_fits=True) == "on-the-fly":
            config, weights = dataclasses.replace(config, quantization_dense="on-the-fly"), lean

    def check(weights_bytes: int) -> list:
        # max_model_len None: the engine's own rule (the context, capped at what the cache holds), not the context.
        return preflight(loaded.config, device=str(device), dtype_bytes=dtype_bytes,
                         max_model_len=config.max_model_len,
                         kv_cache_bytes=kv_budget_after_weights(config.kv_cache_memory, device, free, weights_bytes),
                         free_memory_bytes=free, max_num_seqs=config.max_num_seqs, weights_bytes=weights_bytes,
                         kv_cache_dtype=config.kv_cache_dtype, weights_bytes_without_copy=lean)

    findings = check(weights)
    if auto:  # memory short: step down dense_order (prepacked, copy, on-the-fly) to the first form that fits
        for form in dense_order(device.type)[1:]:
            if not any(f.severity == "error" for f in findings):
                break
            smaller = planned(form)
            smaller_findings = check(smaller)
            if smaller < weights and not any(f.severity == "error" for f in smaller_findings):
                logger.info("pre-flight: the quantized layers' %s dense form does not fit (%.0f MB of weights); "
                            "serving with --quantization-dense %s (%.0f MB)", config.quantization_dense,
                            weights / 1e6, form, smaller / 1e6)
                config = dataclasses.replace(config, quantization_dense=form)
                findings, weights = smaller_findings, smaller
    for finding in findings:
        if finding.severity != "error":
            logger.info("pre-flight: %s", finding.message)
    raise_on_errors(findings)
    return config, loaded


def build_accounting(args: argparse.Namespace, model_config, device_type: str, name: str,  # noqa: ANN001, ANN201
                     backend_energies: Sequence = (), nodes=None):  # noqa: ANN001 - NodeEnergy | None
    """(Accounting, power line, prices line): this machine's meter (with `backend_energies` or `nodes`, a
    FleetMeter that adds the external backends' modelled energy and the Ray nodes' own to it) and the ledger,
    made once, before anything runs."""
    from pathlib import Path

    from tokenfactory.fleet.energy import FleetMeter
    from tokenfactory.meter.attribution import Meter, MeterConfig
    from tokenfactory.meter.ledger import Ledger
    from tokenfactory.meter.power import PowerConfig
    from tokenfactory.meter.prices import load_prices
    from tokenfactory.meter.sources import choose_power_source
    from tokenfactory.service.accounting import Accounting

    choice = choose_power_source(PowerConfig(source=args.power_source, constant_watts=args.power_watts,
                                             cpu_tdp_watts=args.cpu_tdp_watts,
                                             count_child_processes=fleet_mode(args)))
    for reason in choice.skipped:
        logger.info("power: %s", reason)
    prices = load_prices(Path(args.prices) if args.prices else None, device=args.device_profile,
                         device_name=accelerator_name(device_type), device_type=device_type)
    device = accelerator_name(device_type) or device_type  # the label in /metrics and the utilisation rollup
    meter = Meter(choice.source, model_config, prices, MeterConfig(device=device)).start()
    if backend_energies or nodes is not None:
        meter = FleetMeter(meter, list(backend_energies), nodes)
    ledger = Ledger.open(args.data_dir, url=args.database_url)
    return Accounting(meter, ledger, name), choice.source.describe(), prices.describe()


def accelerator_name(device_type: str) -> str | None:
    """The accelerator's marketing name ("NVIDIA H100 80GB HBM3"), which selects its price profile."""
    if device_type != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name()


@dataclass
class Started:
    """What serve needs from the engine side, single engine or fleet."""

    client: Any  # an EngineClient: AsyncEngine or Fleet
    accounting: Any  # Accounting
    name: str
    banner: list[str]  # "  key  value" lines: model, device, KV (one engine) or replicas (a fleet)
    power: str
    prices: str
    extra_models: dict = field(default_factory=dict)  # name -> Fleet: models served beside the default
    autoscaling: Any = None  # serve/autoscale.py's Autoscaling, with --autoscaler
    nodes: Any = None  # fleet/node_energy.py's NodeEnergy: the Ray replicas' nodes' books, with --ray


def launch_checked(args: argparse.Namespace) -> tuple[Any, Any, tuple[Any, str, str]]:
    """(AsyncEngine, LoadedModel, build_accounting's (accounting, power, prices)) for one engine in this process.
    Everything that touches torch — loading, the pre-flight, building, warming up, stepping — runs on the engine
    thread: a parallel region run first on another thread (the pre-flight's int4 layout probe was one) leaves
    the engine thread's OpenMP team stalling against it, and halved single-stream decode (106.7 -> 45 tok/s
    served; scripts/engine_thread_probe.py)."""
    from tokenfactory.engine.async_engine import AsyncEngine
    from tokenfactory.engine.memory import resolve_device

    made: dict[str, Any] = {}

    from tokenfactory.models.loader import served_name

    def build():  # noqa: ANN202 - LLMEngine
        config, loaded = load_checked(args)
        name = served_name(str(loaded.path), args.served_model_name)
        made["loaded"] = loaded
        made["accounting"] = build_accounting(args, loaded.config, resolve_device(config.device).type, name)
        return make_engine(config, loaded, getattr(args, "threads", None))

    client = AsyncEngine.launch(build)
    client.subscribe_steps(made["accounting"][0].meter.on_step)  # on the client's notifier thread, not the engine's
    return client, made["loaded"], made["accounting"]


def start_engine(args: argparse.Namespace) -> Started:
    """One engine in this process: loaded, checked, built, warmed up and stepped on one thread (launch_checked)."""
    from tokenfactory.models.loader import served_name

    client, loaded, (accounting, power, prices) = launch_checked(args)
    name = served_name(str(loaded.path), args.served_model_name)
    f = client.facts
    banner = [f"  model   {f.model_path}",
              f"  device  {f.device} ({f.dtype}), {(f.weight_bytes or 0) / 2**20:.0f} MiB of weights",
              f"  KV      {f.kv_tokens} tokens in {f.kv_blocks} blocks ({(f.kv_bytes or 0) / 2**30:.2f} GiB); "
              f"max_model_len {f.max_model_len} -> {f.max_concurrent_seqs or 0:.1f} sequences at full length"]
    return Started(client, accounting, name, banner, power, prices)


def model_info(config, loaded):  # noqa: ANN001, ANN201 - ModelInfo of a model loaded here (no engine of ours runs it)
    """`config` None: the model's own context window (a backend's model, whose server sets its limit)."""
    from tokenfactory.engine.client import ModelInfo

    max_model_len = config.max_model_len if config is not None else None
    return ModelInfo(str(loaded.path), max_model_len or loaded.config.max_position_embeddings,
                     loaded.tokenizer.vocab_size, loaded.config, eos_token_ids=tuple(loaded.tokenizer.eos_token_ids))
