"""The closing note's simulated day (docs/simulator.md): `tokenfactory simulate --json` outputs in, a markdown
table and one PNG of replicas and TTFT p99 over the day for every run out.

    python scripts/simulated_day_table.py OUT.png day.json static64.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table(runs: list[dict]) -> str:
    lines = ["| run | replicas min/mean/max | TTFT p50/p99 s | TPOT p50/p99 ms | SLO attainment | J/token | kWh/Mtok "
             "| $/Mtok (rent) | scale changes | sim wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['label']} | {r['replicas_min']}/{r['replicas_mean']:.1f}/{r['replicas_max']} | "
                     f"{r['ttft_p50_s']:.3f}/{r['ttft_p99_s']:.3f} | {1000 * r['tpot_p50_s']:.1f}/"
                     f"{1000 * r['tpot_p99_s']:.1f} | {100 * r['slo_attainment']:.2f}% | {r['joules_per_token']:.3f} | "
                     f"{r['kwh_per_mtok']:.4f} | {r['usd_per_mtok']:.3f} | {r['scale_changes']} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def plot(runs: list[dict], path: str, period_h: float = 1.0) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7), dpi=100)
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    hour = 24 / period_h / 3600  # seconds of the compressed day -> hours of a day
    for r in runs:
        t = [s["time_s"] * hour for s in r["timeline"]]
        top.step(t, [s["replicas"] for s in r["timeline"]], where="post", label=r["label"])
        bottom.plot(t, [s["ttft_p99_s"] for s in r["timeline"]], label=r["label"])
    rate = top.twinx()
    rate.plot([s["time_s"] * hour for s in runs[0]["timeline"]], [s["arrivals_per_s"] for s in runs[0]["timeline"]],
              color="grey", alpha=0.4)
    rate.set_ylabel("arrivals/s (grey)")
    top.set_ylabel("replicas provisioned")
    top.legend(fontsize=7, loc="upper left")
    top.set_title("Llama-3.1-8B on H100-SXM replicas, diurnal day compressed to 1 h (delays and cold start x 1/24)")
    bottom.set_ylabel("TTFT p99 per 15 s sample, s")
    bottom.set_yscale("log")
    bottom.axhline(2.0, color="red", linestyle=":")
    bottom.set_xlabel("hour of the (compressed) day")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    out, *inputs = sys.argv[1:]
    everything = [run for name in inputs for run in json.loads(Path(name).read_text())]
    print(table(everything))
    plot(everything, out)
