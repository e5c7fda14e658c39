"""`tokenfactory bench ...`: each subcommand lives in its own module, which exposes
`add_arguments(parser)` and `main(args) -> int`; registration imports nothing heavy."""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "offline": ("tokenfactory.bench.offline", "engine throughput and single-stream speed vs Hugging Face"),
    "serve": ("tokenfactory.bench.serve", "load an OpenAI-compatible endpoint and record the four figures"),
    "sweep": ("tokenfactory.bench.sweep", "the same workload at several concurrencies"),
    "compare": ("tokenfactory.bench.compare", "one workload against several servers, one table"),
    "report": ("tokenfactory.bench.report", "charts and an HTML page from saved results"),
    "machine": ("tokenfactory.bench.machine", "this CPU's profile, offline and served figures, other engines beside"),
    "publish": ("tokenfactory.bench.publish", "write the README's and docs/benchmarks.md's figures from JSON"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: offline engine, or any OpenAI-compatible server")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
    bench.set_defaults(func=lambda args: bench.print_help() or 2)
