"""`tokenfactory serve`: the OpenAI-compatible server on our engine. With no flags, the bundled model."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("tokenfactory.serve")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_memory(text: str) -> int | float:
    """'2GiB', '512MB', '1000000' (bytes) or '0.4' (a fraction of free memory)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected bytes (e.g. 2GiB, 512MB) or a fraction in (0, 1], got {text!r}")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not unit and value <= 1.0 and "." in m.group(1):
        return value
    return int(value * _UNITS[unit])


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from tokenfactory.levers import add_lever, engine_default  # one name, default and why per lever (#30)

    p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2-135M)")
    p.add_argument("--device", default=engine_default("device"),
                   help="cpu or cuda[:N]: where the weights, the KV cache and every step live")
    add_lever(p, "dtype", aliases=False, default=engine_default("dtype"),
              choices=["auto", "float32", "bfloat16", "float16"])
    add_lever(p, "max_model_len", aliases=False, type=int, default=engine_default("max_model_len"))
    add_lever(p, "max_num_seqs", aliases=False, type=int, default=engine_default("max_num_seqs"))
    add_lever(p, "max_num_batched_tokens", aliases=False, type=int, default=engine_default("max_num_batched_tokens"))
    add_lever(p, "block_size", aliases=False, type=int, default=engine_default("block_size"))
    p.add_argument("--kv-cache-memory", type=parse_memory, default=engine_default("kv_cache_memory"),
                   help="KV cache size: bytes (2GiB) or a fraction of the memory free once the weights are placed "
                        "(0.5). Default: 85%% of it on CUDA; 30%% on a CPU, at most 1 GiB (a CPU server shares its "
                        "RAM)")
    add_lever(p, "kv_cache_dtype", aliases=False, default=engine_default("kv_cache_dtype"),
              choices=["auto", "int8", "fp8"], extra="docs/memory.md")
    add_lever(p, "no_prefix_caching", aliases=False, action="store_true")
    p.add_argument("--batch-share", type=float, default=engine_default("batch_min_share"),
                   help="of --max-num-seqs, the share of seats kept for batch jobs while they have work, so a busy "
                        "server still finishes them; the rest they fill only when idle (docs/batch.md)")
    p.add_argument("--batch-yield", default=engine_default("batch_yield"), choices=["share", "seats"],
                   help="how far batch jobs give way to other traffic: share (down to --batch-share while it is "
                        "present: the default, right where compute is short) or seats (only the seats it needs)")
    add_lever(p, "quantization", aliases=False, default=engine_default("quantization"))
    p.add_argument("--quantization-dense", default="auto", choices=["auto", "copy", "on-the-fly"],
                   help="quantized layers' large steps: copy (keep a dequantized copy: fast batches, more memory), "
                        "on-the-fly (the packed codes only, dequantized per large step), or auto: on a CPU the copy "
                        "where it fits, else on-the-fly; on CUDA on-the-fly whenever the copy would make the weights "
                        "bigger than not quantizing them (int4 with a bf16 copy is more than bf16 alone)")
    p.add_argument("--seed", type=int, default=engine_default("seed"),
                   help="the sampling seed of requests that give none, so a server's answers can be reproduced")
    p.add_argument("--single-thread-step-tokens", type=int, default=None,
                   help="run steps of at most this many tokens on one CPU thread (0: off; default: what the machine "
                        "profile measured, see --machine-profile and docs/benchmarks.md)")
    p.add_argument("--machine-profile", default="auto", choices=["auto", "remeasure", "off"],
                   help="CPU kernel crossovers and the small-step thread policy, measured for this CPU and model: "
                        "auto (cached, measured at the first start, ~5 s), remeasure, or off (built-in constants); "
                        "`tokenfactory doctor --machine` prints it")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the engine's kernels (default: PyTorch's, one per core). On a machine "
                        "whose cores are also busy with other work, fewer threads avoid OpenMP's spin-wait collapse")
    p.add_argument("--speculative", default="none",
                   help="speculative decoding: none, ngram, draft:PATH or self-int4 (docs/speculative.md)")
    p.add_argument("--num-speculative-tokens", type=int, default=engine_default("num_speculative_tokens"),
                   help="most draft tokens per sequence and step: more pays when drafts are accepted, costs compute "
                        "when they are not")
    p.add_argument("--scheduling-policy", default=None,
                   help="waiting-queue order: fcfs, vtc (priority bands + weighted fair share in tokens) or "
                        "vtc-joules (the same, counted in measured joules); default vtc with --auth (the "
                        "tenants' priorities and weights apply), else fcfs; see docs/tenants.md")


