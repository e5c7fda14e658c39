"""`tokenfactory bench serve`: load an OpenAI-compatible endpoint and record the four baseline figures
(tokens/s, per-token latency, memory, power), optionally saved and compared with a saved baseline.

    tokenfactory bench serve --base-url http://127.0.0.1:8000 --dataset random --num-prompts 64 \\
        --input-len 256 --output-len 64 --concurrency 8 --slo ttft=500ms,tpot=50ms --save base
    tokenfactory bench serve ... --compare base     # each figure's change, and whether it is better

Exit status: 0 when every request succeeded, 1 when the result is partial or aborted (it is still
printed and saved, marked as such), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DEFAULT_RESULTS_DIR = "results"


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    g.add_argument("--model", default=None, help="model name in requests (default: the first of GET /v1/models)")
    g.add_argument("--label", default=None, help="name of this target in tables and charts (default: the model)")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--dataset", default="random",
                   help="random | shared-prefix | conversation | FILE.jsonl ({\"prompt\"} or {\"messages\"} a line)")
    g.add_argument("--tokenizer", default=None,
                   help="GGUF file or Hugging Face folder whose tokenizer counts the prompts (default: bundled model)")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (chat: of the message content)")
    g.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len·[1-r, 1+r]")
    g.add_argument("--prefix-len", type=int, default=128, help="shared-prefix: tokens of each shared system prompt")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct shared prompts")
    g.add_argument("--num-turns", type=int, default=3, help="conversation: turns per chat")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly --output-len tokens")


def add_load_arguments(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    g = p.add_argument_group("load")
    if not sweep:
        g.add_argument("--concurrency", type=int, default=None,
                       help="closed loop: requests in flight (default 1); with --request-rate: a cap")
        g.add_argument("--request-rate", type=float, default=None, help="open loop: requests per second")
    g.add_argument("--burstiness", type=float, default=1.0, help="open loop: 1 Poisson, <1 burstier, >1 smoother")
    g.add_argument("--warmup", type=int, default=2, help="requests sent one at a time before measuring")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--slo", default=None, help="goodput bounds, e.g. ttft=500ms,tpot=50ms,e2el=10s")


def add_measure_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("memory, power and cost")
    g.add_argument("--server-pid", type=int, default=None,
                   help="the server's process id, for resident and GPU memory (default: found by port on loopback)")
    g.add_argument("--power-source", default="auto",
                   help="local power source for targets that report no energy: auto, nvml, rapl, modelled, "
                        "constant, none")
    g.add_argument("--device-profile", default=None, help="prices.toml device profile for cost (default: cpu)")
    g.add_argument("--sample-interval", type=float, default=1.0, help="seconds between memory/metrics samples")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("results")
    g.add_argument("--results-dir", default=DEFAULT_RESULTS_DIR, help="where --save and --compare look")
    g.add_argument("--save", metavar="NAME", default=None, help="write the full result to RESULTS_DIR/NAME.json")
    g.add_argument("--compare", metavar="NAME", default=None, help="print the change against a saved result")
    g.add_argument("--calibration-out", metavar="FILE", default=None,
                   help="write the shape `tokenfactory plan --calibrate FILE` reads")
    g.add_argument("--device-name", default=None, help="planner catalog device for --calibration-out, e.g. H100-SXM")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    add_workload_arguments(parser)
    add_load_arguments(parser)
    add_measure_arguments(parser)
    add_output_arguments(parser)


def dataset_config(args: argparse.Namespace, num_prompts: int | None = None, seed: int | None = None) -> Any:
    from tokenfactory.bench.datasets import DatasetConfig

    return DatasetConfig(name=args.dataset, endpoint=args.endpoint,
                         num_prompts=args.num_prompts if num_prompts is None else num_prompts,
                         input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                         seed=args.seed if seed is None else seed, prefix_len=args.prefix_len,
                         num_prefixes=args.num_prefixes, num_turns=args.num_turns)


def bench_spec(args: argparse.Namespace, base_url: str, label: str | None, concurrency: int | None,
               request_rate: float | None, seed: int | None = None, model: str | None = None) -> Any:
    """A BenchSpec from the parsed arguments (target, load overridable for sweep and compare)."""
    import os

    from tokenfactory.bench.client import SamplingOptions, Target, normalise_base_url
    from tokenfactory.bench.figures import parse_slo
    from tokenfactory.bench.loadgen import LoadConfig
    from tokenfactory.bench.runner import BenchSpec

    if args.sample_interval <= 0:
        from tokenfactory.types import ParameterError

        raise ParameterError("sample_interval", f"--sample-interval must be > 0, got {args.sample_interval}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
    target = Target(normalise_base_url(base_url), model if model is not None else (args.model or ""),
                    args.endpoint, api_key, label or "")
    load = LoadConfig(concurrency=concurrency if concurrency is not None or request_rate is not None else 1,
                      request_rate=request_rate, burstiness=args.burstiness, warmup=args.warmup,
                      seed=args.seed if seed is None else seed, request_timeout_s=args.request_timeout)
    return BenchSpec(target=target, dataset=dataset_config(args, seed=seed), load=load,
                     sampling=SamplingOptions(temperature=args.temperature, ignore_eos=args.ignore_eos),
                     slo=parse_slo(args.slo), power_source=args.power_source, server_pid=args.server_pid,
                     device_profile=args.device_profile, sample_interval_s=args.sample_interval,
                     progress=not args.no_progress and sys.stdout.isatty(),
                     tokenizer_source=args.tokenizer or "bundled")


WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts differ from measured ones (no prefix-cache head start)


def workload(args: argparse.Namespace, spec: Any, tokenizer: Any) -> tuple[list[Any], list[Any]]:
    """The measured requests and the warm-up requests (same shape, another seed)."""
    from dataclasses import replace

    from tokenfactory.bench.datasets import build_dataset

    requests = build_dataset(spec.dataset, tokenizer)
    warmup = []
    if spec.load.warmup:
        warm_config = replace(spec.dataset, num_prompts=spec.load.warmup, seed=spec.dataset.seed + WARMUP_SEED_OFFSET)
        warmup = build_dataset(warm_config, tokenizer)
    return requests, warmup


def run_one(args: argparse.Namespace, spec: Any, tokenizer: Any) -> Any:
    from tokenfactory.bench.client import run_async
    from tokenfactory.bench.runner import run_bench

    requests, warmup = workload(args, spec, tokenizer)
    return run_async(run_bench(spec, requests, warmup, tokenizer))


def main(args: argparse.Namespace) -> int:
    from tokenfactory.bench.datasets import load_tokenizer
    from tokenfactory.bench.results import check_name, load_runs

    if args.save:
        check_name(args.save)
    baseline = load_runs(args.compare, args.results_dir)[0] if args.compare else None
    spec = bench_spec(args, args.base_url, args.label, args.concurrency, args.request_rate)
    tokenizer = load_tokenizer(args.tokenizer)
    result = run_one(args, spec, tokenizer)
    result.name = args.save or ""
    return finish(args, [result], baseline, kind="serve")


def make_console() -> Any:
    """A rich console; 160 columns when the output is not a terminal (tables stay readable in logs)."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def finish(args: argparse.Namespace, runs: list[Any], baseline: Any, kind: str, detail: bool = True) -> int:
    """Print, save, compare and write calibration for the runs of serve, sweep or compare.
    `detail`: every run's full table, else only its status line and failures."""
    from tokenfactory.bench.results import calibration_document, save_document, save_run, save_set

    console = make_console()
    for run in runs:
        print_result(console, run, detail)
    if args.save:
        path = save_run(runs[0], args.results_dir, args.save) if kind == "serve" else \
            save_set(runs, kind, args.results_dir, args.save)
        console.print(f"saved {path}")
    if baseline is not None:
        print_comparison(console, baseline, runs[-1])
    if getattr(args, "calibration_out", None):
        try:
            document = calibration_document(runs, args.device_name)
        except ValueError as e:
            console.print(f"[yellow]no calibration written: {e}[/]")
        else:
            save_document(document, Path(args.calibration_out))
            console.print(f"calibration for `tokenfactory plan --calibrate` written to {args.calibration_out}")
    return 0 if all(not r.is_partial for r in runs) else 1


