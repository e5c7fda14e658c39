"""`tokenfactory simulate` (a fleet serving a trace, policies and fleets side by side) and `tokenfactory fleet
status` (a running server's replicas and autoscaler). Registration imports nothing heavy."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

SIM_HELP = "simulate a fleet serving a trace: latency, goodput, replicas over time, J and $ per Mtok"
STATUS_HELP = "a running server's replicas, routing and autoscaler decisions"


def register(subparsers: argparse._SubParsersAction) -> None:
    from tokenfactory.levers import HelpFormatter

    p = subparsers.add_parser("simulate", help=SIM_HELP, description=SIM_HELP, formatter_class=HelpFormatter)
    _add_trace_args(p)
    _add_fleet_args(p)
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON (summaries and timelines)")
    out.add_argument("--plot", metavar="PNG", help="write replicas, arrivals and TTFT p99 over time to PNG")
    out.add_argument("--decisions", action="store_true", help="print each run's scaling decisions")
    p.set_defaults(func=cmd_simulate)
    fleet = subparsers.add_parser("fleet", help=STATUS_HELP, description=STATUS_HELP)
    sub = fleet.add_subparsers(dest="fleet_command", metavar="COMMAND", required=True)
    status = sub.add_parser("status", help=STATUS_HELP, description=STATUS_HELP)
    status.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    status.add_argument("--api-key", default=None,
                        help="an admin key, when the server runs with --auth (default: $TOKENFACTORY_API_KEY, which "
                             "keeps it out of `ps`)")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_fleet_status)


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    from tokenfactory.levers import OUTPUT_TOKENS, PROMPT_TOKENS, add_lever

    g = p.add_argument_group("trace")
    g.add_argument("--trace", default="poisson",
                   help="poisson, bursty (gamma, --cv), diurnal (--peak-rate/--trough-rate over --period), or a "
                        "file: a ledger database (.db) or JSON lines of arrival_s, prompt_tokens, output_tokens")
    g.add_argument("--rate", type=float, default=5.0, help="requests/s (poisson, bursty)")
    g.add_argument("--cv", type=float, default=3.0, help="bursty: coefficient of variation of the gaps")
    g.add_argument("--peak-rate", type=float, default=20.0, help="diurnal: requests/s at the peak")
    g.add_argument("--trough-rate", type=float, default=2.0, help="diurnal: requests/s at the trough")
    g.add_argument("--period", type=float, default=86_400.0, help="diurnal: seconds per cycle (a day)")
    g.add_argument("--duration", type=float, help="seconds of trace (default: 600; a period for diurnal)")
    add_lever(g, "prompt_tokens", type=float, default=PROMPT_TOKENS)
    add_lever(g, "output_tokens", type=float, default=OUTPUT_TOKENS)
    g.add_argument("--spread", action="store_true", help="exponential lengths around the means (default: fixed)")
    g.add_argument("--seed", type=int, default=0, help="random seed of the trace (the same seed, the same trace)")


def _add_fleet_args(p: argparse.ArgumentParser) -> None:
    from tokenfactory.levers import add_lever, engine_default
    from tokenfactory.meter.prices import shared_defaults

    g = p.add_argument_group("fleet and policies (comma lists run side by side)")
    g.add_argument("--model", default="Llama-3.1-8B", help="a catalog model, config.json or .gguf")
    g.add_argument("--device", default="H100-SXM",
                   help="catalog device(s); with --autoscaler energy, all are options to start")
    g.add_argument("--devices", type=int, default=1, help="cards per replica (tensor parallel)")
    add_lever(g, "quantization", default=engine_default("quantization"),
              extra="the planner's formats too (bf16, fp8, int8, int4-g32, ...); auto: the model's own")
    g.add_argument("--calibrate", metavar="RESULT.json", help="fit the step model to a bench result first")
    g.add_argument("--replicas", default="1",
                   help="N, a list (4,8,16) or a range A..B (doubling); with an autoscaler: its --min..--max")
    g.add_argument("--max-replicas", type=int, help="autoscaler ceiling (default: the range's top, or 64)")
    g.add_argument("--router", default="least-work", help="least-work, prefix, energy (comma list)")
    g.add_argument("--autoscaler", default="none", help="none (a static fleet), slo, energy (comma list)")
    add_lever(g, "max_num_seqs", type=int, default=engine_default("max_num_seqs"))
    add_lever(g, "max_num_batched_tokens", type=int, default=engine_default("max_num_batched_tokens"))
    from tokenfactory.fleet.autoscaler import AutoscalerConfig

    scaling = AutoscalerConfig()  # serve --autoscaler's defaults: one definition (#30)
    g.add_argument("--ttft-slo", type=float, default=scaling.slo.ttft_s, help="TTFT target at p99, seconds")
    g.add_argument("--tpot-slo", type=float, default=scaling.slo.tpot_s, help="TPOT target at p99, seconds")
    g.add_argument("--scale-up-delay", type=float, default=scaling.up_delay_s,
                   help="seconds a need for more replicas must last before one starts (no flapping on bursts)")
    g.add_argument("--scale-down-delay", type=float, default=scaling.down_delay_s,
                   help="seconds a replica must be surplus before it is drained (longer: fewer cold starts)")
    g.add_argument("--cold-start", type=float, default=60.0, help="seconds from start to serving (charged)")
    g.add_argument("--autoscale-interval", "--tick", type=float, default=scaling.interval_s, dest="tick",
                   help="seconds between the autoscaler's ticks (--tick: the older name of --autoscale-interval)")
    g.add_argument("--sample", type=float, default=60.0, help="seconds between timeline samples")
    money = shared_defaults()  # meter/prices.toml: the one source of these defaults
    m = p.add_argument_group("money (defaults: tokenfactory/meter/prices.toml; rent: each card's profile there)")
    add_lever(m, "currency", default="USD", type=str.upper)
    add_lever(m, "currency_per_usd", type=float)
    add_lever(m, "electricity_per_kwh", type=float, aliases=False,
              extra=f"here the power bill the fleet would pay if owned (its rent includes power); default: "
                    f"{money.usd_per_kwh:g} US$/kWh")
    m.add_argument("--electricity-usd-per-kwh", "--usd-per-kwh", type=float, dest="electricity_per_kwh_usd",
                   help="the same in US$ (older names of --electricity-per-kwh)")
    add_lever(m, "pue", type=float, default=money.pue)
    add_lever(m, "psu_efficiency", type=float, default=money.psu_efficiency)


def replica_counts(text: str) -> list[int]:
    """`8`, `4,8,16` or `4..32` (doubling from 4 up to and including 32)."""
    try:
        if ".." in text:
            lo, hi = (int(x) for x in text.split("..", 1))
            if lo < 0 or hi < max(lo, 1):
                raise ValueError
            counts, n = [], max(lo, 1)
            while n < hi:
                counts.append(n)
                n *= 2
            return ([0] if lo == 0 else []) + counts + [hi]
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--replicas must be N, a list like 4,8,16 or a range like 4..32, got {text!r}") from None
    if not counts or min(counts) < 0:
        raise ValueError(f"--replicas must be >= 0, got {text!r}")
    return counts


def build_trace(args: argparse.Namespace) -> list[Any]:
    from tokenfactory.fleet import traces

    kind = args.trace
    duration = args.duration
    common = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "seed": args.seed,
              "spread": args.spread}
    if kind == "poisson":
        return traces.poisson(args.rate, duration or 600.0, **common)
    if kind == "bursty":
        return traces.poisson(args.rate, duration or 600.0, cv=args.cv, **common)
    if kind == "diurnal":
        return traces.diurnal(args.peak_rate, args.trough_rate, duration or args.period, period_s=args.period,
                              t_low_s=args.period / 6, **common)
    return traces.replay(kind)


def runs(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(label, SimConfig) for every combination of router x autoscaler x fleet size."""
    from tokenfactory.fleet.autoscaler import SLO, AutoscalerConfig
    from tokenfactory.fleet.sim_model import planner_spec
    from tokenfactory.fleet.simulator import SimConfig

    specs = [planner_spec(args.model, device.strip(), devices=args.devices, precision=_precision(args.quantization),
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                          tpot_slo_s=args.tpot_slo, cold_start_s=args.cold_start, calibrate=args.calibrate)
             for device in args.device.split(",")]
    counts = replica_counts(args.replicas)
    usd_per_kwh = usd_per_kwh_from(args)
    out = []
    for router, scaler in itertools.product(args.router.split(","), args.autoscaler.split(",")):
        scaler = None if scaler in ("none", "static") else scaler
        sizes = [counts] if scaler else [[n] for n in counts]
        for size in sizes:
            lo, hi = min(size), args.max_replicas or (max(size) if len(size) > 1 else 64)
            scaling = AutoscalerConfig(min(lo, hi), hi, SLO(args.ttft_slo, args.tpot_slo),
                                       up_delay_s=args.scale_up_delay, down_delay_s=args.scale_down_delay,
                                       interval_s=args.tick)
            label = f"{router} / {scaler or 'static'} / " + (f"{lo}..{hi}" if scaler else f"{lo}")
            out.append((label, SimConfig(specs, lo, router, False, scaler, scaling, args.tick, args.sample,
                                         usd_per_kwh, args.pue, args.psu_efficiency)))
    return out