def engine_config_from_args(args: argparse.Namespace):  # noqa: ANN201 - EngineConfig (imported lazily)
    from tokenfactory.config import EngineConfig

    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
                        batch_min_share=getattr(args, "batch_share", 0.1),
                        batch_yield=getattr(args, "batch_yield", "share"),
                        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                        quantization_dense=dense_path(getattr(args, "quantization_dense", "copy")),
                        quantization=args.quantization,
                        single_thread_step_tokens=getattr(args, "single_thread_step_tokens", None),
                        machine_profile=getattr(args, "machine_profile", "auto"),
                        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                        scheduling_policy=scheduling_policy(args))


def dense_path(flag: str) -> str:
    """--quantization-dense as the engine takes it: "auto" starts as the copy; the start-up check
    (`load_checked`) switches it to on-the-fly when only that fits."""
    return "copy" if flag == "auto" else flag


def scheduling_policy(args: argparse.Namespace) -> str:
    """The flag's, or the default: with --auth the tenants' priorities and weights apply (vtc)."""
    chosen = getattr(args, "scheduling_policy", None)
    if chosen:
        return chosen
    return "vtc" if getattr(args, "auth", False) else "fcfs"


def register(subparsers: argparse._SubParsersAction) -> None:
    from tokenfactory.levers import HelpFormatter

    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server", formatter_class=HelpFormatter)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the file's name)")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests beyond this get 503")
    p.add_argument("--max-body-bytes", type=parse_memory, default=4 << 20,
                   help="request bodies beyond this size get 413 (bytes, or 4MiB)")
    p.add_argument("--stream-send-timeout", type=float, default=30.0,
                   help="seconds a streaming client may take no data before it is dropped and its request "
                        "aborted (and billed for what was made)")
    p.add_argument("--data-dir", default=None, help="where the ledger lives (default: a per-user directory)")
    p.add_argument("--database-url", default=None, help="a SQLAlchemy URL instead of SQLite in --data-dir")
    p.add_argument("--power-source", default="auto",
                   help="auto, nvml, rapl, modelled, constant (or several joined with '+')")
    p.add_argument("--power-watts", type=float, default=None, help="watts for --power-source constant")
    p.add_argument("--cpu-tdp-watts", type=float, default=None, help="TDP for the modelled source")
    p.add_argument("--prices", default=None, help="a prices TOML file merged over the dated defaults")
    p.add_argument("--device-profile", default=None, help="the prices file's device profile (default: matched)")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    p.add_argument("--baseline", default=None, metavar="RESULT.json",
                   help="a saved `tokenfactory bench serve --save NAME` run (results/NAME.json) made on this machine: "
                        "its joules per output token go to /metrics for the J/token regression alert (deploy/)")
    p.add_argument("--auth", action="store_true",
                   help="require API keys (tenants and keys in --data-dir; see `tokenfactory tenants` and `keys`)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="without --auth, a host name requests may be addressed to besides IP addresses and localhost "
                        "(repeatable; '*': any). Other names are refused, so that a web page cannot reach the server "
                        "through DNS rebinding (docs/server.md, \"Trust without --auth\")")
    add_limit_args(p)
    g = p.add_argument_group("batch API (docs/batch.md)")
    g.add_argument("--batch-lines-in-flight", type=int, default=32,
                   help="Batch API lines in the engine at once, all jobs together")
    g.add_argument("--batch-lines-per-tenant", type=int, default=None,
                   help="of those, the most one tenant's jobs hold at once (default: half; all of them without --auth)")
    g.add_argument("--batch-jobs-per-tenant", type=int, default=16, help="batches one tenant may have running")
    g.add_argument("--batch-storage-per-tenant", type=parse_memory, default=1 << 30,
                   help="bytes of Batch API files one tenant may keep (default 1GiB)")
    g.add_argument("--batch-stop-grace", type=float, default=10.0,
                   help="at shutdown, seconds the lines in flight get to finish before they are cut off (they run "
                        "again at the next start, billed once)")
    g.add_argument("--batch-cancel-grace", type=float, default=60.0,
                   help="seconds a cancelled (or stopped) batch's lines in flight get to finish before they are cut "
                        "off and reported with what they billed")
    add_fleet_args(p)
    from tokenfactory.serve.scenario import add_profile_args  # serve --profile (planner/scenarios.py)

    add_profile_args(p)
    p.set_defaults(func=serve)


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    """Replicas behind the gateway (docs/fleet.md)."""
    from tokenfactory.fleet.router import ROUTERS

    g = p.add_argument_group("fleet")
    g.add_argument("--replicas", type=int, default=1,
                   help="engine replicas of the model: 1 runs it in this process; N > 1 starts N local processes "
                        "(or Ray actors with --ray), each with its share of the cores; 0 with --backend only")
    g.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="place the replicas as Ray actors: on a local Ray (no ADDRESS) or an existing cluster")
    g.add_argument("--backend", action="append", type=_backend_spec, default=[], metavar="URL[,model=..]",
                   help="an external OpenAI-compatible server as a replica (repeatable): "
                        "URL[,model=ITS_NAME][,served=OUR_NAME][,device=CATALOG_DEVICE][,key=API_KEY][,tokenizer=PATH]"
                        "; it joins --model's replicas, or with tokenizer= (a model no replica here runs) serves "
                        "`served` (default: `model`) on its own")
    g.add_argument("--fleet-model", action="append", type=_model_spec, default=[], metavar="PATH[,name=..]",
                   help="another model served beside --model by its own local replicas (repeatable): "
                        "PATH[,name=SERVED_NAME][,replicas=N]; requests go to the model their `model` names")
    g.add_argument("--router", default="least-work", choices=sorted(ROUTERS),
                   help="routing policy: least-work (outstanding tokens), prefix (prefix affinity, load "
                        "fallback) or energy (lowest marginal joules per token within a TTFT bound)")
    g.add_argument("--sticky-sessions", action="store_true", help="keep a request's `user` on one replica")
    g.add_argument("--replica-timeout", type=float, default=10.0,
                   help="seconds a replica may stay silent before it counts as hung and is restarted")
    from tokenfactory.serve.autoscale import add_autoscaler_args  # docs/autoscaling.md

    add_autoscaler_args(p.add_argument_group("autoscaling"))


