"""`--plot DIR`: PNG charts of tokens/s and J/token against batch size (matplotlib, Agg, no display)."""

from __future__ import annotations

from pathlib import Path

from tokenfactory.planner.plan import Plan


def write_plots(plan: Plan, out_dir: str | Path) -> list[Path]:
    """Write tokens_per_second.png and joules_per_token.png into `out_dir`; return their paths."""
    from matplotlib.figure import Figure  # imported here: matplotlib is slow to import

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    batches = [s.batch_size for s in plan.decode]
    title = (f"{plan.request.model.name} on {plan.request.hardware.count} x {plan.request.hardware.device.name}, "
             f"{plan.weights.label}, context {plan.request.workload.mean_context_tokens:,.0f}")
    paths = []

    fig = Figure(figsize=(8, 5), dpi=100)
    ax = fig.add_subplot()
    ax.plot(batches, [s.tokens_per_s for s in plan.decode], "o-", label="expected (memory + compute time)")
    ax.plot(batches, [s.roofline_tokens_per_s for s in plan.decode], "--", label="roofline (datasheet peaks)")
    if plan.crossover_batch is not None:
        ax.axvline(plan.crossover_batch, color="grey", linestyle=":",
                   label=f"memory/compute crossover ~{plan.crossover_batch:,.0f}")
    if plan.serving is not None:
        ax.plot([plan.effective_batch], [plan.serving.tokens_per_s], "*", markersize=14,
                label=f"serving at batch {plan.effective_batch} (with prefill)")
    ax.set(xscale="log", xlabel="batch size (concurrent sequences)", ylabel="output tokens/s per replica",
           title=title)
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(out / "tokens_per_second.png")
    fig.savefig(paths[-1])

    fig = Figure(figsize=(8, 5), dpi=100)
    ax = fig.add_subplot()
    ax.plot(batches, [s.joules_per_token for s in plan.decode], "o-", color="tab:red", label="decode")
    if plan.serving is not None:
        ax.plot([plan.effective_batch], [plan.serving.joules_per_token], "*", markersize=14,
                label=f"serving at batch {plan.effective_batch}")
    ax.set(xlabel="batch size (concurrent sequences)", ylabel="joules per output token (device)", title=title)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(out / "joules_per_token.png")
    fig.savefig(paths[-1])
    return paths
