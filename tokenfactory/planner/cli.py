"""`tokenfactory plan` and `tokenfactory doctor`. Registration is light (argparse only); each command
imports what it needs when it runs."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

PLAN_HELP = "capacity, speed, cost and energy of a model on a card, before you rent or buy"
DOCTOR_HELP = ("pre-flight (will it fit?), with --url why a running server is slow, or with --machine the kernel "
               "crossovers and thread policy the engine measured on this machine")


def register(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser("plan", help=PLAN_HELP, description=PLAN_HELP)
    _add_model_args(plan)
    _add_plan_args(plan)
    plan.set_defaults(func=cmd_plan)
    doctor = subparsers.add_parser("doctor", help=DOCTOR_HELP, description=DOCTOR_HELP)
    _add_model_args(doctor)
    live = doctor.add_argument_group("live diagnosis")
    live.add_argument("--url", help="a running tokenfactory server, e.g. http://127.0.0.1:8000")
    live.add_argument("--interval", type=float, default=5.0,
                      help="seconds between the two metric reads (0: read once, totals only)")
    live.add_argument("--timeout", type=float, default=5.0, help="HTTP timeout per read, seconds")
    doctor.add_argument("--max-num-seqs", type=int, default=64, help="the server's max_num_seqs")
    doctor.add_argument("--free-memory-gib", type=float,
                        help="free device memory (default: the card's memory x the engine's share)")
    doctor.add_argument("--kv-cache-gib", type=float, help="KV cache size the server will allocate")
    machine = doctor.add_argument_group("machine profile")
    machine.add_argument("--machine", action="store_true",
                         help="print this machine's profile for MODEL (a GGUF file or HF folder; default the bundled "
                              "model): cached, or measured now as the engine's first start would")
    machine.add_argument("--remeasure", action="store_true", help="with --machine: measure again and cache it")
    machine.add_argument("--quantization", default="auto", help="with --machine: the engine's weight scheme")
    machine.add_argument("--dtype", default="auto", help="with --machine: the engine's dtype")
    machine.add_argument("--threads", type=int, help="with --machine: CPU threads (default: PyTorch's)")
    doctor.set_defaults(func=cmd_doctor)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="catalog name, config.json (or its folder), or a .gguf file")
    p.add_argument("--device", help="catalog device, e.g. H100-SXM, A100-80GB, RTX-4090, CPU-Xeon-8480-2S")
    p.add_argument("--devices", type=int, help="cards per replica (tensor parallel); default 1")
    p.add_argument("--precision", help="weights: bf16, fp16, fp8, int8, int4, int4-g32, fp32, gguf (as stored)")
    p.add_argument("--kv-dtype", default="auto", help="KV cache: auto (activation dtype), bf16, fp16, int8, fp8, fp32")
    p.add_argument("--max-model-len", type=int, help="default: the model's context, capped at 8,192")
    p.add_argument("--catalog", action="append", default=[], metavar="PATH",
                   help="extra catalog file or directory (TOML/JSON; repeatable; later wins)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="reference", choices=["reference", "tokenfactory"],
                   help="whose weight bytes decide what fits: reference (each weight once, in its format) or "
                        "tokenfactory (our engine's int8/int4 accounting, as serve's start-up check counts it)")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent sequences (max_num_seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (activations)")
    p.add_argument("--prompt-tokens", type=float, default=512, help="mean prompt length")
    p.add_argument("--output-tokens", type=float, default=256, help="mean output length")
    p.add_argument("--batch-sizes", help="comma-separated batch sizes for the speed table")
    demand = p.add_argument_group("demand and SLOs")
    demand.add_argument("--tokens-per-day", type=float, help="output tokens to produce per day")
    demand.add_argument("--window-hours", type=float, default=24.0, help="hours a day the demand arrives in")
    demand.add_argument("--tokens-per-second", type=float, help="measured tokens/s per replica (skips the model)")
    demand.add_argument("--ttft-slo", type=float, help="time to first token target, seconds")
    demand.add_argument("--tpot-slo", type=float, help="time per output token target, seconds")
    prices = p.add_argument_group("prices (defaults from the catalog)")
    prices.add_argument("--electricity-usd-per-kwh", type=float)
    prices.add_argument("--pue", type=float, help="power usage effectiveness of the data centre")
    prices.add_argument("--rent-usd-per-hour", type=float, help="per card")
    prices.add_argument("--purchase-usd", type=float, help="per card")
    prices.add_argument("--lifetime-years", type=float)
    prices.add_argument("--utilisation", type=float, help="share of hours the fleet is busy, (0, 1]")
    out = p.add_argument_group("calibration and output")
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
    hw = hardware_from_catalog(catalog, device, args.devices or (bench.num_devices if bench else 1))
    precision = args.precision or (bench.dtype if bench else None)
    calibration = None
    if bench is not None:
        weights = resolve_weights(model, precision)
        kv = parse_kv_dtype(args.kv_dtype if args.kv_dtype != "auto" else bench.kv_dtype, weights.precision)
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
    steps = StepModel(req.hardware, req.model, plan.weights, plan.kv_dtype_bytes)
    kv_seqs = plan.memory.max_seqs(req.workload.prompt_tokens + req.workload.output_tokens)
    if args.profile not in (None, "auto"):
        return make_profile(args.profile, steps, req.workload, kv_seqs, "as asked")
    demand = args.tokens_per_day / (args.window_hours * 3600) if args.tokens_per_day is not None else None
    return choose_profile(steps, req.workload, kv_seqs, args.tpot_slo, demand)


def _make_plan(args: argparse.Namespace, catalog: Any, model: Any, hw: Any, precision: str | None) -> Any:
    from tokenfactory.planner.cost import Prices
    from tokenfactory.planner.perf import Workload
    from tokenfactory.planner.plan import SLO, Demand, PlanRequest, make_plan

    def price(flag: str, key: str) -> float:
        value = getattr(args, flag)
        return value if value is not None else catalog.default("prices", key).value

    dev = hw.device
    prices = Prices(
        electricity_usd_per_kwh=price("electricity_usd_per_kwh", "electricity_usd_per_kwh"),
        pue=price("pue", "pue"), lifetime_years=price("lifetime_years", "lifetime_years"),
        utilisation=price("utilisation", "utilisation"),
        rent_usd_per_hour=args.rent_usd_per_hour if args.rent_usd_per_hour is not None else
        (dev.rent_usd_per_hour.value if dev.rent_usd_per_hour else None),
        purchase_usd=args.purchase_usd if args.purchase_usd is not None else
        (dev.price_usd.value if dev.price_usd else None))
    batch_sizes = None
    if args.batch_sizes:
        try:
            batch_sizes = tuple(int(b) for b in args.batch_sizes.split(",") if b.strip())
        except ValueError:
            raise ValueError(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}") from None
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError("--batch-sizes must list integers >= 1")
    request = PlanRequest(
        model=model, hardware=hw, prices=prices, precision=precision, kv_dtype=args.kv_dtype,
        max_model_len=args.max_model_len, concurrency=args.concurrency,
        max_num_batched_tokens=args.max_num_batched_tokens,
        workload=Workload(args.prompt_tokens, args.output_tokens),
        demand=Demand(args.tokens_per_day, args.window_hours) if args.tokens_per_day is not None else None,
        slo=SLO(args.ttft_slo, args.tpot_slo), tokens_per_second=args.tokens_per_second,
        batch_sizes=batch_sizes, engine=args.engine)
    return make_plan(request, catalog)


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
    """The engine's own start-up path (load, place, profile), so what it prints is what `serve` would use."""
    import torch

    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.engine import LLMEngine

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization, dtype=args.dtype,
                                    kv_cache_memory=16 << 20,
                                    max_model_len=256, machine_profile="remeasure" if args.remeasure else "auto"))
    profile = engine.machine_profile
    if profile is None:
        print(f"no machine profile: the engine runs on {engine.device}, which keeps its built-in constants")
        return 0
    print(json.dumps(profile.to_json(), indent=2) if args.json else "\n".join(profile.describe()))
    return 0


