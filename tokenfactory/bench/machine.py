"""`tokenfactory bench machine`: the figures that must hold on whatever CPU a user gets, in one JSON.

    tokenfactory bench machine                                  results/bench-machine.json
    tokenfactory bench machine --engines tokenfactory,llama-server --levels 1:8,8:32,32:96

In order, each in its own process so none inherits another's threads or memory:
  1. the machine profile (`tokenfactory doctor --machine --json`: measured now, or this machine's cached one),
  2. the engine offline (`tokenfactory bench offline --skip-hf`): throughput over 128 mixed requests, and
     single-stream decode (128-token prompt, 128 tokens),
  3. each engine served (`bench compare`'s launchers: ours, then llama-server and `vllm` where they are on
     PATH, on the same GGUF file and thread count): ~130-token prompts, 128 output tokens, ignore_eos,
     streaming, closed loop at each level's clients and requests.
     Peers are started as their users run them (compare.py's launchers: llama-server with -t = the cores and
     one slot per client, restarted for each level; vLLM with its CPU settings), each full command in the JSON.
  4. at one client, each server also under a plain load generator (plain.py), just before the harness and just
     after: the harness's output tok/s must be within 5% of their mean, or the harness, not the server, is what
     was measured.
  5. after our server's levels, with it still up: the offline single stream and the served one in interleaved
     pairs (bench/pairs.py: a worker process holds the offline engine; one request each per round).
Then the goals (issue 29), as data: served single stream >= 95% of offline (the median of the pairs' ratios of
decode rates, 1 / TPOT against offline's; with --single-stream-pairs 0, the one-client level's TPOT p50 against
the offline run's single stream), batch-1
decode at >= 50% of the read bandwidth measured in the same run (MBU; the faster of memory's and the cache's over
the bytes one token reads: bench/offline.py `roofline_bandwidth`), and our output tok/s >= 1.2x every
other engine at one client and >= 1.5x at more. `tokenfactory bench publish` turns the file into the README's
and docs/benchmarks.md's tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenfactory.types import ParameterError

SCHEMA = "tokenfactory.bench.machine/1"
DEFAULT_LEVELS = "1:8,8:32,32:96"
PLAIN_SEED_OFFSET = 1000  # the plain runs' prompts (+0 before, +1 after): past every level's (level i: seed + i)
PLAIN_WARMUP_SEED_OFFSET = 1002  # the two short requests that warm a server up before the first plain run
PAIRS_SEED_OFFSET = 1003  # the served side of the single-stream pairs
SINGLE_STREAM_TOLERANCE = 0.05  # served single-stream decode within 5% of offline
MBU_GOAL = 0.5  # batch-1 decode's share of the measured read bandwidth
LEAD_AT_ONE_CLIENT, LEAD_AT_MORE = 1.2, 1.5  # our output tok/s over each other engine's
FIGURES = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "joules_per_output_token", "energy_source", "server_rss_peak_bytes", "completed", "failed")


def print_machine_profile(model: str | None, quantization: str = "auto", dtype: str = "auto",
                          threads: int | None = None, remeasure: bool = False, as_json: bool = False) -> int:
    """`tokenfactory doctor --machine`: this machine's profile for `model`, through the engine's own start-up path
    (load, place, profile), so what it prints is what `serve` would use. Here and not in the planner, which builds
    no engine. The planner's weight formats (bf16, fp16, fp32) mean no quantization at that dtype."""
    import torch

    from tokenfactory.config import EngineConfig, dense_path
    from tokenfactory.engine.engine import LLMEngine

    as_dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    if quantization in as_dtype:
        quantization, dtype = "none", as_dtype[quantization]
    if threads is not None:
        torch.set_num_threads(threads)
    # serve's engine: its dense path (--quantization-dense auto) and a pool for the timed decode steps
    engine = LLMEngine(EngineConfig(model=model, quantization=quantization, dtype=dtype, kv_cache_memory=64 << 20,
                                    max_model_len=256, quantization_dense=dense_path("auto"),
                                    machine_profile="remeasure" if remeasure else "auto"))
    engine.warmup()  # where the profile has no row limit for the compiled plan yet, it is timed now
    profile = engine.machine_profile
    if profile is None:
        print(f"no machine profile: the engine runs on {engine.device}, which keeps its built-in constants")
        return 0
    print(json.dumps(profile.to_json(), indent=2) if as_json else "\n".join(profile.describe()))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", default="tokenfactory,llama-server,vllm",
                   help="engines to serve, of tokenfactory, llama-server, vllm (those not on PATH are skipped)")
    p.add_argument("--levels", default=DEFAULT_LEVELS, help="CLIENTS:REQUESTS per level (default %(default)s)")
    p.add_argument("--model-path", default=None, help="GGUF file every engine loads (default: the bundled model)")
    p.add_argument("--engine-threads", type=int, default=None,
                   help="CPU threads for every engine (default: one per core, as each engine's own default)")
    p.add_argument("--quantization", default="auto",
                   help="our engine's weights, offline and served alike (auto: the file's own blocks; none, int8, "
                        "int4)")
    p.add_argument("--dtype", default="auto", help="our engine's dtype, offline and served alike")
    p.add_argument("--input-len", type=int, default=130)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--offline-requests", type=int, default=128, help="requests in the offline throughput run")
    p.add_argument("--offline-args", default="", help="more `bench offline` options, e.g. '--output-len 16:32'")
    p.add_argument("--skip-offline", action="store_true", help="served figures only")
    p.add_argument("--single-stream-pairs", type=int, default=8,
                   help="rounds of an offline and a served single stream, interleaved, for the served-single-stream "
                        "goal (0: the one-client level against the offline run)")
    p.add_argument("--results-dir", default="results", help="logs and the per-run JSON go here")
    p.add_argument("--out", default="results/bench-machine.json")


