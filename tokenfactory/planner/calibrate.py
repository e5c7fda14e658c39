"""`tokenfactory plan --calibrate RESULT.json`: fit the efficiency factors to a measured bench result.

The file (written by `tokenfactory bench`, or by hand) is JSON:

    {"device": "H100-SXM", "num_devices": 1, "model": "Llama-3.1-8B", "dtype": "bf16", "kv_dtype": "auto",
     "prompt_tokens": 512, "output_tokens": 256,
     "results": [{"batch_size": 1, "output_tokens_per_s": 95.0, "power_w": 420.0},
                 {"batch_size": 64, "output_tokens_per_s": 4100.0, "joules_per_output_token": 0.14}]}

`batch_size` may be called `mean_concurrency` (measured, preferred), `concurrency` or `max_num_seqs`;
`output_tokens_per_s` may be `output_throughput`; a result may carry its own `prompt_tokens`/
`output_tokens` (or `input_len`/`output_len`). Power is optional (`power_w` or `avg_power_w`, or
`joules_per_output_token`, from which power = J/token * tokens/s). A file with
`config` and `figures` keys is read too: `config` supplies the top-level fields and `figures` is
either the `results` list or one result.

The fit minimises the squared log error of predicted vs measured tokens/s over the bandwidth and
compute factors (a grid in log space, then a finer one around the best); a factor the points
cannot identify (its term is under 10% of every step) keeps its default. With power figures the two
power activities are fitted the same way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path
from typing import Any

from tokenfactory.planner.hardware import Efficiency, Hardware, PowerModel
from tokenfactory.planner.perf import StepModel, Workload

# Accepted spellings, first match wins; a row's measured mean concurrency beats the configured limit.
BATCH_KEYS = ("batch_size", "mean_concurrency", "concurrency", "max_num_seqs", "num_seqs")
TPS_KEYS = ("output_tokens_per_s", "output_throughput", "output_tokens_per_second", "output_throughput_tokens_per_s")
POWER_KEYS = ("power_w", "avg_power_w")
PROMPT_KEYS = ("prompt_tokens", "mean_prompt_tokens", "input_len")
OUTPUT_KEYS = ("output_tokens", "mean_output_tokens", "output_len")
IDENTIFIABLE_SHARE = 0.10


@dataclass(frozen=True)
class BenchPoint:
    batch_size: int
    output_tokens_per_s: float
    power_w: float | None = None
    prompt_tokens: float | None = None
    output_tokens: float | None = None


@dataclass(frozen=True)
class BenchResult:
    points: tuple[BenchPoint, ...]
    device: str | None = None
    num_devices: int = 1
    model: str | None = None
    dtype: str | None = None
    kv_dtype: str = "auto"
    prompt_tokens: float = 512.0
    output_tokens: float = 256.0
    path: str = ""

    def workload(self, point: BenchPoint) -> Workload:
        return Workload(point.prompt_tokens if point.prompt_tokens is not None else self.prompt_tokens,
                        point.output_tokens if point.output_tokens is not None else self.output_tokens)


def load_bench_result(path: str | Path) -> BenchResult:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--calibrate file {p} does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--calibrate file {p} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--calibrate file {p}: expected a JSON object")
    if "figures" in data or "config" in data:
        config = data.get("config") or {}
        figures = data.get("figures")
        rows = figures if isinstance(figures, list) else (figures or {}).get("results", [figures])
        data = {**config, "results": rows}
    rows = data.get("results")
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"--calibrate file {p}: needs a non-empty \"results\" list")
    points = tuple(_point(row, i, p, data) for i, row in enumerate(rows))
    return BenchResult(points=points, device=data.get("device"), num_devices=int(data.get("num_devices", 1)),
                       model=data.get("model"), dtype=data.get("dtype") or data.get("precision"),
                       kv_dtype=str(data.get("kv_dtype") or "auto"),
                       prompt_tokens=float(_first(data, PROMPT_KEYS) or 512),
                       output_tokens=float(_first(data, OUTPUT_KEYS) or 256), path=str(p))


def _first(row: Mapping[str, Any], keys: Sequence[str]) -> Any:
    return next((row[k] for k in keys if row.get(k) is not None), None)


def _point(row: Any, i: int, path: Path, top: Mapping[str, Any]) -> BenchPoint:
    if not isinstance(row, dict):
        raise ValueError(f"--calibrate file {path}: results[{i}] must be an object")
    batch = _first(row, BATCH_KEYS) or _first(top, BATCH_KEYS)
    tps = _first(row, TPS_KEYS)
    if not isinstance(batch, int | float) or batch < 0.5:
        raise ValueError(f"--calibrate file {path}: results[{i}] needs batch_size (or concurrency) >= 1")
    if not isinstance(tps, int | float) or tps <= 0:
        raise ValueError(f"--calibrate file {path}: results[{i}] needs output_tokens_per_s > 0")
    power = _first(row, POWER_KEYS)
    if power is None and row.get("joules_per_output_token") is not None:
        power = float(row["joules_per_output_token"]) * float(tps)
    prompt, output = _first(row, PROMPT_KEYS), _first(row, OUTPUT_KEYS)
    return BenchPoint(max(1, round(batch)), float(tps), float(power) if power is not None else None,
                      float(prompt) if prompt is not None else None, float(output) if output is not None else None)


@dataclass(frozen=True)
class Calibration:
    efficiency: Efficiency
    power: PowerModel
    fitted: tuple[str, ...]  # factor names fitted from the data
    kept: tuple[str, ...]  # factor names the data could not identify (defaults kept)
    rms_log_error_before: float
    rms_log_error_after: float
    predictions: tuple[tuple[BenchPoint, float, float], ...]  # point, predicted tokens/s, predicted W

    def to_toml(self, device: str, source: str, on: date | None = None) -> str:
        """An [[efficiency]] block for a --catalog file."""
        day = (on or date.today()).isoformat()[:7]
        e = self.efficiency
        lines = ["[[efficiency]]", f'device = "{device}"']
        for name in ("bandwidth", "compute"):
            if name in self.fitted:
                lines.append(f'{name} = {{ value = {getattr(e, name):.3f}, source = "calibrated from {source}", '
                             f'date = "{day}" }}')
        return "\n".join(lines) + "\n"


def _errors(hw: Hardware, steps: StepModel, result: BenchResult) -> list[float]:
    model = replace(steps, hw=hw)
    return [math.log(model.serving(p.batch_size, result.workload(p)).tokens_per_s / p.output_tokens_per_s)
            for p in result.points]


def _loss(errors: Sequence[float]) -> float:
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def _grid(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def calibrate(result: BenchResult, steps: StepModel) -> Calibration:
    """Fit bandwidth/compute (and, with power figures, the power activities) of `steps.hw`."""
    hw = steps.hw
    base = hw.efficiency
    shares = [replace(steps, hw=hw).serving(p.batch_size, result.workload(p)) for p in result.points]
    mem_share = max(s.memory_s / s.seconds for s in shares)
    comp_share = max(s.compute_s / s.seconds for s in shares)
    fit_bw, fit_comp = mem_share >= IDENTIFIABLE_SHARE, comp_share >= IDENTIFIABLE_SHARE
    before = _loss(_errors(hw, steps, result))
    best = (before, base.bandwidth, base.compute)
    for lo_hi, n in (((0.02, 1.0), 41), (None, 21)):
        if lo_hi is None:  # refine: +-15% around the best so far
            bws = _grid(max(0.01, best[1] / 1.15), min(1.0, best[1] * 1.15), n) if fit_bw else [base.bandwidth]
            cps = _grid(max(0.01, best[2] / 1.15), min(1.0, best[2] * 1.15), n) if fit_comp else [base.compute]
        else:
            bws = _grid(*lo_hi, n) if fit_bw else [base.bandwidth]
            cps = _grid(*lo_hi, n) if fit_comp else [base.compute]
        for bw in bws:
            for cp in cps:
                trial = hw.with_efficiency(replace(base, bandwidth=bw, compute=cp))
                loss = _loss(_errors(trial, steps, result))
                if loss < best[0]:
                    best = (loss, bw, cp)
    fitted_hw = hw.with_efficiency(replace(base, bandwidth=best[1], compute=best[2],
                                           source=f"calibrated from {result.path or 'a bench result'}"))
    power, power_fitted = _fit_power(fitted_hw, steps, result)
    fitted_hw = replace(fitted_hw, power=power)
    final = replace(steps, hw=fitted_hw)
    predictions = tuple((p, final.serving(p.batch_size, result.workload(p)).tokens_per_s,
                         final.serving(p.batch_size, result.workload(p)).power_w) for p in result.points)
    names = [("bandwidth", fit_bw), ("compute", fit_comp)]
    fitted = tuple(n for n, ok in names if ok) + power_fitted
    kept = tuple(n for n, ok in names if not ok)
    return Calibration(fitted_hw.efficiency, power, fitted, kept, before, best[0], predictions)


def _fit_power(hw: Hardware, steps: StepModel, result: BenchResult) -> tuple[PowerModel, tuple[str, ...]]:
    measured = [p for p in result.points if p.power_w]
    if not measured:
        return hw.power, ()
    model = replace(steps, hw=hw)

    def loss(power: PowerModel) -> float:
        trial = replace(model, hw=replace(hw, power=power))
        return _loss([math.log(trial.serving(p.batch_size, result.workload(p)).power_w / p.power_w)
                      for p in measured])

    best = (loss(hw.power), hw.power)
    for mem in _grid(0.05, 1.2, 30):
        for comp in _grid(0.05, 1.2, 30):
            candidate = PowerModel(mem, comp)
            value = loss(candidate)
            if value < best[0]:
                best = (value, candidate)
    return best[1], ("memory_bound_activity", "compute_bound_activity")
