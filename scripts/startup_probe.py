"""Start-up of `tokenfactory serve` on the bundled model, to `/health` 200 (issue 29 asks for the first and the
cached start). Each round starts every source tree once, alternated, so a drifting host moves them alike; the
median per tree. Writes JSON.

    python scripts/startup_probe.py --rounds 5 --out results/startup.json
    git worktree add /tmp/base a693d3f && python scripts/startup_probe.py --tree base=/tmp/base --tree head=.

A tree is run as `python -m tokenfactory.cli serve` with the tree first on PYTHONPATH (this virtualenv's packages).
Cached (the default): kernel and machine-profile caches of the tree's own, filled by one start that is not
counted. `--cold`: every start gets empty kernel and profile caches (a first start on a machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tokenfactory.bench.compare import free_port
from tokenfactory.bench.machine import machine_facts


def start_once(tree: Path, kept_caches: Path | None, timeout_s: float) -> float:
    """Seconds from the process's start to the first `/health` 200; kept_caches None: empty caches. Polled every
    20 ms (compare.ServerProcess.wait_ready polls every 0.5 s, too coarse to time a 4 s start)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    with tempfile.TemporaryDirectory(prefix="startup-probe-") as caches:
        for var, name in (("TOKENFACTORY_KERNEL_CACHE", "kernels"), ("TOKENFACTORY_PROFILE_CACHE", "profiles")):
            env[var] = str((kept_caches or Path(caches)) / name)
        command = [sys.executable, "-m", "tokenfactory.cli", "serve", "--port", str(port),
                   "--data-dir", str(Path(caches) / "data")]
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while time.perf_counter() - start < timeout_s:
                if proc.poll() is not None:
                    raise RuntimeError(f"{tree}: serve exited with {proc.returncode}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                        if r.status == 200:
                            return time.perf_counter() - start
                except OSError:
                    pass
                time.sleep(0.02)
            raise RuntimeError(f"{tree}: no /health 200 in {timeout_s} s")
        finally:
            proc.terminate()
            proc.wait(30)


def git_head(tree: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    return out.stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="a source tree to start (repeatable; default: head=.)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cold", action="store_true", help="empty kernel and profile caches for every start")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    trees = {name: Path(d) for name, _, d in (t.partition("=") for t in args.tree or ["head=."])}
    kept = Path(tempfile.mkdtemp(prefix="startup-probe-caches-"))
    # Caches per tree: the kernels' build records its sources' paths, so trees sharing one would rebuild in turn.
    caches = {name: None if args.cold else kept / name for name in trees}
    if not args.cold:
        for name, tree in trees.items():  # fills the tree's caches: not counted
            start_once(tree, caches[name], args.timeout)
    seconds: dict[str, list[float]] = {name: [] for name in trees}
    try:
        for _ in range(args.rounds):
            for name, tree in trees.items():
                seconds[name].append(round(start_once(tree, caches[name], args.timeout), 3))
                print(f"{name}: {seconds[name][-1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    result: dict[str, Any] = {
        "what": "tokenfactory serve (bundled model, defaults) from process start to the first /health 200",
        "caches": "empty kernel and profile caches per start" if args.cold else "kernel and profile caches filled",
        "machine": machine_facts(), "python": platform.python_version(), "rounds": args.rounds,
        "command": " ".join([sys.executable, *sys.argv]),
        "trees": {name: {"dir": str(tree), "commit": git_head(tree), "seconds": seconds[name],
                         "median_s": statistics.median(seconds[name])} for name, tree in trees.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({n: t["median_s"] for n, t in result["trees"].items()}))


if __name__ == "__main__":
    main()
