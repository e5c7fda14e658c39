"""`tokenfactory bench sweep`: the same workload at several loads, one run each, saved together.

    tokenfactory bench sweep --base-url http://127.0.0.1:8000 --concurrency 1,4,16,64 --save tf-sweep
    tokenfactory bench sweep ... --request-rate 0.5,1,2,4          # open loop instead
    tokenfactory bench report tf-sweep --out report/                # throughput vs concurrency, ...

Each level draws its prompts with seed + level index: the same lengths and distribution, but not the
same text, so a server's prefix cache gets no head start from the level before.
"""

from __future__ import annotations

import argparse
from typing import Any

from tokenfactory.bench.serve import (
    add_load_arguments,
    add_measure_arguments,
    add_output_arguments,
    add_target_arguments,
    add_workload_arguments,
)
from tokenfactory.types import ParameterError


def parse_levels(text: str, kind: type, flag: str) -> list[Any]:
    """'1,4,16' -> [1, 4, 16]; each level must be > 0."""
    try:
        levels = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ParameterError(flag.strip("-").replace("-", "_"),
                             f"{flag} must be a comma-separated list of numbers, got {text!r}") from None
    if not levels or any(level <= 0 for level in levels):
        raise ParameterError(flag.strip("-").replace("-", "_"), f"{flag} levels must be > 0, got {text!r}")
    return levels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    add_workload_arguments(parser)
    levels = parser.add_argument_group("levels")
    levels.add_argument("--concurrency", default=None,
                        help="closed-loop levels, e.g. 1,4,16,64 (default 1,4,16; with --request-rate: one cap)")
    levels.add_argument("--request-rate", default=None, help="open-loop levels in req/s, e.g. 0.5,1,2")
    add_load_arguments(parser, sweep=True)
    add_measure_arguments(parser)
    add_output_arguments(parser)


def levels_from_args(args: argparse.Namespace) -> list[tuple[int | None, float | None]]:
    """(concurrency, request_rate) per level."""
    if args.request_rate:
        cap = None
        if args.concurrency:
            caps = parse_levels(args.concurrency, int, "--concurrency")
            if len(caps) != 1:
                raise ParameterError("concurrency", "with --request-rate levels, --concurrency is one cap, not a list")
            cap = caps[0]
        return [(cap, rate) for rate in parse_levels(args.request_rate, float, "--request-rate")]
    return [(c, None) for c in parse_levels(args.concurrency or "1,4,16", int, "--concurrency")]


def run_levels(args: argparse.Namespace, base_url: str, label: str | None, tokenizer: Any,
               levels: list[tuple[int | None, float | None]], model: str | None = None) -> list[Any]:
    """One run per level against one target; stops after a level that could not send at all."""
    from rich.console import Console

    from tokenfactory.bench.serve import bench_spec, run_one

    console, runs = Console(stderr=True), []
    for i, (concurrency, rate) in enumerate(levels):
        spec = bench_spec(args, base_url, label, concurrency, rate, seed=args.seed + i, model=model)
        console.print(f"[bold]{label or base_url}[/]: {spec.load.describe}")
        run = run_one(args, spec, tokenizer)
        run.name = f"{args.save or 'sweep'}-{i}"
        runs.append(run)
        if run.status == "aborted" and run.figures.get("completed", 0) == 0:
            console.print(f"[red]stopping the sweep: {'; '.join(run.reasons)}[/]")
            break
    return runs


def summary_table(runs: list[Any], title: str) -> Any:
    from rich.table import Table

    from tokenfactory.bench.figures import display_value

    columns = [("concurrency", "in flight"), ("request_rate", "req/s asked"), ("request_throughput", "req/s"),
               ("output_throughput", "out tok/s"), ("median_ttft_ms", "median TTFT ms"),
               ("median_tpot_ms", "median TPOT ms"), ("p99_e2el_ms", "p99 E2E ms"),
               ("joules_per_output_token", "J/tok"), ("failed", "failed")]
    table = Table(title=title)
    table.add_column("target")
    for _, header in columns:
        table.add_column(header, justify="right")
    table.add_column("status")
    for run in runs:
        values = {**run.figures, "request_rate": run.config.get("load", {}).get("request_rate")}
        table.add_row(run.label, *[display_value(k, values.get(k)) for k, _ in columns], run.status)
    return table


def main(args: argparse.Namespace) -> int:
    from tokenfactory.bench.datasets import load_tokenizer
    from tokenfactory.bench.results import check_name, load_runs
    from tokenfactory.bench.serve import finish, make_console

    if args.save:
        check_name(args.save)
    levels = levels_from_args(args)
    baseline = load_runs(args.compare, args.results_dir) if args.compare else None
    tokenizer = load_tokenizer(args.tokenizer)
    runs = run_levels(args, args.base_url, args.label, tokenizer, levels)
    console = make_console()
    code = finish(args, runs, None, kind="sweep", detail=False)  # status of each run; saves them as one set
    console.print(summary_table(runs, "sweep"))
    if baseline:
        print_sweep_comparison(console, baseline, runs)
    return code


def print_sweep_comparison(console: Any, baseline: list[Any], runs: list[Any], by_label: bool = False) -> None:
    """Each run against the baseline run with the same concurrency and rate (and label, for compare)."""
    from tokenfactory.bench.serve import print_comparison

    def key(run: Any) -> tuple[Any, ...]:
        load = run.config.get("load", {})
        return (load.get("concurrency"), load.get("request_rate")) + ((run.label,) if by_label else ())

    by_key = {key(b): b for b in baseline}
    for run in runs:
        match = by_key.get(key(run))
        if match is None:
            console.print(f"[yellow]no run in the baseline matches {run.label} at {key(run)[:2]}[/]")
            continue
        print_comparison(console, match, run)