def _precision(quantization: str | None) -> str | None:
    return None if quantization in (None, "auto", "none") else quantization


def usd_per_kwh_from(args: argparse.Namespace) -> float:
    """The simulator counts in US$: --electricity-per-kwh (in --currency) converted, or its US$ spelling, or the
    prices file's."""
    from tokenfactory.meter.prices import shared_defaults
    from tokenfactory.planner.cost import currency_for

    given, usd = getattr(args, "electricity_per_kwh", None), getattr(args, "electricity_per_kwh_usd", None)
    if given is not None and usd is not None:
        raise ValueError("--electricity-per-kwh and its US$ spelling were both given: keep one")
    if given is not None:
        return given / currency_for(args.currency, args.currency_per_usd).per_usd
    return usd if usd is not None else shared_defaults().usd_per_kwh


def cmd_simulate(args: argparse.Namespace) -> int:
    from tokenfactory.fleet.simulator import Simulation
    from tokenfactory.progress import track

    trace = build_trace(args)
    if not trace:
        raise ValueError("the trace has no requests")
    results = []
    planned = runs(args)
    for label, config in track(planned, f"simulating {len(trace):,} requests", total=len(planned)):
        t0 = time.perf_counter()
        result = Simulation(config, trace).run()
        results.append((label, result, time.perf_counter() - t0))
    if args.plot:
        write_plot(results, args.plot)
    if args.json:
        print(json.dumps([{"label": label, "wall_s": wall, **result.summary(),
                           "timeline": [s.__dict__ for s in result.samples], "decisions": list(result.decisions)}
                          for label, result, wall in results], indent=1))
        return 0
    spec = runs_spec_line(args, trace)
    print(spec)
    from tokenfactory.planner.cost import currency_for

    print(render(results, currency_for(args.currency, args.currency_per_usd)))
    if args.decisions:
        for label, result, _ in results:
            print(f"\n{label}:\n" + ("\n".join(result.decisions) or "  (no changes)"))
    if args.plot:
        print(f"\nplot: {args.plot}")
    return 0


