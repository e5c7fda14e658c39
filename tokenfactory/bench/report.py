"""`tokenfactory bench report RESULT... --out DIR`: PNG charts and an HTML page from saved results.

    throughput_vs_concurrency.png   output tokens/s against requests in flight, one line per target
    latency_percentiles.png         p50 / p90 / p99 of TTFT, TPOT, ITL and E2E latency, per target
    joules_per_token.png            J per output token against requests in flight (labelled by source)
    ttft_cdf.png                    the distribution of time to first token, per target
    index.html                      the four side by side, and a table of every run

RESULT is a saved name (under --results-dir) or a path; run, sweep and compare files all work. Runs
are grouped by their label (the target). Latency bars and the CDF use each target's run at the highest
concurrency all targets share (else each target's last run). Partial runs are drawn, and marked.
"""

from __future__ import annotations

import argparse
import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHARTS = ("throughput_vs_concurrency.png", "latency_percentiles.png", "joules_per_token.png", "ttft_cdf.png")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", metavar="RESULT", help="saved result names or JSON paths")
    parser.add_argument("--out", required=True, help="directory for the PNGs and index.html")
    parser.add_argument("--results-dir", default="results", help="where RESULT names are looked up")
    parser.add_argument("--title", default="tokenfactory bench report")


def group_by_label(runs: Sequence[Any]) -> dict[str, list[Any]]:
    groups: dict[str, list[Any]] = {}
    for run in runs:
        groups.setdefault(run.label or run.name or "run", []).append(run)
    for label in groups:
        groups[label].sort(key=_concurrency)
    return groups


def _concurrency(run: Any) -> float:
    c = run.figures.get("concurrency") or run.config.get("load", {}).get("concurrency")
    return float(c) if c is not None else float(run.figures.get("mean_concurrency") or 0.0)


def reference_runs(groups: dict[str, list[Any]]) -> dict[str, Any]:
    """Per target: the run at the highest concurrency every target has, else its last run."""
    shared = set.intersection(*({_concurrency(r) for r in runs} for runs in groups.values())) if groups else set()
    if shared:
        level = max(shared)
        return {label: next(r for r in runs if _concurrency(r) == level) for label, runs in groups.items()}
    return {label: runs[-1] for label, runs in groups.items()}


def _display(label: str, run: Any) -> str:
    return label if run.status == "complete" else f"{label} ({run.status})"


def chart_lines(ax: Any, groups: dict[str, list[Any]], figure: str, ylabel: str) -> bool:
    """One line per target of `figure` against concurrency; False when no run has the figure."""
    drawn = False
    for label, runs in groups.items():
        points = [(_concurrency(r), r.figures.get(figure)) for r in runs if r.figures.get(figure) is not None]
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        partial = any(r.is_partial for r in runs)
        ax.plot(xs, ys, marker="o", linestyle="--" if partial else "-", label=label + (" (partial)" if partial else ""))
        drawn = True
    ax.set_xlabel("requests in flight (concurrency)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend()
        xs = sorted({_concurrency(r) for runs in groups.values() for r in runs})
        if xs and xs[-1] / max(xs[0], 1e-9) >= 8:
            ax.set_xscale("log", base=2)
    return drawn


def chart_latency(ax: Any, refs: dict[str, Any]) -> None:
    import numpy as np

    metrics = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))
    stats = ("median", "p90", "p99")
    width = 0.8 / max(len(refs) * len(stats), 1)
    x = np.arange(len(metrics))
    for i, (label, run) in enumerate(refs.items()):
        for j, stat in enumerate(stats):
            values = [run.figures.get(f"{stat}_{key}_ms") or np.nan for key, _ in metrics]
            offset = (i * len(stats) + j) * width - 0.4 + width / 2
            ax.bar(x + offset, values, width, label=f"{_display(label, run)} {stat}", alpha=1.0 - 0.25 * j,
                   color=f"C{i}")
    ax.set_xticks(x, [name for _, name in metrics])
    ax.set_ylabel("milliseconds (log scale)")
    ax.set_yscale("log")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small", ncol=max(len(refs), 1))


