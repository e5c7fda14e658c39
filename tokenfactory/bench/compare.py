"""`tokenfactory bench compare`: one workload against several servers, one at a time, one table.

    tokenfactory bench compare --concurrency 1,4 --num-prompts 16 --save cpu-compare
    tokenfactory bench compare --engines tokenfactory,hf --target vllm=http://gpu-box:8000

Engines are started here, each on a free loopback port, measured, then stopped before the next one
starts (on a small machine two engines would fight for the cores and both figures would be wrong):

    tokenfactory   `python -m tokenfactory.cli serve` (our server, continuous batching, prefix cache)
    hf             `python -m tokenfactory.bench.hf_server` (transformers `generate`, one request at a time)
    llama-server   llama.cpp's server, when `llama-server` is on PATH, as its users run it: -t and -tb = the
                   cores (or --engine-threads), -np = the highest concurrency, -c = -np x the per-slot context
    vllm           `vllm serve`, when `vllm` is on PATH, with vLLM's documented CPU settings
                   (VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND over the cores, bfloat16)

All load the same model file (--model-path, default the bundled SmolLM2-135M GGUF) and get the same
prompts (same seed). `--target NAME=URL` adds a server that is already running. Each engine's memory
is its process tree's resident set (we know its pid), its power the local source over its own window.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenfactory.bench.serve import add_measure_arguments, add_output_arguments, add_workload_arguments
from tokenfactory.types import ParameterError

DEFAULT_ENGINES = "tokenfactory,hf,llama-server,vllm"


@dataclass(frozen=True)
class LaunchOptions:
    model_path: Path
    max_model_len: int
    max_concurrency: int
    extra_args: dict[str, list[str]]  # engine -> extra command-line arguments
    data_dir: Path  # our server's ledger of the benchmark's requests (kept apart from the user's)
    threads: int | None = None  # CPU threads for every engine (OMP_NUM_THREADS, llama-server -t); None: theirs
    slot_context: int | None = None  # llama-server's context per slot (None: max_model_len)

    @property
    def cores(self) -> int:
        """The threads a peer gets: --engine-threads, else one per core (as its users set them)."""
        return self.threads or os.cpu_count() or 1

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.threads is not None:
            env |= {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        return env


def _no_env(o: LaunchOptions) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Launcher:
    """How to start one engine; `command` returns None when the engine is not installed. `env`: variables the
    engine's own documentation sets (shown with the command). `per_level`: started afresh for each load level,
    sized for it (llama-server's slots)."""

    name: str
    command: Callable[[LaunchOptions, int], list[str] | None]
    env: Callable[[LaunchOptions], dict[str, str]] = _no_env
    per_level: bool = False


def _tokenfactory(o: LaunchOptions, port: int) -> list[str]:
    return [sys.executable, "-m", "tokenfactory.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model", str(o.model_path), "--max-model-len", str(o.max_model_len), "--log-level", "warning",
            "--data-dir", str(o.data_dir), *o.extra_args.get("tokenfactory", [])]


def _hf(o: LaunchOptions, port: int) -> list[str]:
    return [sys.executable, "-m", "tokenfactory.bench.hf_server", "--host", "127.0.0.1", "--port", str(port),
            "--model", str(o.model_path), *o.extra_args.get("hf", [])]


def _llama_server(o: LaunchOptions, port: int) -> list[str] | None:
    exe = shutil.which("llama-server")
    if exe is None:
        return None
    slots = max(o.max_concurrency, 1)  # llama-server splits -c among -np slots
    # -t / -tb: its default counts physical cores from the CPU topology, which a VM may report oddly (issue 29:
    # 113 tok/s at one client by default against 135-143 with -t 2 on a 2-vCPU Zen 5): give it the cores.
    threads = ["-t", str(o.cores), "-tb", str(o.cores)]
    return [exe, "-m", str(o.model_path), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str((o.slot_context or o.max_model_len) * slots), *threads, *o.extra_args.get("llama-server", [])]


def _vllm(o: LaunchOptions, port: int) -> list[str] | None:
    exe = shutil.which("vllm")
    if exe is None:
        return None
    return [exe, "serve", str(o.model_path), "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(o.max_model_len), "--dtype", "bfloat16", "--max-num-seqs",
            str(max(o.max_concurrency, 1)), *o.extra_args.get("vllm", [])]


def _vllm_env(o: LaunchOptions) -> dict[str, str]:
    """vLLM's CPU settings (its CPU installation guide): KV cache space in GiB, OpenMP threads bound one a core."""
    return {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{o.cores - 1}"}


LAUNCHERS: dict[str, Launcher] = {
    "tokenfactory": Launcher("tokenfactory", _tokenfactory),
    "hf": Launcher("hf", _hf),
    "llama-server": Launcher("llama-server", _llama_server, per_level=True),
    "vllm": Launcher("vllm", _vllm, _vllm_env),
}


def slot_context(input_len: int, output_len: int, max_model_len: int) -> int:
    """A llama-server slot's context for a workload: its longest prompt (random lengths reach 2x the mean with
    --range-ratio 1) and output, in 256-token steps, at most max_model_len."""
    return min(max_model_len, -(-(2 * input_len + output_len) // 256) * 256)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started for the comparison: its log file, its pid, and a clean stop."""

    def __init__(self, name: str, command: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.command, self.log_path = name, command, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=env)

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, base_url: str, timeout_s: float) -> str | None:
        """None once GET /health answers 200; else why not (exited, or timed out)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return f"{self.name} exited with status {self.process.returncode} before it was ready " \
                       f"(log: {self.log_path}): {self.log_tail()}"
            try:
                if httpx.get(f"{base_url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return f"{self.name} was not ready after {timeout_s:.0f} s (log: {self.log_path})"

    def log_tail(self, num_chars: int = 400) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:].strip()
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # its own session: the server and its children
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engines")
    g.add_argument("--engines", default=DEFAULT_ENGINES,
                   help=f"engines to start, of {', '.join(LAUNCHERS)} (default: {DEFAULT_ENGINES}; "
                        "those not installed are skipped)")
    g.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                   help="an already running OpenAI-compatible server to include (repeatable)")
    g.add_argument("--model-path", default=None, help="GGUF file every started engine loads (default: bundled)")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--engine-args", action="append", default=[], metavar="ENGINE='ARGS'",
                   help="extra arguments for one engine, e.g. tokenfactory='--max-num-seqs 32' (repeatable)")
    g.add_argument("--engine-threads", type=int, default=None,
                   help="CPU threads for every started engine (OMP_NUM_THREADS; llama-server -t); default: theirs")
    g.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for an engine's /health")
    g.add_argument("--api-key", default=None, help="for --target servers that need one")
    add_workload_arguments(parser)
    levels = parser.add_argument_group("load")
    levels.add_argument("--concurrency", default="1,4", help="closed-loop levels, e.g. 1,4,16 (default 1,4)")
    levels.add_argument("--burstiness", type=float, default=1.0, help=argparse.SUPPRESS)
    levels.add_argument("--warmup", type=int, default=2, help="requests sent one at a time before measuring")
    levels.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    levels.add_argument("--slo", default=None, help="goodput bounds, e.g. ttft=500ms,tpot=50ms")
    add_measure_arguments(parser)
    add_output_arguments(parser)
    parser.set_defaults(model=None, label=None, request_rate=None)


def parse_targets(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name.strip() or not url.strip():
            raise ParameterError("target", f"--target must look like NAME=URL, got {item!r}")
        out.append((name.strip(), url.strip()))
    return out


def parse_engine_args(items: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, rest = item.partition("=")
        if not sep or name.strip() not in LAUNCHERS:
            raise ParameterError("engine_args", f"--engine-args must look like ENGINE='ARGS' with ENGINE one of "
                                                f"{', '.join(LAUNCHERS)}, got {item!r}")
        out.setdefault(name.strip(), []).extend(shlex.split(rest))
    return out


def chosen_engines(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAUNCHERS]
    if unknown:
        raise ParameterError("engines", f"--engines: unknown {', '.join(unknown)}; choose from {', '.join(LAUNCHERS)}")
    return names


def main(args: argparse.Namespace) -> int:
    from tokenfactory.bench.datasets import load_tokenizer
    from tokenfactory.bench.results import check_name, load_runs
    from tokenfactory.bench.serve import finish, make_console
    from tokenfactory.bench.sweep import parse_levels, print_sweep_comparison, summary_table
    from tokenfactory.models.loader import bundled_model_path

    if args.save:
        check_name(args.save)
    baseline = load_runs(args.compare, args.results_dir) if args.compare else None
    engines, targets = chosen_engines(args.engines), parse_targets(args.target)
    levels = [(c, None) for c in parse_levels(args.concurrency, int, "--concurrency")]
    model_path = Path(args.model_path).expanduser() if args.model_path else bundled_model_path()
    if not model_path.exists():
        raise ParameterError("model_path", f"--model-path {model_path} does not exist")
    if args.engine_threads is not None and args.engine_threads < 1:
        raise ParameterError("engine_threads", f"--engine-threads must be >= 1, got {args.engine_threads}")
    options = LaunchOptions(model_path, args.max_model_len, max(c for c, _ in levels),
                            parse_engine_args(args.engine_args),
                            Path(args.results_dir).expanduser() / "logs" / f"{args.save or 'compare'}-ledger",
                            args.engine_threads, slot_context(args.input_len, args.output_len, args.max_model_len))
    tokenizer = load_tokenizer(args.tokenizer or model_path)
    console = make_console()
    runs: list[Any] = []
    skipped: list[str] = []
    for name in engines:
        if LAUNCHERS[name].per_level:  # sized for each level, as its users would start it for that load
            for level in levels:
                sized = replace(options, max_concurrency=level[0] or options.max_concurrency)
                runs += run_started_engine(args, name, sized, [level], tokenizer, console, skipped)
        else:
            runs += run_started_engine(args, name, options, levels, tokenizer, console, skipped)
    for name, url in targets:
        runs += run_levels_for(args, url, name, tokenizer, levels, None)
    if not runs:
        console.print("[red]nothing to compare: " + ("; ".join(skipped) or "no engine and no --target") + "[/]")
        return 1
    code = finish(args, runs, None, kind="compare", detail=False)
    for concurrency, _ in levels:
        at_level = [r for r in runs if r.config.get("load", {}).get("concurrency") == concurrency]
        console.print(comparison_table(at_level, f"concurrency {concurrency}"))
    console.print(summary_table(runs, "all runs"))
    for note in skipped:
        console.print(f"[yellow]skipped: {note}[/]")
    if baseline:
        print_sweep_comparison(console, baseline, runs, by_label=True)
    return code


def run_levels_for(args: argparse.Namespace, url: str, label: str, tokenizer: Any, levels: list[Any],
                   pid: int | None) -> list[Any]:
    from tokenfactory.bench.sweep import run_levels

    args.server_pid = pid
    runs = run_levels(args, url, label, tokenizer, levels)  # level i: seed + i, the same prompts for every engine
    for run in runs:
        run.name = f"{args.save or 'compare'}-{label}-c{run.config.get('load', {}).get('concurrency')}"
    return runs


def run_started_engine(args: argparse.Namespace, name: str, options: LaunchOptions, levels: list[Any],
                       tokenizer: Any, console: Any, skipped: list[str]) -> list[Any]:
    port = free_port()
    command = LAUNCHERS[name].command(options, port)
    if command is None:
        skipped.append(f"{name} is not installed (not on PATH)")
        return []
    log = Path(args.results_dir).expanduser() / "logs" / f"{args.save or 'compare'}-{name}.log"
    env = LAUNCHERS[name].env(options)
    console.print(f"[bold]starting {name}[/]: {shlex.join([f'{k}={v}' for k, v in env.items()] + command)}")
    server = ServerProcess(name, command, log, options.environment() | env)
    try:
        url = f"http://127.0.0.1:{port}"
        problem = server.wait_ready(url, args.startup_timeout)
        if problem is not None:
            skipped.append(problem)
            return []
        runs = run_levels_for(args, url, name, tokenizer, levels, server.pid)
        for run in runs:  # how the engine was started, for whoever reproduces the figures
            run.config["engine"] = {"name": name, "command": command, "env": env, "threads": options.threads}
        return runs
    finally:
        server.stop()


def comparison_table(runs: list[Any], title: str) -> Any:
    """Figures as rows, targets as columns; the best value of each row is marked."""
    from rich.table import Table

    from tokenfactory.bench.figures import FIGURE_SPECS, display_value

    table = Table(title=title)
    table.add_column("figure")
    table.add_column("unit")
    for run in runs:
        table.add_column(run.label + ("" if run.status == "complete" else f" ({run.status})"), justify="right")
    table.add_column("better is")
    for name, spec in FIGURE_SPECS.items():
        values = [run.figures.get(name) for run in runs]
        if all(v is None for v in values):
            continue
        numbers = [v for v in values if isinstance(v, int | float)]
        best = (max(numbers) if spec.better == "higher" else min(numbers)) if spec.better and numbers else None
        cells = [f"[bold green]{display_value(name, v)}[/]" if best is not None and v == best and len(runs) > 1
                 else display_value(name, v) for v in values]
        table.add_row(spec.label, spec.unit, *cells, spec.better or "—")
    return table