def _backend_spec(text: str):  # noqa: ANN202 - BackendSpec
    from tokenfactory.fleet.launch import BackendSpec

    try:
        return BackendSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _model_spec(text: str):  # noqa: ANN202 - ModelSpec
    from tokenfactory.fleet.launch import ModelSpec

    try:
        return ModelSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def fleet_mode(args: argparse.Namespace) -> bool:
    return getattr(args, "replicas", 1) != 1 or getattr(args, "ray", None) is not None or bool(
        getattr(args, "autoscaler", None)) or bool(getattr(args, "backend", [])) or bool(
        getattr(args, "fleet_model", []))


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """Connection limits and timeouts (docs/server.md, "Limits"); defaults are LimitSettings'."""
    g = p.add_argument_group("limits")
    g.add_argument("--limit-concurrency", type=int, default=1024,
                   help="open connections or running requests beyond this get 503 (0: no limit)")
    g.add_argument("--backlog", type=int, default=2048, help="connections the kernel queues before accept()")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds from a request head's first byte (or the connection's opening) to its end; "
                        "past it the connection is closed (slowloris)")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds from the end of a request head to the end of its body; past it, 408")
    g.add_argument("--max-header-bytes", type=parse_memory, default=16 << 10,
                   help="request line and headers beyond this size get 431")
    g.add_argument("--send-buffer", type=parse_memory, default=256 << 10,
                   help="the kernel's send buffer per connection (SO_SNDBUF): what a client that stops reading "
                        "can hold of the server's memory before --stream-send-timeout counts")