def shown(command: list[str], model_path: Path, env: dict[str, str] | None = None) -> str:
    """The command as a reader reruns it: our interpreter as `python`, other engines by name, the model as
    MODEL.gguf, the loopback port as PORT (this machine's paths and a free port mean nothing elsewhere), the
    engine's own environment variables first."""
    words = [f"{k}={v}" for k, v in (env or {}).items()]
    command = [Path(command[0]).name if "/" in command[0] and command[0] != sys.executable else command[0],
               *command[1:]]
    words += ["python" if w == sys.executable else w for w in command]
    words = ["MODEL" + model_path.suffix if w == str(model_path) else w for w in words]
    return " ".join("PORT" if i and words[i - 1] == "--port" else w for i, w in enumerate(words))


def parse_levels(text: str) -> list[tuple[int, int]]:
    levels = []
    for item in text.split(","):
        clients, sep, requests = item.strip().partition(":")
        try:
            level = (int(clients), int(requests) if sep else 3 * int(clients))
        except ValueError:
            raise ParameterError("levels", f"--levels must look like 1:8,8:32, got {text!r}") from None
        if min(level) < 1:
            raise ParameterError("levels", f"--levels: clients and requests must be >= 1, got {item!r}")
        levels.append(level)
    return levels


def machine_facts() -> dict[str, Any]:
    import torch

    from tokenfactory import __version__
    from tokenfactory.engine.tuning import cpu_identity

    cpu, flags = cpu_identity()
    return {"cpu": cpu, "flags": flags, "num_cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "tokenfactory_version": __version__}


def _tokenfactory_cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "tokenfactory.cli", *argv]


