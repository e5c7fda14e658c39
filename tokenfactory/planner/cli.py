"""`tokenfactory plan` and `tokenfactory doctor`. Registration is light (argparse only); each command
imports what it needs when it runs."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tokenfactory.levers import OUTPUT_TOKENS, PROMPT_TOKENS

PLAN_HELP = "capacity, speed, cost and energy of a model on a card, before you rent or buy"
DOCTOR_HELP = ("pre-flight (will it fit?), with --url why a running server is slow, or with --machine the kernel "
               "crossovers and thread policy the engine measured on this machine")


def register(subparsers: argparse._SubParsersAction) -> None:
    from tokenfactory.levers import HelpFormatter

    plan = subparsers.add_parser("plan", help=PLAN_HELP, description=PLAN_HELP, formatter_class=HelpFormatter)
    _add_model_args(plan)
    _add_plan_args(plan)
    plan.set_defaults(func=cmd_plan)
    doctor = subparsers.add_parser("doctor", help=DOCTOR_HELP, description=DOCTOR_HELP, formatter_class=HelpFormatter)
    _add_model_args(doctor)
    live = doctor.add_argument_group("live diagnosis")
    live.add_argument("--url", help="a running server: tokenfactory, vLLM, SGLang or llama.cpp (--metrics), e.g. "
                                    "http://127.0.0.1:8000; read twice, --interval apart")
    live.add_argument("--interval", type=float, default=5.0,
                      help="seconds between the two metric reads (0: read once, totals since start-up only)")
    live.add_argument("--timeout", type=float, default=5.0, help="HTTP timeout per read, seconds")
    memory = doctor.add_argument_group("memory")
    memory.add_argument("--free-memory-gib", type=float,
                        help="memory free for the server, all cards together (default: each card's memory x the "
                             "share the plan gives an engine, 90%% on a GPU: vLLM's gpu_memory_utilization)")
    from tokenfactory.levers import parse_memory

    memory.add_argument("--kv-cache-memory", type=parse_memory,
                        help="the KV cache the server will allocate, as serve takes it: bytes (20GiB) or a fraction "
                             "of the memory left after the weights (0.5). Default: all that is left, less the "
                             "runtime reserve")
    memory.add_argument("--kv-cache-gib", type=float, help="the same in GiB (the older name of --kv-cache-memory)")
    machine = doctor.add_argument_group("machine profile")
    machine.add_argument("--machine", action="store_true",
                         help="print this machine's profile for MODEL (a GGUF file or HF folder; default the bundled "
                              "model): cached, or measured now as the engine's first start would (bench/machine.py "
                              "builds the engine; the planner itself never does)")
    machine.add_argument("--remeasure", action="store_true", help="with --machine: measure again and cache it")
    machine.add_argument("--threads", type=int, help="with --machine: CPU threads (default: PyTorch's)")
    doctor.set_defaults(func=cmd_doctor)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from tokenfactory.levers import add_lever, engine_default

    p.add_argument("model", nargs="?", help="catalog name, config.json (or its folder), or a .gguf file")
    p.add_argument("--device", help="catalog device, e.g. H100-SXM, A100-80GB, RTX-4090, CPU-Xeon-8480-2S "
                                    "(plan --list-devices)")
    p.add_argument("--devices", type=int, default=1, help="cards per replica, in tensor parallel")
    add_lever(p, "quantization", default="auto",
              extra="the planner also takes bf16, fp16, fp32, fp8 (weights in that format) and gguf (the file's own "
                    "blocks); auto: as stored (a GGUF's own blocks, else --dtype)")
    add_lever(p, "dtype", default=engine_default("dtype"), choices=["auto", "bfloat16", "float16", "float32"],
              extra="the planner takes auto as the model's own dtype (bf16 for most)")
    add_lever(p, "kv_cache_dtype", default=engine_default("kv_cache_dtype"),
              extra="the planner also takes bf16, fp16 and fp32")
    add_lever(p, "max_model_len", type=int, default=engine_default("max_model_len"))
    add_lever(p, "max_num_seqs", type=int, default=engine_default("max_num_seqs"))
    add_lever(p, "max_num_batched_tokens", type=int, default=engine_default("max_num_batched_tokens"),
              extra="the planner sizes the activations from it")
    p.add_argument("--engine", default="reference", choices=["reference", "tokenfactory"],
                   help="whose weight bytes decide what fits: reference (each weight once, in its format) or "
                        "tokenfactory (our engine's int8/int4 accounting and the form serve --quantization-dense "
                        "auto keeps: on a GPU never more than unquantized)")
    p.add_argument("--catalog", action="append", default=[], metavar="PATH",
                   help="extra catalog file or directory (TOML/JSON; repeatable; later wins)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from tokenfactory.levers import add_lever
    from tokenfactory.meter.prices import shared_defaults

    money = shared_defaults()
    add_lever(p, "prompt_tokens", type=float, default=PROMPT_TOKENS)
    add_lever(p, "output_tokens", type=float, default=OUTPUT_TOKENS)
    p.add_argument("--batch-sizes", help="comma-separated batch sizes for the speed table (default: powers of two up "
                                         "to what the KV cache holds)")
    demand = p.add_argument_group("demand and SLOs")
    demand.add_argument("--tokens-per-day", type=float, help="output tokens to produce per day: sizes the fleet")
    demand.add_argument("--window-hours", type=float, default=24.0,
                        help="hours a day the demand arrives in (a shorter window needs more replicas at once)")
    demand.add_argument("--tokens-per-second", type=float,
                        help="measured tokens/s per replica: fleet and cost use it instead of the model's (the "
                             "output says which is which)")
    demand.add_argument("--wall-watts", type=float,
                        help="measured power of one busy replica at the socket (cards, host and power supply, e.g. a "
                             "plug meter): cost and the monthly bill use it instead of the modelled watts")
    demand.add_argument("--ttft-slo", type=float, help="time to first token target, seconds")
    demand.add_argument("--tpot-slo", type=float, help="time per output token target, seconds: caps the batch")
    prices = p.add_argument_group(
        "money (defaults: tokenfactory/meter/prices.toml, the file the server's meter prices with; "
        "a card's rent and price: its profile there)")
    _add_money_args(prices, money)
    _add_output_args(p.add_argument_group("calibration and output"))


def _add_money_args(g: argparse._ArgumentGroup, money: Any) -> None:
    from tokenfactory.levers import add_lever

    add_lever(g, "currency", default="USD", type=str.upper,
              extra=f"known rates: {', '.join(f'{k} {v:g}' for k, v in money.currencies.items())} per US$")
    add_lever(g, "currency_per_usd", type=float, extra=money.sources["currencies"])
    add_lever(g, "electricity_per_kwh", type=float, aliases=False,
              extra=f"default: {money.usd_per_kwh:g} US$/kWh, the US EIA commercial average "
                    f"({money.sources['electricity'][:10]})")
    g.add_argument("--electricity-usd-per-kwh", type=float, dest="electricity_per_kwh_usd",
                   help="the same in US$, converted at --currency-per-usd (the older name of --electricity-per-kwh)")
    add_lever(g, "pue", type=float, extra=f"default: {money.pue:g}")
    add_lever(g, "psu_efficiency", type=float, extra=f"default: {money.psu_efficiency:g}")
    g.add_argument("--rent-per-hour", type=float,
                   help="on-demand rent per card and hour, in --currency; paid only for the busy hours (default: the "
                        "card's rate in the prices file)")
    g.add_argument("--rent-usd-per-hour", type=float, dest="rent_per_hour_usd",
                   help="the same in US$ (the older name of --rent-per-hour)")
    g.add_argument("--reserved-per-hour", type=float,
                   help="a committed rental per card and hour, paid every hour busy or not (default: "
                        f"{money.reserved_fraction:g} x the on-demand rate)")
    g.add_argument("--purchase-price", type=float,
                   help="price of one card, in --currency (default: the card's price in the prices file)")
    g.add_argument("--purchase-usd", type=float, dest="purchase_price_usd",
                   help="the same in US$ (the older name of --purchase-price)")
    g.add_argument("--host-price", type=float,
                   help="each card's share of the machine around it (CPU, memory, board, PSU), in --currency "
                        f"(default: {', '.join(f'{k} US${v:,.0f}' for k, v in money.host_usd_per_card.items())} per "
                        "card)")
    g.add_argument("--lifetime-years", type=float,
                   help=f"years a bought card is paid off over (default {money.lifetime_years:g}: servers' "
                        "depreciation; the essay's self-built box, 3)")
    g.add_argument("--utilisation", type=float,
                   help="share of the hours a card does paid work, (0, 1] (default: with --tokens-per-day the "
                        f"fleet's own busy share, else {money.utilisation:g}); renting on demand pays only these hours")


def _add_output_args(out: argparse._ArgumentGroup) -> None:
    out.add_argument("--calibrate", metavar="RESULT.json", help="fit the efficiency factors to a bench result")
    out.add_argument("--calibrate-out", metavar="FILE.toml", help="write the fitted factors as a catalog file")
    out.add_argument("--plot", metavar="DIR", help="write tokens/s and J/token PNG charts into DIR")
    out.add_argument("--list-devices", action="store_true", help="list catalog devices and exit")
    out.add_argument("--list-models", action="store_true", help="list catalog models and exit")
    out.add_argument("--profile", choices=["auto", "latency", "throughput", "efficiency"],
                     help="print a serving profile (serve --profile): auto (the default whenever --tpot-slo or "
                          "--tokens-per-day states a workload) chooses one for it and says why")


def _need(value: Any, flag: str, hint: str) -> Any:
    if value is None:
        raise ValueError(f"{flag} is required: {hint}")
    return value


def precision_from(args: argparse.Namespace, model: Any) -> str | None:
    """The planner's weight format from --quantization and --dtype, as serve reads them: a quantization wins;
    auto keeps what the file stores (a GGUF's own blocks, a GPTQ/AWQ checkpoint's codes), else --dtype; none is
    unquantized in --dtype."""
    quant = (args.quantization or "auto").strip().lower()
    if quant not in ("auto", "none"):
        return quant
    if quant == "auto" and model.default_precision in ("gguf", "checkpoint"):
        return None
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(args.dtype)
    return dtype or (None if quant == "auto" else "bf16")


def cmd_plan(args: argparse.Namespace) -> int:
    from tokenfactory.planner.catalog import load_catalog

    catalog = load_catalog(args.catalog)
    if args.list_devices or args.list_models:
        _print_listing(catalog, args.list_devices, args.json)
        return 0
    from tokenfactory.planner.calibrate import calibrate, load_bench_result
    from tokenfactory.planner.hardware import hardware_from_catalog
    from tokenfactory.planner.memory import resolve_weights
    from tokenfactory.planner.modelsrc import load_model
    from tokenfactory.planner.perf import StepModel
    from tokenfactory.planner.precision import parse_kv_dtype

    bench = load_bench_result(args.calibrate) if args.calibrate else None
    model = load_model(_need(args.model or (bench and bench.model), "model",
                             "a catalog name, config.json or .gguf (see --list-models)"), catalog)
    device = catalog.device(_need(args.device or (bench and bench.device), "--device",
                                  f"one of {', '.join(catalog.device_names())}"))
    hw = hardware_from_catalog(catalog, device, bench.num_devices if bench and args.devices == 1 else args.devices)
    precision = precision_from(args, model) or (bench.dtype if bench else None)
    calibration = None
    if bench is not None:
        weights = resolve_weights(model, precision)
        kv = parse_kv_dtype(args.kv_cache_dtype if args.kv_cache_dtype != "auto" else bench.kv_dtype,
                            weights.precision)
        calibration = calibrate(bench, StepModel(hw, model, weights, kv))
        hw = replace(hw, efficiency=calibration.efficiency, power=calibration.power)
    plan = _make_plan(args, catalog, model, hw, precision)
    plots = []
    if args.plot:
        from tokenfactory.planner.plot import write_plots

        plots = [str(p) for p in write_plots(plan, args.plot)]
    if calibration is not None and args.calibrate_out:
        with open(args.calibrate_out, "w") as f:
            f.write(calibration.to_toml(device.name, args.calibrate))
    stated = args.tpot_slo is not None or args.tokens_per_day is not None  # a workload: say which profile fits
    profile = _profile(args, plan) if args.profile or stated else None
    _print_plan(plan, calibration, plots, args, profile)
    return 0


def _profile(args: argparse.Namespace, plan: Any) -> Any:
    from tokenfactory.planner.perf import StepModel
    from tokenfactory.planner.scenarios import choose_profile, make_profile

    req = plan.request
    steps = StepModel(req.hardware, req.model, plan.weights, plan.kv_dtype)
    kv_seqs = plan.memory.max_seqs(req.workload.prompt_tokens + req.workload.output_tokens)
    if args.profile not in (None, "auto"):
        return make_profile(args.profile, steps, req.workload, kv_seqs, "as asked")
    demand = args.tokens_per_day / (args.window_hours * 3600) if args.tokens_per_day is not None else None
    return choose_profile(steps, req.workload, kv_seqs, args.tpot_slo, demand)


def currency_from(args: argparse.Namespace) -> Any:
    from tokenfactory.planner.cost import currency_for

    return currency_for(getattr(args, "currency", None), getattr(args, "currency_per_usd", None))


def money_from(args: argparse.Namespace, name: str, currency: Any, usd_default: float | None) -> float | None:
    """A price flag in --currency, or its older US$ spelling converted, or the prices file's US$ default."""
    given, usd = getattr(args, name, None), getattr(args, f"{name}_usd", None)
    if given is not None and usd is not None:
        raise ValueError(f"--{name.replace('_', '-')} and its US$ spelling were both given: keep one")
    if given is not None:
        return given
    if usd is not None:
        return currency.from_usd(usd)
    return currency.from_usd(usd_default) if usd_default is not None else None