def batch_settings_from_args(args: argparse.Namespace):  # noqa: ANN201 - BatchSettings (imports the gateway)
    from tokenfactory.batch.runner import BatchSettings

    return BatchSettings(max_lines_in_flight=args.batch_lines_in_flight,
                         max_lines_in_flight_per_tenant=args.batch_lines_per_tenant,
                         max_active_jobs_per_tenant=args.batch_jobs_per_tenant,
                         max_bytes_per_tenant=int(args.batch_storage_per_tenant), stop_grace_s=args.batch_stop_grace,
                         cancel_grace_s=args.batch_cancel_grace, prices_path=args.prices)


def limit_settings_from_args(args: argparse.Namespace):  # noqa: ANN201 - LimitSettings (imports uvicorn)
    from tokenfactory.gateway.limits import LimitSettings

    return LimitSettings(limit_concurrency=args.limit_concurrency or None, backlog=args.backlog,
                         timeout_keep_alive_s=args.timeout_keep_alive, header_timeout_s=args.header_timeout,
                         body_timeout_s=args.body_timeout, max_header_bytes=int(args.max_header_bytes),
                         send_buffer_bytes=int(args.send_buffer))


def read_baseline(path: str) -> tuple[str, float]:
    """(run name, J per output token) of a saved bench result; ValueError naming what is missing."""
    import json
    from pathlib import Path

    try:
        figures = json.loads(Path(path).read_text()).get("figures") or {}
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--baseline {path}: cannot read a bench result ({e})") from e
    value = figures.get("joules_per_output_token")
    if not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"--baseline {path}: the run has no joules_per_output_token figure (it measured no energy)")
    return Path(path).stem, float(value)


