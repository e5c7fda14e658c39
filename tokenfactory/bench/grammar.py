"""`python -m tokenfactory.bench.grammar`: what structured outputs cost and save, JSON out.

    python -m tokenfactory.bench.grammar libraries   xgrammar vs llguidance on our vocabulary (grammar_libs.py)
    python -m tokenfactory.bench.grammar offline     the engine with and without a schema, forced tokens,
                                                     compile times (grammar_engine.py)
    python -m tokenfactory.bench.grammar served      the server at 1/8/32 clients with and without a schema
                                                     (grammar_served.py; starts one unless --url)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    from tokenfactory.meter.modelled import cpu_model_name

    return {"cpu_model": cpu_model_name(), "num_cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "loadavg_1m_at_start": os.getloadavg()[0]}


def run_libraries(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tokenfactory.bench import grammar_libs
    from tokenfactory.models.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    out: dict[str, Any] = {"bench": "grammar-libraries", "machine": machine(), "threads": args.threads,
                           "vocab_size": loaded.config.vocab_size, "num_steps": args.steps, "libraries": {}}
    names = args.libraries.split(",")
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    # Rounds alternate the libraries' order, and every figure is the median over rounds: on a shared machine
    # the load drifts, and it should drift over both alike.
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if out["libraries"].get(name, {}).get("error"):
                continue
            try:
                rounds[name].append(grammar_libs.measure_library(
                    name, loaded.tokenizer, loaded.config.vocab_size, num_threads=args.threads,
                    num_steps=args.steps, repeats=args.repeats, seed=args.seed))
            except ImportError as e:
                out["libraries"][name] = {"library": name, "error": f"not installed: {e}"}
    for name in names:
        if out["libraries"].get(name, {}).get("error"):
            continue
        out["libraries"][name] = {**grammar_libs.median_of(rounds[name]), "num_rounds": len(rounds[name])}
        out["libraries"][name]["memory"] = {
            schema: grammar_libs.in_child(name, "memory", 120.0, schema=schema, seed=args.seed,
                                          count=args.memory_matchers, num_threads=args.threads)
            for schema in ("order", "tools20")}
        out["libraries"][name]["pathological"] = {
            f"nested_any_of_{d}x{w}": grammar_libs.in_child(name, "pathological", args.pathological_limit_s,
                                                            depth=d, width=w, num_threads=args.threads)
            for d, w in ((3, 5), (4, 6))}
    out["apply_mask"] = grammar_libs.apply_mask_cost(loaded.config.vocab_size)
    out["loadavg_1m_at_end"] = os.getloadavg()[0]
    return out


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tokenfactory.bench import grammar_engine

    if args.threads:
        torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"bench": "grammar-offline", "machine": machine(), "threads": torch.get_num_threads(),
                           "model": args.model or "bundled SmolLM2-135M-Instruct", "rounds": args.rounds,
                           "max_tokens": args.max_tokens, "temperature": args.temperature}
    out["compile"] = grammar_engine.compile_times(args)
    out["forced_tokens"] = grammar_engine.forced_savings(args)
    out["throughput"] = grammar_engine.throughput(args)
    out["loadavg_1m_at_end"] = os.getloadavg()[0]
    return out


def run_served(args: argparse.Namespace) -> dict[str, Any]:
    from tokenfactory.bench import grammar_served

    out: dict[str, Any] = {"bench": "grammar-served", "machine": machine(), "rounds": args.rounds,
                           "requests_per_level": args.requests, "max_tokens": args.max_tokens,
                           "temperature": args.temperature}
    out.update(grammar_served.run(args))
    out["loadavg_1m_at_end"] = os.getloadavg()[0]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tokenfactory.bench.grammar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    lib = sub.add_parser("libraries", help="xgrammar vs llguidance: compile, mask per step, memory")
    lib.add_argument("--model", default=None)
    lib.add_argument("--libraries", default="xgrammar,llguidance")
    lib.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the libraries' worker threads")
    lib.add_argument("--steps", type=int, default=300, help="decode steps timed per batch size")
    lib.add_argument("--repeats", type=int, default=5, help="cold compiles per schema")
    lib.add_argument("--memory-matchers", type=int, default=1000)
    lib.add_argument("--pathological-limit-s", type=float, default=30.0)
    lib.add_argument("--rounds", type=int, default=3, help="measurements per library, interleaved; medians kept")
    lib.add_argument("--seed", type=int, default=0)
    lib.add_argument("--out", default="results/bench-grammar-libraries.json")
    off = sub.add_parser("offline", help="the engine with and without a schema; forced tokens; compile times")
    off.add_argument("--model", default=None)
    off.add_argument("--clients", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8, 32])
    off.add_argument("--rounds", type=int, default=3)
    off.add_argument("--max-tokens", type=int, default=256)
    off.add_argument("--temperature", type=float, default=0.7)
    off.add_argument("--compile-repeats", type=int, default=10)
    off.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    off.add_argument("--machine-profile", default="auto")
    off.add_argument("--out", default="results/bench-grammar-offline.json")
    srv = sub.add_parser("served", help="the server at 1/8/32 clients with and without a schema")
    srv.add_argument("--url", default=None, help="a running server (default: start one here)")
    srv.add_argument("--server-args", default="--power-source auto --max-num-seqs 32",
                     help="flags for the server started here")
    srv.add_argument("--served-model", default=None, help="the `model` to send (default: the server's default)")
    srv.add_argument("--clients", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8, 32])
    srv.add_argument("--requests", type=int, default=32, help="requests per level, split over its clients")
    srv.add_argument("--rounds", type=int, default=2)
    srv.add_argument("--max-tokens", type=int, default=256)
    srv.add_argument("--temperature", type=float, default=0.7)
    srv.add_argument("--out", default="results/bench-grammar-served.json")
    args = p.parse_args(argv)
    started = time.time()
    result = {"libraries": run_libraries, "offline": run_offline, "served": run_served}[args.part](args)
    result["wall_s"] = time.time() - started
    text = json.dumps(result, indent=2)
    if args.out == "-":
        sys.stdout.write(text + "\n")
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
