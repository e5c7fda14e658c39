"""`python -m tokenfactory.bench.grammar`: what structured outputs cost and save, JSON out.

    python -m tokenfactory.bench.grammar libraries   xgrammar vs llguidance on our vocabulary (grammar_libs.py)
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
    for name in args.libraries.split(","):
        try:
            out["libraries"][name] = grammar_libs.measure_library(
                name, loaded.tokenizer, loaded.config.vocab_size, num_threads=args.threads, num_steps=args.steps,
                repeats=args.repeats, num_memory=args.memory_matchers, seed=args.seed)
        except ImportError as e:
            out["libraries"][name] = {"library": name, "error": f"not installed: {e}"}
            continue
        out["libraries"][name]["pathological"] = {
            f"nested_any_of_{d}x{w}": grammar_libs.in_child(name, "pathological", args.pathological_limit_s,
                                                            depth=d, width=w, num_threads=args.threads)
            for d, w in ((3, 5), (4, 6))}
    out["apply_mask"] = grammar_libs.apply_mask_cost(loaded.config.vocab_size)
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
    lib.add_argument("--seed", type=int, default=0)
    lib.add_argument("--out", default="results/bench-grammar-libraries.json")
    args = p.parse_args(argv)
    started = time.time()
    result = {"libraries": run_libraries}[args.part](args)
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