def _doctor_live(args: argparse.Namespace) -> int:
    from tokenfactory.planner.live import MetricsUnavailable, diagnose_url

    try:
        findings = diagnose_url(args.url, args.interval, args.timeout)
    except MetricsUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _print_findings(findings, args.json)


def _doctor_preflight(args: argparse.Namespace) -> int:
    from tokenfactory.planner.catalog import GIB, load_catalog
    from tokenfactory.planner.doctor import preflight
    from tokenfactory.planner.hardware import hardware_from_catalog
    from tokenfactory.planner.memory import resolve_weights
    from tokenfactory.planner.modelsrc import load_model

    catalog = load_catalog(args.catalog)
    model = load_model(_need(args.model, "model", "or --url for a running server"), catalog)
    device = catalog.device(_need(args.device, "--device", f"one of {', '.join(catalog.device_names())}"))
    hw = hardware_from_catalog(catalog, device, args.devices or 1)
    weights = resolve_weights(model, args.precision)
    free = (int(args.free_memory_gib * GIB) if args.free_memory_gib is not None
            else int(device.memory_bytes * hw.memory_utilization) * hw.count)
    max_len = args.max_model_len or model.config.max_position_embeddings
    findings = preflight(model.config, device=device.name, dtype_bytes=weights.precision.bytes_per_param,
                         max_model_len=max_len,
                         kv_cache_bytes=int(args.kv_cache_gib * GIB) if args.kv_cache_gib is not None else None,
                         free_memory_bytes=free, max_num_seqs=args.max_num_seqs,
                         weights_bytes=int(weights.total_bytes),
                         kv_cache_dtype=args.kv_dtype if args.kv_dtype in ("int8", "fp8") else "auto")
    return _print_findings(findings, args.json)


def _print_findings(findings: Sequence[Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        for f in findings:
            print(f"{f.severity.upper():<8}{f.message}")
            evidence = ", ".join(f"{k}={v:,.4g}" for k, v in f.evidence.items())
            if evidence:
                print(f"{'':8}evidence: {evidence}")
    return 1 if any(f.severity == "error" for f in findings) else 0