def display_url(url: str) -> str:
    """A database URL with its password hidden, for the banner and logs."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):  # not a URL SQLAlchemy reads: still hide what sits between ':' and '@'
        return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", url)


def make_engine(config, loaded, step_listeners: Sequence[Callable], threads: int | None = None):  # noqa: ANN001, ANN201
    """The LLMEngine (imported lazily), on the calling thread: the one that will step it."""
    from tokenfactory.engine.engine import LLMEngine

    if threads:
        import torch

        torch.set_num_threads(threads)
    return LLMEngine(config, loaded, step_listeners=step_listeners)


def load_checked(args: argparse.Namespace):  # noqa: ANN201 - (EngineConfig, LoadedModel)
    """The engine's config and its model, loaded and checked to fit (the doctor's pre-flight)."""
    import dataclasses

    from tokenfactory.engine.memory import free_memory_bytes, kv_budget_after_weights, resolve_device, resolve_dtype
    from tokenfactory.engine.placement import planned_weight_bytes
    from tokenfactory.models.loader import load_model
    from tokenfactory.planner.doctor import preflight, raise_on_errors

    config = engine_config_from_args(args)
    loaded = load_model(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[str(dtype)[6:]]
    # The bytes the weights will take once placed and quantized (--quantization, its dense copy counted), and
    # the KV budget as the engine will size it: a share of what is free after them (#18).
    weights = planned_weight_bytes(loaded, config, device, dtype)
    lean_config = dataclasses.replace(config, quantization_dense="on-the-fly")
    lean = planned_weight_bytes(loaded, lean_config, device, dtype)
    free = free_memory_bytes(device)

    def check(weights_bytes: int) -> list:
        return preflight(loaded.config, device=str(device), dtype_bytes=dtype_bytes,
                         max_model_len=config.max_model_len or loaded.config.max_position_embeddings,
                         kv_cache_bytes=kv_budget_after_weights(config.kv_cache_memory, device, free, weights_bytes),
                         free_memory_bytes=free, max_num_seqs=config.max_num_seqs, weights_bytes=weights_bytes,
                         kv_cache_dtype=config.kv_cache_dtype, weights_bytes_without_copy=lean)

    findings = check(weights)
    has_errors = any(f.severity == "error" for f in findings)
    if has_errors and lean < weights and getattr(args, "quantization_dense", "copy") == "auto":
        lean_findings = check(lean)  # memory is short: the packed codes alone, if that fits
        if not any(f.severity == "error" for f in lean_findings):
            logger.info("pre-flight: the quantized layers' dense copy does not fit (%.0f MB of weights with it); "
                        "serving with --quantization-dense on-the-fly (%.0f MB)", weights / 1e6, lean / 1e6)
            config, findings = lean_config, lean_findings
    for finding in findings:
        if finding.severity != "error":
            logger.info("pre-flight: %s", finding.message)
    raise_on_errors(findings)
    return config, loaded


def build_accounting(args: argparse.Namespace, model_config, device_type: str, name: str):  # noqa: ANN001, ANN201
    from pathlib import Path

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
        return make_engine(config, loaded, [made["accounting"][0].meter.on_step], getattr(args, "threads", None))

    client = AsyncEngine.launch(build)
    return client, made["loaded"], made["accounting"]


def start_engine(args: argparse.Namespace) -> Started:
    """One engine in this process: loaded, checked, built, warmed up and stepped on one thread (launch_checked)."""
    from tokenfactory.models.loader import served_name

    client, loaded, (accounting, power, prices) = launch_checked(args)
    name = served_name(str(loaded.path), args.served_model_name)
    engine, cap = client.engine, client.engine.capacity
    banner = [f"  model   {engine.model_path}",
              f"  device  {engine.device} ({str(engine.dtype).removeprefix('torch.')}), "
              f"{engine.weight_bytes / 2**20:.0f} MiB of weights",
              f"  KV      {cap.num_tokens} tokens in {cap.num_blocks} blocks ({cap.total_bytes / 2**30:.2f} GiB); "
              f"max_model_len {cap.max_model_len} -> {cap.max_concurrent_seqs:.1f} sequences at full length"]
    return Started(client, accounting, name, banner, power, prices)


def start_fleet(args: argparse.Namespace) -> Started:
    """Replicas in local processes or on Ray, and external backends, behind one Fleet per model (docs/fleet.md):
    --model's (the default), each --fleet-model's, and each backend model we do not run ourselves."""
    from tokenfactory.fleet.energy import FleetMeter
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
    accounting, power, prices = build_accounting(args, groups[0].info.config, config.device.split(":")[0], name)
    energies = _add_backends(args, groups)
    if energies:
        accounting.meter = FleetMeter(accounting.meter, energies)
    from tokenfactory.serve.autoscale import hold_s

    fleets = {g.name: Fleet(g.name, g.replicas, _router(args), info=g.info, tokenizer=g.tokenizer,
                            hold_s=hold_s(args) if g.name == name else 0.0) for g in groups}
    for fleet in fleets.values():
        fleet.step_listeners.append(accounting.meter.on_step)  # one meter: this machine's power, every step
        fleet.start()
    from tokenfactory.serve.autoscale import describe, start_autoscaler

    autoscaling = start_autoscaler(args, fleets[name], config, power_model)  # the default model's replicas
    banner = [f"  model   {groups[0].model_path}"]
    if autoscaling is not None:
        banner.append(f"  scaling {describe(autoscaling)}")
    for fleet in fleets.values():
        banner.append(f"  fleet   {fleet.model}: {len(fleet.replicas)} replicas, router {fleet.router.name}")
        for r in fleet.replicas.values():
            facts = getattr(r.client, "facts", {})
            where = f"pid {facts['pid']}" if "pid" in facts else getattr(r.client, "url", "")
            banner.append(f"    {r.replica_id:6} {r.kind:8} {r.device:6} {where}; routing watts {r.idle_watts:.0f} "
                          f"idle / {r.busy_watts:.0f} busy")
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
        info, tokenizer, model_path = client.info, client.tokenizer, str(client.facts["model_path"])
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


def model_info(config, loaded):  # noqa: ANN001, ANN201 - ModelInfo of a model loaded here (no engine of ours runs it)
    """`config` None: the model's own context window (a backend's model, whose server sets its limit)."""
    from tokenfactory.engine.client import ModelInfo

    max_model_len = config.max_model_len if config is not None else None
    return ModelInfo(str(loaded.path), max_model_len or loaded.config.max_position_embeddings,
                     loaded.tokenizer.vocab_size, loaded.config, eos_token_ids=tuple(loaded.tokenizer.eos_token_ids))


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn
    from sqlalchemy.exc import SQLAlchemyError

    from tokenfactory.batch.routes import install_batch_routes
    from tokenfactory.engine.client import ChargeEnergy
    from tokenfactory.gateway.app import ServerSettings, build_app
    from tokenfactory.gateway.limits import raise_fd_limit, wrap_app

    try:
        limits = limit_settings_from_args(args)
        baseline = read_baseline(args.baseline) if getattr(args, "baseline", None) else None
        from tokenfactory.serve.scenario import apply_profile

        profile_line = apply_profile(args, getattr(args, "profile_defaults", {}))
        started = start_fleet(args) if fleet_mode(args) else start_engine(args)
    except (ValueError, RuntimeError, FileNotFoundError, OSError, SQLAlchemyError) as e:
        print(f"tokenfactory serve: cannot start: {e}", file=sys.stderr)
        return 2
    client, accounting, name = started.client, started.accounting, started.name
    if scheduling_policy(args) == "vtc-joules":  # the meter's measured joules charge the tenants' counters
        accounting.meter.energy_listeners.append(lambda joules: client.send(ChargeEnergy(joules)))

    def shutdown() -> None:  # after uvicorn drained the requests and the app its pending ledger rows
        if started.autoscaling is not None:  # no replica starts or stops while the fleet shuts down
            started.autoscaling.stop()
        client.shutdown()
        accounting.meter.close()
        accounting.close()

    settings = ServerSettings(served_model_name=name, max_waiting=args.max_waiting,
                              max_body_bytes=int(args.max_body_bytes),
                              stream_send_timeout_s=args.stream_send_timeout, baseline=baseline)
    tenancy, auth_line = build_tenancy(args, client, accounting)
    app = build_app(client, settings, accounting, on_shutdown=shutdown, tenancy=tenancy,
                    models=started.extra_models, allowed_hosts=args.allowed_host)
    install_batch_routes(app, app.state.service, batch_settings_from_args(args))  # /v1/files, /v1/batches
    if started.autoscaling is not None:  # GET /fleet/autoscaler, its /metrics, the TTFT feed
        from tokenfactory.serve.autoscale import install_autoscaler_routes

        install_autoscaler_routes(app, started.autoscaling, app.state.metrics.registry, app.state.metrics.ttft, name)
    print("\n".join([f"tokenfactory serving {name}", *started.banner,
                     *([f"  profile {profile_line}"] if profile_line else []),
                     f"  power   {started.power}",
                     f"  prices  {started.prices}",
                     f"  ledger  {display_url(accounting.ledger.url)}",
                     f"  auth    {auth_line}",
                     f"  limits  {limits.describe()}",
                     f"  url     http://{args.host}:{args.port}/v1"]), flush=True)
    if fd_warning := raise_fd_limit(limits):
        logger.warning("limits: %s", fd_warning)
    uvicorn.run(wrap_app(app, limits), host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=30, **limits.uvicorn_kwargs())
    return 0


def build_tenancy(args: argparse.Namespace, client, accounting):  # noqa: ANN001, ANN201 - (Tenancy, banner line)
    """Auth (with --auth), admission limits and budgets, and the tenants' fair-share weights (sent to the
    engine through its client)."""
    from tokenfactory.engine.client import SetTenantWeight
    from tokenfactory.service.admission import Admission
    from tokenfactory.service.tenancy import Tenancy
    from tokenfactory.tenants.store import TenantStore

    def set_weight(tenant: str, weight: float) -> None:
        client.send(SetTenantWeight(tenant, weight))

    admission = Admission(accounting.ledger, max_waiting=args.max_waiting)
    if not args.auth:
        return (Tenancy(None, admission, set_weight),
                f"off (anyone who can reach the port can use it); scheduling {scheduling_policy(args)}")
    store = TenantStore(accounting.ledger.engine)
    num_tenants, num_admin = len(store.list_tenants()), sum(k.is_admin for k in store.list_keys())
    hint = "" if num_admin else "; no admin key yet: `tokenfactory keys create --admin`"
    return (Tenancy(store, admission, set_weight),
            f"on: API keys required ({num_tenants} tenants){hint}; scheduling {scheduling_policy(args)}")
