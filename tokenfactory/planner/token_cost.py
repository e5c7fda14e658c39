"""What a number of tokens costs in joules and dollars (`tokenfactory tokens`), labelled by where the rate came
from: a running server's recent rate, read from its /metrics, or the planner's model of this model on a catalog
device, priced with the meter's price list.

    server    J/token = Δ busy device joules / Δ tokens computed (prefill and decode)      over the window
              $/token = Δ cost_usd / Δ (prompt + generation tokens of finished requests)  (totals since start-up
                                                                                            when the window is idle)
    modelled  as a prompt:  one prefill of N tokens,  J = P · t  (planner/perf.py StepModel.prefill)
              as output:    N decode steps of one stream at the mean context,  J = N · P · t(decode)
              $ = t / 3600 · usd_per_device_hour + J · psu_loss · pue / 3.6e6 · usd_per_kwh  (meter/prices.py)

A figure the source cannot give is None, never 0; the server's energy keeps its meter's source label (nvml,
rapl, modelled).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenfactory.planner.live import Window


@dataclass(frozen=True)
class TokenCost:
    source: str  # "server" | "modelled"
    basis: str  # what the rate measures, in words
    num_tokens: int
    joules_per_token: float | None
    usd_per_token: float | None
    energy_source: str | None  # the server meter's source label (nvml, rapl, modelled); "modelled" for the planner

    @property
    def joules(self) -> float | None:
        return None if self.joules_per_token is None else self.joules_per_token * self.num_tokens

    @property
    def usd(self) -> float | None:
        return None if self.usd_per_token is None else self.usd_per_token * self.num_tokens

    def to_dict(self) -> dict[str, object]:
        return {**self.__dict__, "joules": self.joules, "usd": self.usd}


def server_cost(window: Window, num_tokens: int) -> TokenCost:
    """The server's rate over the window; where no token was computed in it, the totals since start-up."""
    if window.before is not None and not window.delta("device_tokens_total"):
        window = Window(window.after)
    since = f"over the last {window.seconds:.1f} s" if window.before is not None else "since the server started"
    sources = window.after.label_values("device_energy_joules_total", "source")
    energy_source = sources[0] if len(sources) == 1 else None
    joules = window.delta("device_energy_joules_total", state="busy") if energy_source else None
    computed = window.delta("device_tokens_total")
    usd = window.delta("cost_usd_total")
    billed = sum(v for v in (window.delta("prompt_tokens_total"), window.delta("generation_tokens_total"))
                 if v is not None)
    return TokenCost(
        source="server", basis=f"the server's average per token computed (prefill and decode), {since}",
        num_tokens=num_tokens, joules_per_token=joules / computed if joules is not None and computed else None,
        usd_per_token=usd / billed if usd is not None and billed else None, energy_source=energy_source)


def modelled_costs(model: str | Path, num_tokens: int, device_name: str | None = None,
                   catalog_paths: tuple[str, ...] = ()) -> tuple[str, list[TokenCost]]:
    """(the catalog device used, [as a prompt, as output]) for `model` (a .gguf file or config.json/folder)."""
    from tokenfactory.meter.prices import load_prices
    from tokenfactory.planner.catalog import load_catalog
    from tokenfactory.planner.hardware import hardware_from_catalog
    from tokenfactory.planner.memory import resolve_weights
    from tokenfactory.planner.modelsrc import load_model
    from tokenfactory.planner.perf import StepModel
    from tokenfactory.planner.precision import parse_kv_dtype

    catalog = load_catalog(list(catalog_paths))
    names = catalog.device_names()
    device = catalog.device(device_name or next((n for n in names if n.lower().startswith("cpu")), names[0]))
    spec = load_model(str(model), catalog)
    weights = resolve_weights(spec, None)
    steps = StepModel(hardware_from_catalog(catalog, device), spec, weights, parse_kv_dtype("auto", weights.precision))
    prices = load_prices(device_name=device.name, device_type="cpu" if device.kind == "cpu" else "cuda")
    n = max(num_tokens, 1)
    prefill = steps.prefill(n)
    decode = steps.decode(1, n / 2)  # one stream, at the mean context of its N tokens

    def per_token(seconds: float, joules: float) -> tuple[float, float]:
        usd = prices.device_cost_usd(seconds) + prices.energy_cost_usd(joules)
        return joules / n, usd / n

    as_prompt = per_token(prefill.seconds, prefill.power_w * prefill.seconds)
    as_output = per_token(n * decode.seconds, n * decode.power_w * decode.seconds)
    label = f"the planner's model on {device.name}, priced as {prices.device.profile} ({prices.device.basis})"
    return device.name, [
        TokenCost("modelled", f"as a prompt (one prefill), {label}", num_tokens, *as_prompt, "modelled"),
        TokenCost("modelled", f"as output (one stream, batch 1), {label}", num_tokens, *as_output, "modelled")]