def prices_from(args: argparse.Namespace, device: Any) -> Any:
    """The plan's prices: every flag, else the one source (meter/prices.toml, through the catalog for a card)."""
    from tokenfactory.meter.prices import shared_defaults
    from tokenfactory.planner.cost import Prices

    money, currency = shared_defaults(), currency_from(args)
    rent = money_from(args, "rent_per_hour", currency,
                      device.rent_usd_per_hour.value if device.rent_usd_per_hour else None)
    reserved = args.reserved_per_hour if args.reserved_per_hour is not None else (
        rent * money.reserved_fraction if rent is not None else None)
    host = args.host_price if args.host_price is not None else currency.from_usd(
        money.host_usd_per_card.get(device.host, 0.0))
    return Prices(
        currency=currency, electricity_per_kwh=money_from(args, "electricity_per_kwh", currency, money.usd_per_kwh),
        pue=args.pue if args.pue is not None else money.pue,
        psu_efficiency=args.psu_efficiency if args.psu_efficiency is not None else money.psu_efficiency,
        lifetime_years=args.lifetime_years if args.lifetime_years is not None else money.lifetime_years,
        utilisation=args.utilisation if args.utilisation is not None else money.utilisation,
        rent_per_hour=rent, reserved_per_hour=reserved,
        purchase_price=money_from(args, "purchase_price", currency, device.price_usd.value if device.price_usd
                                  else None), host_price=host)