def chart_ttft_cdf(ax: Any, refs: dict[str, Any]) -> bool:
    drawn = False
    for label, run in refs.items():
        ttfts = sorted(s["ttft_s"] * 1000 for s in run.samples if s.get("success") and s.get("ttft_s") is not None)
        if not ttfts:
            continue
        fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        ax.step([ttfts[0], *ttfts], [0.0, *fractions], where="post", label=_display(label, run))
        drawn = True
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend()
    return drawn


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in these results", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def energy_label(groups: dict[str, list[Any]]) -> str:
    sources = sorted({f"{r.figures.get('energy_source')} ({r.figures.get('energy_origin')})"
                      for runs in groups.values() for r in runs if r.figures.get("energy_source")})
    return "J per output token" + (f" — source: {', '.join(sources)}" if sources else "")


def draw_charts(runs: Sequence[Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    groups = group_by_label(runs)
    refs = reference_runs(groups)
    paths = []
    for name in CHARTS:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        if name == "throughput_vs_concurrency.png":
            ax.set_title("output throughput")
            if not chart_lines(ax, groups, "output_throughput", "output tokens / s"):
                _no_data(ax, "throughput")
        elif name == "latency_percentiles.png":
            ax.set_title("latency percentiles at concurrency "
                         + ", ".join(sorted({f"{_concurrency(r):g}" for r in refs.values()})))
            chart_latency(ax, refs)
        elif name == "joules_per_token.png":
            ax.set_title(energy_label(groups), fontsize="small")
            if not chart_lines(ax, groups, "joules_per_output_token", "J / output token"):
                _no_data(ax, "energy figures")
        else:
            ax.set_title("TTFT distribution")
            if not chart_ttft_cdf(ax, refs):
                _no_data(ax, "successful requests")
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


TABLE_COLUMNS = (("concurrency", "in flight"), ("completed", "done"), ("failed", "failed"),
                 ("request_throughput", "req/s"), ("output_throughput", "out tok/s"),
                 ("median_ttft_ms", "median TTFT ms"), ("median_tpot_ms", "median TPOT ms"),
                 ("p99_e2el_ms", "p99 E2E ms"), ("server_rss_peak_bytes", "peak RSS MiB"),
                 ("avg_power_w", "W"), ("joules_per_output_token", "J/tok"),
                 ("usd_per_million_output_tokens", "USD/M tok"))


def render_html(runs: Sequence[Any], title: str) -> str:
    from tokenfactory.bench.figures import display_value

    header = "".join(f"<th>{html.escape(h)}</th>" for h in ("target", *(h for _, h in TABLE_COLUMNS),
                                                            "energy source", "status"))
    rows = []
    for run in runs:
        cells = [html.escape(run.label)] + [html.escape(display_value(k, run.figures.get(k))) for k, _ in TABLE_COLUMNS]
        cells += [html.escape(str(run.figures.get("energy_source") or "—")),
                  html.escape(run.status + (": " + "; ".join(run.reasons) if run.reasons else ""))]
        css = "" if run.status == "complete" else ' class="partial"'
        rows.append(f"<tr{css}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    images = "".join(f'<figure><img src="{name}" alt="{name}"><figcaption>{name}</figcaption></figure>'
                     for name in CHARTS)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
.grid {{ display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 1em; }}
figure {{ margin: 0; }} img {{ width: 100%; border: 1px solid #ddd; }}
table {{ border-collapse: collapse; margin-top: 1.5em; font-size: 0.9em; }}
td, th {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }}
td:first-child, td:last-child {{ text-align: left; }} tr.partial {{ background: #fff4d6; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<div class="grid">{images}</div>
<table><tr>{header}</tr>{"".join(rows)}</table>
<p>Figures as defined in docs/bench.md (vllm bench serve's definitions). Rows shaded: partial or aborted runs.</p>
</body></html>
"""


def write_report(runs: Sequence[Any], out: str | Path, title: str = "tokenfactory bench report") -> Path:
    """Charts and index.html under `out`; returns the HTML page's path."""
    if not runs:
        raise ValueError("no runs to report")
    out = Path(out).expanduser()
    draw_charts(runs, out)
    page = out / "index.html"
    page.write_text(render_html(runs, title))
    return page


def main(args: argparse.Namespace) -> int:
    from tokenfactory.bench.results import load_runs

    runs = [run for name in args.results for run in load_runs(name, args.results_dir)]
    page = write_report(runs, args.out, args.title)
    print(f"report: {page} ({len(runs)} runs, {len(group_by_label(runs))} targets)")
    return 0