def _run_json(command: list[str], out: Path | None = None) -> dict[str, Any]:
    """Run a command of ours; its JSON from `out`, else from its standard output."""
    print(f"$ {shlex.join(command)}", file=sys.stderr)
    done = subprocess.run(command, capture_output=out is None, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed ({done.returncode}): {(done.stderr or '')[-800:]}")
    return json.loads(out.read_text() if out is not None else done.stdout)


def offline_options(args: argparse.Namespace) -> list[str]:
    """`bench offline`'s options for this run: the model, our engine's options and --offline-args (the offline run
    and the pairs' worker alike)."""
    model = ["--model", args.model_path] if args.model_path else []
    return [*model, *engine_options(args), *shlex.split(args.offline_args)]


def measure_offline(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    out = workdir / "offline.json"
    command = _tokenfactory_cli("bench", "offline", "--skip-hf", "--num-requests", str(args.offline_requests),
                                *offline_options(args), "--out", str(out))
    result = _run_json(command, out)
    data, environment = result["tokenfactory"], result["environment"]
    return {"command": shlex.join(["tokenfactory", *command[3:-2]]), "num_requests": args.offline_requests,
            "throughput_tok_s": round(data["throughput"]["output_tokens_per_s"], 1),
            "single_stream_decode_tok_s": round(data["single_stream"]["decode_tokens_per_s"], 1),
            "mbu": round(data["single_stream"]["mbu"], 3),
            "peak_bandwidth_gbs": round(environment["peak_bandwidth_gbs"], 1),  # measured in the same process
            "peak_bandwidth_source": environment["peak_bandwidth_source"],
            # memory's, and over the bytes a decode token reads (a cache that holds the model is faster): offline.py
            **{k: round(environment[k], 1) for k in ("dram_bandwidth_gbs", "working_set_bandwidth_gbs")
               if environment.get(k) is not None},
            "quantization": data["quantization"], "dtype": data["dtype"]}


def measure_pairs(args: argparse.Namespace, url: str, model: str, tokenizer: Any) -> dict[str, Any]:
    """The single-stream pairs (bench/pairs.py) against our running server: the offline side with the run's
    engine options and --offline-args, its single stream the served requests' lengths; fresh prompts (a seed
    no level uses) on the served side, so none is a prefix-cache hit."""
    from tokenfactory.bench import pairs
    from tokenfactory.bench.datasets import build_dataset
    from tokenfactory.bench.serve import dataset_config

    sargs = serve_args(args)
    requests = build_dataset(dataset_config(sargs, args.single_stream_pairs, sargs.seed + PAIRS_SEED_OFFSET),
                             tokenizer)
    offline_argv = [*offline_options(args), "--single-prompt-len", str(args.input_len), "--single-output-len",
                    str(args.output_len)]
    log = Path(args.results_dir).expanduser() / "logs" / "machine-pairs-worker.log"
    result = pairs.measure(offline_argv, url, model, requests, log)
    return {"command": shlex.join(["python", "-m", pairs.WORKER_MODULE, *offline_argv]), **result}


def engine_options(args: argparse.Namespace) -> list[str]:
    """Our engine's options, the same offline and served (so the two single-stream figures compare)."""
    return ["--quantization", args.quantization, "--dtype", args.dtype]


def serve_args(args: argparse.Namespace) -> argparse.Namespace:
    """`bench compare`'s options for this run (its launchers and its per-level runner)."""
    from tokenfactory.bench import compare

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    threads = ["--engine-threads", str(args.engine_threads)] if args.engine_threads else []
    model = ["--model-path", args.model_path] if args.model_path else []
    return parser.parse_args(["--input-len", str(args.input_len), "--output-len", str(args.output_len),
                              "--ignore-eos", "--warmup", "2", "--no-progress", "--results-dir", args.results_dir,
                              "--save", "machine", *threads, *model])


AfterLevels = Callable[[str, str, Any], None]  # (base URL, served model, tokenizer), with the server still up


def measure_served(args: argparse.Namespace, name: str, levels: list[tuple[int, int]],
                   after_levels: AfterLevels | None = None) -> dict[str, Any] | None:
    """One engine at every level (started once, or once a level when its launcher sizes it per level), then the
    plain generator's check at one client, then `after_levels` on the last server; None when it is not
    installed."""
    from tokenfactory.bench import compare

    launcher = compare.LAUNCHERS[name]
    model_path = Path(args.model_path).expanduser() if args.model_path else bundled_path()
    groups = [[level] for level in levels] if launcher.per_level else [levels]
    rows: list[dict[str, Any]] = []
    commands: dict[str, str] = {}
    result: dict[str, Any] = {"levels": rows, "commands_by_clients": commands}
    for i, group in enumerate(groups):
        then = after_levels if i == len(groups) - 1 else None
        started = serve_group(args, name, model_path, group, rows, commands, result, then)
        if started is None:
            return None
        if not started:
            break
    result["command"] = next(iter(commands.values()), None)
    return result


def engine_version(binary: str) -> str | None:
    """What a peer's `--version` says (llama.cpp: its build number, commit and compiler), on one line: which build
    was measured belongs beside its command."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return "; ".join(lines[-3:])[:300] or None


def bundled_path() -> Path:
    from tokenfactory.models.loader import bundled_model_path

    return bundled_model_path()


def serve_group(args: argparse.Namespace, name: str, model_path: Path, group: list[tuple[int, int]],
                rows: list[dict[str, Any]], commands: dict[str, str], result: dict[str, Any],
                after_levels: AfterLevels | None = None) -> bool | None:
    """Start the engine sized for `group`'s levels and run them; None: not installed, False: it did not start."""
    from tokenfactory.bench import compare, plain
    from tokenfactory.bench.datasets import load_tokenizer

    sargs = serve_args(args)
    launcher = compare.LAUNCHERS[name]
    options = compare.LaunchOptions(model_path, sargs.max_model_len, max(c for c, _ in group),
                                    {"tokenfactory": engine_options(args)},
                                    Path(args.results_dir).expanduser() / "logs" / "machine-ledger",
                                    args.engine_threads,
                                    compare.slot_context(args.input_len, args.output_len, sargs.max_model_len))
    port = compare.free_port()
    command = launcher.command(options, port)
    if command is None:
        return None
    if name != "tokenfactory" and "version" not in result:  # the binary the launcher resolved, asked once
        result["version"] = engine_version(command[0])
    env = launcher.env(options)
    text = shown(command, model_path, env)
    log = Path(args.results_dir).expanduser() / "logs" / f"machine-{name}.log"
    print(f"$ {text}", file=sys.stderr)
    server = compare.ServerProcess(name, command, log, options.environment() | env)
    url = f"http://127.0.0.1:{port}"
    try:
        problem = server.wait_ready(url, sargs.startup_timeout)
        if problem is not None:
            result["error"] = problem
            commands.setdefault(str(group[0][0]), text)
            return False
        tokenizer = load_tokenizer(model_path)
        for clients, requests in group:
            sargs.num_prompts = requests
            model = plain.served_model(url) if clients == 1 else None  # the plain runs ask for it as the harness does
            before = plain_run(sargs, url, model, tokenizer, requests, warm_up=True) if model is not None else None
            (run,) = compare.run_levels_for(sargs, url, name, tokenizer, [(clients, None)], server.pid)
            result["machine_profile"] = result.get("machine_profile") or \
                run.environment.get("server", {}).get("machine_profile")
            commands[str(clients)] = text
            rows.append({"clients": clients, "requests": requests, "status": run.status,
                         **{k: run.figures.get(k) for k in FIGURES},
                         **({"failures": run.failures} if run.failures else {})})
            if before is not None:
                after = plain_run(sargs, url, model, tokenizer, requests, seed_offset=PLAIN_SEED_OFFSET + 1)
                result["harness_check"] = plain.harness_check(run.figures.get("output_throughput"), [before, after])
        if after_levels is not None:
            after_levels(url, plain.served_model(url), tokenizer)
        return True
    finally:
        server.stop()


def plain_run(sargs: argparse.Namespace, url: str, model: str, tokenizer: Any, requests: int,
              seed_offset: int = PLAIN_SEED_OFFSET, warm_up: bool = False) -> dict[str, Any]:
    """As many prompts of the level's lengths, one client, through the plain generator (plain.py): one of the two
    runs around the harness's at one client. Fresh prompts (a seed no level uses, another for each run): the
    harness's own, sent again, would be served from the server's prompt cache (llama-server keeps finished prompts
    in RAM; our prefix cache keeps their blocks) and the plain figure would skip the prefill the harness paid for
    (measured: llama-server 0.71-0.78 of plain, ours 0.88-0.95, where the prompts were the same). `warm_up`: two
    short requests first, of their own prompts (the run before the harness's may be a fresh server's first)."""
    from tokenfactory.bench import plain
    from tokenfactory.bench.datasets import build_dataset
    from tokenfactory.bench.serve import dataset_config

    def prompts(offset: int, n: int) -> list[str]:
        return [r.prompt or "" for r in build_dataset(dataset_config(sargs, n, sargs.seed + offset), tokenizer)]

    if warm_up:
        plain.closed_loop(url, model, prompts(PLAIN_WARMUP_SEED_OFFSET, 2), 8, 1)
    return plain.closed_loop(url, model, prompts(seed_offset, requests), sargs.output_len, 1)


def goals(offline: dict[str, Any] | None, served: dict[str, dict[str, Any]],
          pairs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Served single stream against offline, MBU, and our lead over each other engine at each level."""
    ours = served.get("tokenfactory", {}).get("levels", [])
    result: dict[str, Any] = {}
    one = next((r for r in ours if r["clients"] == 1), None)
    if pairs and pairs.get("rounds"):  # neighbours seconds apart: a host's drift over minutes does not decide
        result["served_single_stream"] = {
            "method": f"the median of {len(pairs['rounds'])} interleaved pairs",
            "served_decode_tok_s": pairs["served_decode_tok_s"], "offline_decode_tok_s": pairs["offline_decode_tok_s"],
            "ratio": pairs["ratio"], "ratio_range": pairs["ratio_range"], "tolerance": SINGLE_STREAM_TOLERANCE,
            "met": pairs["ratio"] >= 1 - SINGLE_STREAM_TOLERANCE}
    elif offline and one and one.get("median_tpot_ms"):
        decode = 1000.0 / one["median_tpot_ms"]
        ratio = decode / offline["single_stream_decode_tok_s"]
        result["served_single_stream"] = {"method": "the one-client level against the offline run",
                                          "served_decode_tok_s": round(decode, 1),
                                          "offline_decode_tok_s": offline["single_stream_decode_tok_s"],
                                          "ratio": round(ratio, 3), "tolerance": SINGLE_STREAM_TOLERANCE,
                                          "met": ratio >= 1 - SINGLE_STREAM_TOLERANCE}
    if offline and offline.get("mbu") is not None:
        result["mbu"] = {"mbu": offline["mbu"], "peak_bandwidth_gbs": offline.get("peak_bandwidth_gbs"),
                         "peak_bandwidth_source": offline.get("peak_bandwidth_source"),
                         "goal": MBU_GOAL, "met": offline["mbu"] >= MBU_GOAL}
    for name, other in served.items():
        if name == "tokenfactory" or not other.get("levels"):
            continue
        theirs = {r["clients"]: r.get("output_throughput") for r in other["levels"]}
        lead = {str(r["clients"]): round(r["output_throughput"] / theirs[r["clients"]], 2) for r in ours
                if r.get("output_throughput") and theirs.get(r["clients"])}
        required = {c: LEAD_AT_ONE_CLIENT if c == "1" else LEAD_AT_MORE for c in lead}
        result[f"lead_over_{name}"] = {"ratio_by_clients": lead, "required_by_clients": required,
                                       "met": bool(lead) and all(v >= required[c] for c, v in lead.items())}
    checks = {name: s["harness_check"] for name, s in served.items() if s.get("harness_check")}
    if checks:
        result["harness_within_5pct_of_plain"] = {"ratio_by_engine": {n: c["ratio"] for n, c in checks.items()},
                                                  "met": all(c["met"] for c in checks.values())}
    return result


def main(args: argparse.Namespace) -> int:
    levels = parse_levels(args.levels)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ("tokenfactory", "llama-server", "vllm")]
    if unknown:
        raise ParameterError("engines", f"--engines: unknown {', '.join(unknown)}")
    if args.single_stream_pairs < 0:
        raise ParameterError("single_stream_pairs",
                             f"--single-stream-pairs must be >= 0, got {args.single_stream_pairs}")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    model = [args.model_path] if args.model_path else []
    profile = _run_json(_tokenfactory_cli("doctor", "--machine", *model, "--quantization", args.quantization,
                                          "--dtype", args.dtype, "--json"))
    with tempfile.TemporaryDirectory(prefix="tokenfactory-machine-") as tmp:
        offline = None if args.skip_offline else measure_offline(args, Path(tmp))
    served: dict[str, dict[str, Any]] = {}
    skipped = []
    found: dict[str, Any] = {}

    def single_stream_pairs(url: str, model: str, tokenizer: Any) -> None:
        try:
            found["pairs"] = measure_pairs(args, url, model, tokenizer)
        except (RuntimeError, OSError) as e:  # the levels' figures stand; the goal falls back to them
            print(f"the single-stream pairs failed: {e}", file=sys.stderr)
            found["pairs"] = {"error": str(e)}

    for name in engines:
        then = single_stream_pairs if name == "tokenfactory" and args.single_stream_pairs > 0 else None
        result = measure_served(args, name, levels, then)
        if result is None:
            skipped.append(f"{name} is not on PATH")
            continue
        served[name] = result
    pairs = found.get("pairs")
    result = {"schema": SCHEMA, "time": started, "machine": machine_facts(), "profile": profile,
              "offline": offline, "single_stream_pairs": pairs, "served": served, "skipped": skipped,
              "goals": goals(offline, served, pairs),
              "engine": {"quantization": args.quantization, "dtype": args.dtype},
              "workload": {"input_len": args.input_len, "output_len": args.output_len, "levels": levels,
                           "ignore_eos": True, "streaming": True, "engine_threads": args.engine_threads}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"machine": result["machine"]["cpu"], "offline": offline, "goals": result["goals"],
                      "served": {n: [(r["clients"], r["output_throughput"]) for r in s["levels"]]
                                 for n, s in served.items()}, "skipped": skipped, "out": str(out)}, indent=1))
    return 0 if all(g.get("met", True) for g in result["goals"].values()) else 1
