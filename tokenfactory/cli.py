"""The `tokenfactory` command. Each subsystem registers its own subcommands from a light module
(heavy imports such as torch happen inside the command's function, not at registration)."""

from __future__ import annotations

import argparse
import importlib
import sys

from tokenfactory.types import MissingExtra

# Subcommand modules, each exposing `register(subparsers: argparse._SubParsersAction) -> None`.
COMMAND_MODULES: tuple[str, ...] = (
    "tokenfactory.serve.cli",  # serve
    "tokenfactory.meter.cli",  # usage
    "tokenfactory.planner.cli",  # plan, doctor
    "tokenfactory.planner.tokens_cli",  # tokens
    "tokenfactory.bench.cli",  # bench offline | serve | sweep | compare | report
    "tokenfactory.tenants.cli",  # tenants add|list|update|remove, keys create|list|revoke
    "tokenfactory.quality.cli",  # quantize, eval
    "tokenfactory.serve.batch_run",  # batch run
    "tokenfactory.fleet.cli",  # simulate, fleet status
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenfactory", description="From every watt to every token.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, MissingExtra) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