def print_result(console: Any, run: Any, detail: bool = True) -> None:
    from rich.markup import escape

    f = run.figures
    title = f"{run.label or 'run'}: {run.config.get('load', {}).get('concurrency')} in flight" \
        if run.config.get("load", {}).get("request_rate") is None else \
        f"{run.label or 'run'}: {run.config['load']['request_rate']:g} req/s"
    if detail:
        print_figures(console, run, title)
        for key, note in (("energy_basis", "power"), ("cost_basis", "cost"), ("memory_source", "memory")):
            if f.get(key):
                source = f" [{f['energy_source']}]" if key == "energy_basis" and f.get("energy_source") else ""
                console.print(escape(f"  {note}{source}: {f[key]}"))
    colour = {"complete": "green", "partial": "yellow", "aborted": "red"}[run.status]
    reasons = f" — {'; '.join(run.reasons)}" if run.reasons else ""
    console.print(f"[{colour}]{escape(run.label)} status: {run.status}[/]{escape(reasons)}")
    for reason, n in list(run.failures.items())[:10]:
        console.print(escape(f"  {n} × {reason}"))


def print_figures(console: Any, run: Any, title: str) -> None:
    from rich.table import Table

    from tokenfactory.bench.figures import FIGURE_SPECS, display_value

    f = run.figures
    table = Table(title=title, show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("unit")
    for name in ("num_requests", "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens"):
        table.add_row(name.replace("_", " "), display_value(name, f.get(name)), "s" if name == "duration_s" else "")
    for name, spec in FIGURE_SPECS.items():
        if name in ("completed", "failed") or f.get(name) is None:
            continue
        table.add_row(spec.label, display_value(name, f.get(name)), spec.unit)
    console.print(table)


def print_comparison(console: Any, baseline: Any, current: Any) -> None:
    from tokenfactory.bench.results import compare_figures, render_changes

    if baseline.is_partial:
        console.print(f"[yellow]note: the baseline {baseline.name!r} is {baseline.status}[/]")
    console.print(render_changes(compare_figures(baseline.figures, current.figures), baseline.name or "baseline"))