def _batch_sizes(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        sizes = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError("--batch-sizes must list integers >= 1")
    return sizes


def request_from(args: argparse.Namespace, model: Any, hw: Any, precision: str | None, prices: Any = None) -> Any:
    """The PlanRequest both plan and doctor build from the same flags (one truth on the same inputs)."""
    from tokenfactory.planner.core import SLO, Demand, PlanRequest
    from tokenfactory.planner.perf import Workload

    tokens_per_day = getattr(args, "tokens_per_day", None)
    return PlanRequest(
        model=model, hardware=hw, prices=prices, precision=precision, kv_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        workload=Workload(getattr(args, "prompt_tokens", PROMPT_TOKENS), getattr(args, "output_tokens", OUTPUT_TOKENS)),
        demand=Demand(tokens_per_day, args.window_hours) if tokens_per_day is not None else None,
        slo=SLO(getattr(args, "ttft_slo", None), getattr(args, "tpot_slo", None)),
        tokens_per_second=getattr(args, "tokens_per_second", None), wall_watts=getattr(args, "wall_watts", None),
        batch_sizes=_batch_sizes(
            getattr(args, "batch_sizes", None)), engine=args.engine,
        utilisation_from_fleet=tokens_per_day is not None and getattr(args, "utilisation", None) is None)


def _make_plan(args: argparse.Namespace, catalog: Any, model: Any, hw: Any, precision: str | None) -> Any:
    from tokenfactory.planner.plan import make_plan

    return make_plan(request_from(args, model, hw, precision, prices_from(args, hw.device)), catalog)


def _print_plan(plan: Any, calibration: Any, plots: Sequence[str], args: argparse.Namespace,
                profile: Any = None) -> None:
    from tokenfactory.planner.report import plan_to_dict, render_plan

    if args.json:
        out = plan_to_dict(plan)
        if calibration is not None:
            out["calibration"] = _calibration_dict(calibration)
        out["plots"] = list(plots)
        if profile is not None:
            out["profile"] = profile.__dict__
        print(json.dumps(out, indent=2, default=str))
        return
    if calibration is not None:
        print(_calibration_text(calibration, args))
    print(render_plan(plan), end="")
    if profile is not None:
        print(f"Profile {profile.describe()}\n  because {profile.reason}")
    for path in plots:
        print(f"wrote {path}")


def _calibration_dict(cal: Any) -> dict[str, Any]:
    return {"bandwidth": cal.efficiency.bandwidth, "compute": cal.efficiency.compute,
            "memory_bound_activity": cal.power.memory_bound_activity,
            "compute_bound_activity": cal.power.compute_bound_activity, "fitted": list(cal.fitted),
            "kept_default": list(cal.kept), "rms_log_error_before": cal.rms_log_error_before,
            "rms_log_error_after": cal.rms_log_error_after,
            "points": [{"batch_size": p.batch_size, "measured_tokens_per_s": p.output_tokens_per_s,
                        "predicted_tokens_per_s": tps, "measured_power_w": p.power_w, "predicted_power_w": w}
                       for p, tps, w in cal.predictions]}


def _calibration_text(cal: Any, args: argparse.Namespace) -> str:
    lines = [f"Calibration from {args.calibrate}: bandwidth {cal.efficiency.bandwidth:.3f}, compute "
             f"{cal.efficiency.compute:.3f} (fitted: {', '.join(cal.fitted) or 'nothing'}"
             + (f"; kept defaults: {', '.join(cal.kept)}" if cal.kept else "") + ")",
             f"  rms log error {cal.rms_log_error_before:.3f} -> {cal.rms_log_error_after:.3f}",
             "  batch  measured tok/s  predicted tok/s"]
    for p, tps, _ in cal.predictions:
        lines.append(f"  {p.batch_size:>5} {p.output_tokens_per_s:>15,.1f} {tps:>16,.1f}")
    if args.calibrate_out:
        lines.append(f"  wrote {args.calibrate_out} (use it with --catalog {args.calibrate_out})")
    return "\n".join(lines) + "\n"


def _print_listing(catalog: Any, devices: bool, as_json: bool) -> None:
    if devices:
        rows = [{"name": d.name, "kind": d.kind, "memory_gib": d.memory_gib.value,
                 "bandwidth_gbps": d.bandwidth_gbps.value, "tflops": {k: v.value for k, v in d.flops.items()},
                 "tdp_w": d.tdp_w.value, "rent_usd_per_hour": d.rent_usd_per_hour.value if d.rent_usd_per_hour
                 else None, "description": d.description}
                for d in sorted({id(d): d for d in catalog.devices.values()}.values(), key=lambda d: d.name)]
    else:
        rows = [{"name": m.name, "source": m.source, "date": m.date, **m.fields}
                for m in sorted({id(m): m for m in catalog.models.values()}.values(), key=lambda m: m.name)]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        if devices:
            print(f"{r['name']:<18} {r['kind']:<4} {r['memory_gib']:>6g} GiB {r['bandwidth_gbps']:>7g} GB/s  "
                  f"{r['description']}")
        else:
            print(f"{r['name']:<16} {r['num_layers']:>3} layers  hidden {r['hidden_size']:>5}  heads "
                  f"{r['num_heads']:>3}/{r['num_kv_heads']:<3} context {r['max_position_embeddings']:>7}")


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.machine:
        return _doctor_machine(args)
    if args.url:
        return _doctor_live(args)
    return _doctor_preflight(args)


def _doctor_machine(args: argparse.Namespace) -> int:
    """The engine's own start-up path, in bench/machine.py (the planner builds no engine)."""
    from tokenfactory.bench.machine import print_machine_profile

    return print_machine_profile(args.model, args.quantization, args.dtype, args.threads, args.remeasure, args.json)


def _doctor_live(args: argparse.Namespace) -> int:
    from tokenfactory.planner.live import MetricsUnavailable, diagnose_url

    try:
        findings = diagnose_url(args.url, args.interval, args.timeout)
    except MetricsUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _print_findings(findings, args.json)


def _doctor_preflight(args: argparse.Namespace) -> int:
    """The start-up check on a catalog card, from the same memory plan `plan` makes on the same flags."""
    from tokenfactory.planner.catalog import GIB, load_catalog
    from tokenfactory.planner.doctor import preflight
    from tokenfactory.planner.hardware import hardware_from_catalog
    from tokenfactory.planner.modelsrc import load_model
    from tokenfactory.planner.plan import fitted_memory

    catalog = load_catalog(args.catalog)
    model = load_model(_need(args.model, "model", "or --url for a running server"), catalog)
    device = catalog.device(_need(args.device, "--device", f"one of {', '.join(catalog.device_names())}"))
    hw = hardware_from_catalog(catalog, device, args.devices)
    req = request_from(args, model, hw, precision_from(args, model))
    weights, mem, form = fitted_memory(req, hw)
    # Whole-replica figures: per card x cards (exact when the KV heads divide among the cards).
    n = hw.count
    free = int(args.free_memory_gib * GIB) if args.free_memory_gib is not None else mem.usable_bytes * n
    weights_bytes = mem.weights_bytes * n
    kv = _kv_cache_bytes(args, free, weights_bytes)
    findings = preflight(model.config, device=device.name if n == 1 else f"{n} x {device.name}",
                         dtype_bytes=weights.precision.bytes_per_param, max_model_len=args.max_model_len,
                         kv_cache_bytes=kv, free_memory_bytes=free, max_num_seqs=args.max_num_seqs,
                         weights_bytes=weights_bytes, kv_cache_dtype=req.kv_dtype if req.kv_dtype in ("int8", "fp8")
                         else "auto", reserve_bytes=mem.reserve_bytes * n)
    if not args.json:
        print(_doctor_assumptions(args, weights, mem, hw, free, form))
    return _print_findings(findings, args.json)


def _kv_cache_bytes(args: argparse.Namespace, free: int, weights_bytes: int) -> int | None:
    """--kv-cache-memory as serve reads it (bytes, or a share of what the weights leave), or --kv-cache-gib."""
    from tokenfactory.planner.catalog import GIB

    if args.kv_cache_memory is not None and args.kv_cache_gib is not None:
        raise ValueError("--kv-cache-memory and --kv-cache-gib were both given: keep one")
    if args.kv_cache_gib is not None:
        return int(args.kv_cache_gib * GIB)
    if isinstance(args.kv_cache_memory, float):
        return int(max(0, free - weights_bytes) * args.kv_cache_memory)
    return args.kv_cache_memory


def _doctor_assumptions(args: argparse.Namespace, weights: Any, mem: Any, hw: Any, free: int, form: str | None) -> str:
    """The figures the verdict below is computed from, defaults included, so none is hidden."""
    from tokenfactory.planner.units import count, gib, pct

    source = ("--free-memory-gib" if args.free_memory_gib is not None else
              f"{pct(hw.memory_utilization)} of {gib(mem.device_bytes)} per card")
    max_len = (count(args.max_model_len) if args.max_model_len is not None
               else "not given: the model's context, capped at what the KV cache holds (the engine's rule)")
    lines = [f"CHECK   {hw.count} x {hw.device.name}: {gib(free)} for the server ({source}), weights "
             f"{weights.label} {gib(mem.weights_bytes * hw.count)}, runtime reserve {gib(mem.reserve_bytes * hw.count)}"
             f"; max_num_seqs {args.max_num_seqs}, max_model_len {max_len}"]
    if form:
        lines.append(f"{'':8}{form}")
    return "\n".join(lines)


def _print_findings(findings: Sequence[Any], as_json: bool) -> int:
    """Each finding, its evidence as a person reads it (sizes in GiB), then the verdict, which the exit code
    repeats: 1 if the first error ended the checks, else 0."""
    from tokenfactory.planner.units import evidence

    errors = [f for f in findings if f.severity == "error"]
    if as_json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
        return 1 if errors else 0
    for f in findings:
        print(f"{f.severity.upper():<8}{f.message}")
        shown = ", ".join(evidence(k, v) for k, v in f.evidence.items())
        if shown:
            print(f"{'':8}evidence: {shown}")
    warnings = sum(f.severity == "warning" for f in findings)
    if errors:
        print("VERDICT will not start: fix the error above (the checks after it were not run)")
    elif any(f.message.startswith("Fits") for f in findings):
        print("VERDICT fits" + (f", with {warnings} warning(s) above" if warnings else ""))
    return 1 if errors else 0