def runs_spec_line(args: argparse.Namespace, trace: Sequence[Any]) -> str:
    hours = trace[-1].arrival_s / 3600
    return (f"{len(trace):,} requests over {hours:.2f} h ({args.trace}); {args.model} on {args.devices} x "
            f"{args.device} per replica; SLO TTFT {args.ttft_slo:g} s, TPOT {args.tpot_slo * 1000:.0f} ms at p99; "
            f"energy modelled (planner)")


COLUMNS = ("run", "replicas min/mean/max", "TTFT p50/p99 s", "TPOT p50/p99 ms", "SLO %", "tok/s", "J/tok", "kWh/Mtok",
           "{code}/Mtok (rent)", "idle %", "sim s")


def render(results: Sequence[tuple[str, Any, float]], currency: Any = None) -> str:
    """The runs side by side; money in `currency` (planner/cost.py Currency; US$ when None)."""
    per_usd, code = (currency.per_usd, currency.code) if currency is not None else (1.0, "USD")
    columns = [c.format(code=code) for c in COLUMNS]
    rows = []
    for label, result, wall in results:
        s = result.summary()

        def f(x: float | None, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
            return "-" if x is None else fmt.format(x * scale)
        rows.append([label, f"{s['replicas_min']}/{s['replicas_mean']:.1f}/{s['replicas_max']}",
                     f"{f(s['ttft_p50_s'])}/{f(s['ttft_p99_s'])}",
                     f"{f(s['tpot_p50_s'], 1000, '{:.1f}')}/{f(s['tpot_p99_s'], 1000, '{:.1f}')}",
                     f(s["slo_attainment"], 100, "{:.1f}"), f(s["output_tokens_per_s"], 1, "{:,.0f}"),
                     f(s["joules_per_token"]), f(s["kwh_per_mtok"]), f(s["usd_per_mtok"], per_usd),
                     f(s["idle_energy_share"], 100, "{:.1f}"), f"{wall:.1f}"])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    return "\n".join([line, *("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows)])


def write_plot(results: Sequence[tuple[str, Any, float]], path: str) -> None:
    from matplotlib.figure import Figure  # imported here: matplotlib is slow to import

    fig = Figure(figsize=(10, 7), dpi=100)
    ax_r, ax_l = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    for label, result, _ in results:
        hours = [s.time_s / 3600 for s in result.samples]
        ax_r.step(hours, [s.replicas for s in result.samples], where="post", label=label)
        ax_l.plot(hours, [s.ttft_p99_s if s.ttft_p99_s is not None else float("nan") for s in result.samples],
                  label=label)
    if results:
        rate = ax_r.twinx()
        first = results[0][1].samples
        rate.plot([s.time_s / 3600 for s in first], [s.arrivals_per_s for s in first], color="grey", alpha=0.4)
        rate.set_ylabel("arrivals / s (grey)")
        ax_l.axhline(results[0][1].config.scaling.slo.ttft_s, color="red", linestyle=":", label="TTFT SLO")
    ax_r.set_ylabel("replicas provisioned")
    ax_r.legend(fontsize=7, loc="upper left")
    ax_l.set_ylabel("TTFT p99 per sample, s")
    ax_l.set_xlabel("hours")
    ax_l.set_yscale("log")
    ax_l.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def cmd_fleet_status(args: argparse.Namespace) -> int:
    import httpx

    key = args.api_key or os.environ.get("TOKENFACTORY_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = args.url.rstrip("/")
    try:
        replicas = httpx.get(url + "/fleet/replicas", headers=headers, timeout=10)
        scaler = httpx.get(url + "/fleet/autoscaler", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        print(f"error: cannot reach {url}: {e}", file=sys.stderr)
        return 2
    if replicas.status_code != 200:
        print(f"error: {url}/fleet/replicas answered {replicas.status_code}: {replicas.text[:300]}", file=sys.stderr)
        return 2
    data = replicas.json()
    auto = scaler.json() if scaler.status_code == 200 else None
    if args.json:
        print(json.dumps({"replicas": data, "autoscaler": auto}, indent=1))
        return 0
    models = data.get("models") or {data.get("model", "?"): {"router": data.get("router", "?")}}
    for model, about in models.items():
        mine = [r for r in data["data"] if r.get("model", model) == model]
        print(f"{model}: {len(mine)} replicas, router {about['router']}")
    for r in data["data"]:
        print(f"  {r['replica_id']:5} {r['kind']:8} {r['state']:9} running {r['num_running']:3} waiting "
              f"{r['num_waiting']:3} KV {100 * r['kv_cache_usage']:5.1f}%  routed {r['num_routed']}")
    if auto is None:
        print("autoscaler: off")
        return 0
    c = auto["config"]
    print(f"autoscaler: {auto['policy']}, {c['min_replicas']}..{c['max_replicas']} replicas; decisions "
          f"{auto['num_by_action']}; stopped {auto['num_stopped']}; starting {auto['starting'] or 'none'}")
    if auto["last"]:
        print(f"  now: {auto['last']['replicas']} replicas: {auto['last']['reason']}")
    for d in auto["recent"]:
        print(f"  {d['action']:4} -> {d['replicas']}: {d['reason']}")
    for s in auto["cold_starts"][-5:]:
        print(f"  cold start {s['replica_id']}: {s['seconds']:.1f} s" + ("" if s["ok"] else f" FAILED {s['error']}"))
    return 0
