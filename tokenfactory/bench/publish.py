"""`tokenfactory bench publish`: the README's and docs/benchmarks.md's measured figures, written from JSON.

    tokenfactory bench publish results/bench-machine.json   keep it (docs/results/), then rewrite both files
    tokenfactory bench publish results/bench-fleet.json     the same for the fleet's figures
    tokenfactory bench publish --check                      exit 1 when either file is not what the JSON says

The kept files are the benchmarks' own JSON, less per-request samples: `bench machine` files by CPU
(docs/results/machine-<cpu>.json, one per CPU model, the newest kept) and the fleet's (docs/results/fleet.json).
Each target file has marked blocks, `<!-- bench:NAME -->` ... `<!-- /bench:NAME -->`, that only this writes:
a figure in them always has its JSON and its command. Everything outside the marks is prose.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenfactory.bench.machine import SCHEMA as MACHINE_SCHEMA
from tokenfactory.types import ParameterError

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="*", help="bench machine or bench_fleet.py JSON to keep before writing")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a block is out of date")
    p.add_argument("--root", default=str(ROOT), help="the repository (default: this checkout)")


# ---------------------------------------------------------------------------------------------------
# Keeping the JSON


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower().replace("(r)", "").replace("(tm)", "")).strip("-")


def kept_name(data: dict[str, Any]) -> str:
    if data.get("schema") == MACHINE_SCHEMA:
        return f"machine-{slug(data['machine']['cpu'])}.json"
    if "routing_overhead" in data or "prefix" in data:  # scripts/bench_fleet.py
        return "fleet.json"
    raise ParameterError("files", "not a `bench machine` or `scripts/bench_fleet.py` result")


def keep(path: Path, results: Path) -> Path:
    data = json.loads(path.read_text())
    results.mkdir(parents=True, exist_ok=True)
    target = results / kept_name(data)
    target.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return target


def load_kept(results: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    machines = [json.loads(p.read_text()) for p in sorted(results.glob("machine-*.json"))]
    fleet = results / "fleet.json"
    return sorted(machines, key=lambda m: m["time"], reverse=True), (json.loads(fleet.read_text())
                                                                      if fleet.exists() else None)


# ---------------------------------------------------------------------------------------------------
# Rendering


def _num(v: Any, digits: int = 1) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=115, break_long_words=False, break_on_hyphens=False)


def _levels(machine: dict[str, Any], engine: str) -> list[dict[str, Any]]:
    return machine["served"].get(engine, {}).get("levels", [])


def _cpu_line(m: dict[str, Any]) -> str:
    facts = m["machine"]
    return f"{facts['num_cpus']}-vCPU {facts['cpu']}"


def readme_block(machines: list[dict[str, Any]], fleet: dict[str, Any] | None) -> str:
    lines = []
    for m in machines:
        ours, off = _levels(m, "tokenfactory"), m.get("offline") or {}
        clients = " / ".join(str(r["clients"]) for r in ours)
        text = (f"On a {_cpu_line(m)} ({m['time'][:10]}), with the bundled model: offline "
                f"{_num(off.get('throughput_tok_s'))} output tok/s, single-stream decode "
                f"{_num(off.get('single_stream_decode_tok_s'))} tok/s, and "
                f"{' / '.join(_num(r['output_throughput']) for r in ours)} output tok/s served to {clients} streaming "
                f"clients (TTFT p50 {' / '.join(_num(r['median_ttft_ms'], 0) for r in ours)} ms)")
        others = [(n, _levels(m, n)) for n in m["served"] if n != "tokenfactory" and _levels(m, n)]
        for name, rows in others:
            text += f"; {name} on the same machine: {' / '.join(_num(r['output_throughput']) for r in rows)}"
        lines.append(_wrap(text + "."))
    if fleet:
        r, p = fleet["replica_overhead"], fleet["prefix"]["by_router"]
        where = f" on the {fleet['machine']['cpu']}" if fleet.get("machine") else ""
        lines.append(_wrap(f"Behind the fleet gateway{where} (`python scripts/bench_fleet.py`), a replica in its own "
                     f"process adds "
                     f"{r['added_ttft_p50_ms']} ms to TTFT p50 and an external backend "
                     f"{fleet['routing_overhead']['added_ttft_p50_ms']} ms; prefix routing raises the prefix-cache "
                     f"hit rate from {p['least-work']['prefix_hit_rate']:.1%} to {p['prefix']['prefix_hit_rate']:.1%} "
                     f"on shared-prefix traffic."))
    lines.append(_wrap("Every figure, its machine and the command that reproduces it: "
                       "[docs/benchmarks.md](docs/benchmarks.md) (`tokenfactory bench machine` re-measures this "
                       "machine; `bash scripts/bench_all.sh` runs them all)."))
    return "\n".join(lines)


def _single_stream_line(single: dict[str, Any]) -> str:
    """The served-single-stream goal: from interleaved pairs (`ratio_range` present), or, in older files, the
    one-client level against offline (bracketed by a second offline run where `offline_decode_tok_s_each` has two)."""
    verdict = f"{'met' if single['met'] else 'NOT met'}: within {single.get('tolerance', 0.10):.0%}"
    if "ratio_range" in single:
        low, high = single["ratio_range"]
        return (f"- served single stream: {single['ratio']:.0%} of offline, {single['method']} (range {low:.0%}-"
                f"{high:.0%}; their medians {single['served_decode_tok_s']} tok/s decode served, 1 / TPOT, against "
                f"{single['offline_decode_tok_s']} offline) ({verdict})")
    each = single.get("offline_decode_tok_s_each") or []
    bracket = f" (the mean of {each[0]} before our server and {each[1]} after)" if len(each) == 2 else ""
    return (f"- served single stream: {single['served_decode_tok_s']} tok/s decode (1 / TPOT p50) against "
            f"{single['offline_decode_tok_s']} offline{bracket} = {single['ratio']:.0%} ({verdict})")


def machine_section(m: dict[str, Any]) -> str:
    facts, off, goals = m["machine"], m.get("offline") or {}, m.get("goals", {})
    out = [f"### {_cpu_line(m)}", "",
           f"`{' '.join(facts['flags'])}`; torch {facts['torch']}, Python {facts['python']}, tokenfactory "
           f"{facts['tokenfactory_version']}; measured {m['time']} by `tokenfactory bench machine` "
           f"(docs/results/machine-{slug(facts['cpu'])}.json).", ""]
    if off:
        out += [f"Offline (`{off['command']}`; weights `--quantization {off['quantization']}`, {off['dtype']}): "
                f"**{_num(off['throughput_tok_s'])}** output tok/s over {off['num_requests']} mixed requests, "
                f"single-stream decode **{_num(off['single_stream_decode_tok_s'])}** tok/s.", ""]
    out += ["| clients | requests | engine | output tok/s | TTFT p50 / p99 | TPOT p50 | J / output token | RSS peak |",
            "|---|---|---|---|---|---|---|---|"]
    served = sorted(m["served"].items(), key=lambda kv: kv[0] != "tokenfactory")  # ours first
    for name, engine in served:
        for r in engine.get("levels", []):
            joules = (f"{r['joules_per_output_token']:.3f} ({r['energy_source']})"
                      if r.get("joules_per_output_token") is not None else "–")
            rss = f"{r['server_rss_peak_bytes'] / 2**30:.2f} GiB" if r.get("server_rss_peak_bytes") else "–"
            tput = _num(r["output_throughput"])
            tput = f"**{tput}**" if name == "tokenfactory" else tput
            out.append(f"| {r['clients']} | {r['requests']} | {name} | {tput} "
                       f"| {_num(r['median_ttft_ms'], 0)} / {_num(r['p99_ttft_ms'], 0)} ms "
                       f"| {_num(r['median_tpot_ms'])} ms | {joules} | {rss} |")
    out.append("")
    for name, engine in served:
        by_clients = engine.get("commands_by_clients") or {}
        if len(set(by_clients.values())) > 1:  # started afresh for each level, sized for it
            out.append(f"- {name}, one start per level: " + "; ".join(
                f"{c} clients `{cmd}`" for c, cmd in sorted(by_clients.items(), key=lambda kv: int(kv[0]))))
        else:
            out.append(f"- {name}: `{engine['command']}`")
        if engine.get("version"):
            out[-1] += f" ({name} --version: {engine['version']})"
    single = goals.get("served_single_stream")
    if single:
        out.append(_single_stream_line(single))
        if (pairs := m.get("single_stream_pairs")) and pairs.get("command"):
            out[-1] += f"; the offline side: `{pairs['command']}`"
    mbu = goals.get("mbu")
    if mbu:
        out.append(f"- batch-1 decode MBU: {mbu['mbu']:.0%} of {mbu['peak_bandwidth_gbs']} GB/s read bandwidth "
                   f"measured in the same run ({'met' if mbu['met'] else 'NOT met'}: >= {mbu['goal']:.0%})")
    for key, lead in goals.items():
        if key.startswith("lead_over_"):
            ratios = ", ".join(f"{c} clients {v}x" for c, v in sorted(lead["ratio_by_clients"].items(),
                                                                       key=lambda kv: int(kv[0])))
            verdict = "met" if lead["met"] else "NOT met"
            required = lead.get("required_by_clients")
            goal = f": >= {' / '.join(f'{v}x' for v in dict.fromkeys(required.values()))}" if required else ""
            out.append(f"- lead over {key.removeprefix('lead_over_')}: {ratios} ({verdict}{goal})")
    harness = goals.get("harness_within_5pct_of_plain")
    if harness:
        ratios = ", ".join(f"{n} {r}" for n, r in harness["ratio_by_engine"].items())
        out.append(f"- harness against a plain load generator at 1 client (output tok/s ratio): {ratios} "
                   f"({'met' if harness['met'] else 'NOT met'}: within 5%)")
    if m.get("skipped"):
        out.append(f"- not run: {'; '.join(m['skipped'])}")
    profile = m.get("profile") or {}
    if profile.get("crossovers"):
        rows = ", ".join(f"{c['group'].split(' via ')[0]} {c['group'].split(', ')[1]} <= {c['max_packed_rows']}"
                         for c in profile["crossovers"])
        threads = profile.get("threads") or {}
        packed = profile.get("packed_step_rows")
        out.append(f"- machine profile (packed kernel up to N rows, then dense): {rows}; steps of <= "
                   f"{threads.get('single_thread_step_tokens', 0)} tokens on one thread"
                   + (f"; decode steps of <= {packed} rows all packed" if packed is not None else ""))
    return "\n".join(out)


def benchmarks_block(machines: list[dict[str, Any]], fleet: dict[str, Any] | None) -> str:
    del fleet  # the fleet's table stays with its prose in docs/benchmarks.md
    return "\n\n".join(machine_section(m) for m in machines) or "(no `bench machine` result kept yet)"


TARGETS: dict[str, tuple[str, Callable[[list[dict[str, Any]], dict[str, Any] | None], str]]] = {
    "README.md": ("measured", readme_block),
    "docs/benchmarks.md": ("machines", benchmarks_block),
}


def replace_block(text: str, name: str, body: str, where: str) -> str:
    pattern = re.compile(rf"(<!-- bench:{name} -->\n).*?(<!-- /bench:{name} -->)", re.S)
    if not pattern.search(text):
        raise ParameterError("files", f"{where} has no <!-- bench:{name} --> ... <!-- /bench:{name} --> block")
    return pattern.sub(lambda mt: mt.group(1) + body + "\n" + mt.group(2), text, count=1)


def render(root: Path) -> dict[Path, str]:
    """Each target file as the kept JSON says it should read."""
    machines, fleet = load_kept(root / "docs" / "results")
    out = {}
    for rel, (block, make) in TARGETS.items():
        path = root / rel
        out[path] = replace_block(path.read_text(), block, make(machines, fleet), rel)
    return out


def main(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if args.check and args.files:
        raise ParameterError("check", "--check writes nothing: give no files")
    for f in args.files:
        print(f"kept {keep(Path(f), root / 'docs' / 'results')}")
    stale = []
    for path, text in render(root).items():
        if path.read_text() != text:
            stale.append(path)
            if not args.check:
                path.write_text(text)
    verb = "out of date (run `tokenfactory bench publish`)" if args.check else "rewritten"
    for path in stale:
        print(f"{path.relative_to(root)}: {verb}", file=sys.stderr if args.check else sys.stdout)
    return 1 if args.check and stale else 0
