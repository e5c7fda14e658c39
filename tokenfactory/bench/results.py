"""Saved results: one JSON file per run (or per sweep), a baseline comparison, the planner's calibration.

A run file (schema "tokenfactory.bench.run/1"):

    {"schema", "name", "label", "status": "complete" | "partial" | "aborted", "reasons": [...],
     "config": {target, workload, load, sampling ...}, "environment": {...},
     "figures": {flat name -> number | string | null}, "failures": {"kind: message": count},
     "samples": [one object per request], "timeseries": [{"t_s", metric -> value}]}

A sweep or compare file (schema "tokenfactory.bench.set/1") is {"schema", "name", "kind", "runs": [run...]},
and a sweep's also the calibration fields below ("model", "prompt_tokens", "output_tokens", "results").

`figures` also carries `concurrency`, `output_throughput`, `power_w`, `joules_per_output_token`, and
`config` carries `model`, `prompt_tokens`, `output_tokens`, so that `tokenfactory plan --calibrate`
reads a run file as it is; `calibration_document` writes the planner's own shape for a set of runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenfactory.bench.figures import FIGURE_SPECS, display_value
from tokenfactory.types import ParameterError

RUN_SCHEMA = "tokenfactory.bench.run/1"
SET_SCHEMA = "tokenfactory.bench.set/1"
STATUSES = ("complete", "partial", "aborted")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class RunResult:
    name: str
    label: str
    status: str  # complete: every request succeeded; partial: some failed; aborted: sending stopped early
    reasons: list[str]
    config: dict[str, Any]
    environment: dict[str, Any]
    figures: dict[str, Any]
    failures: dict[str, int] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    timeseries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def is_partial(self) -> bool:
        return self.status != "complete"

    def to_json(self) -> dict[str, Any]:
        return {"schema": RUN_SCHEMA, "name": self.name, "label": self.label, "status": self.status,
                "partial": self.is_partial, "reasons": self.reasons, "config": self.config,
                "environment": self.environment, "figures": self.figures, "failures": self.failures,
                "samples": self.samples, "timeseries": self.timeseries}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "result") -> RunResult:
        if data.get("schema") != RUN_SCHEMA:
            raise ValueError(f"{where} is not a tokenfactory bench run (schema {data.get('schema')!r})")
        return cls(data.get("name", ""), data.get("label", ""), data.get("status", "complete"),
                   list(data.get("reasons") or []), dict(data.get("config") or {}),
                   dict(data.get("environment") or {}), dict(data.get("figures") or {}),
                   dict(data.get("failures") or {}), list(data.get("samples") or []),
                   list(data.get("timeseries") or []))


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ParameterError("save", f"a result name must be letters, digits, '.', '_' or '-' (no '/'), got {name!r}")
    return name


def result_path(results_dir: str | Path, name: str) -> Path:
    """NAME -> RESULTS_DIR/NAME.json; a name that is already a path to a file is used as it is."""
    as_path = Path(name).expanduser()
    if as_path.suffix == ".json" and (as_path.is_file() or "/" in name):
        return as_path
    return Path(results_dir).expanduser() / f"{check_name(name)}.json"


def save_document(document: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=1, default=_json_default) + "\n")
    tmp.replace(path)  # a reader never sees half a file
    return path


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"cannot save {type(value).__name__} as JSON")


def save_run(result: RunResult, results_dir: str | Path, name: str) -> Path:
    return save_document(result.to_json(), result_path(results_dir, name))


def save_set(runs: Sequence[RunResult], kind: str, results_dir: str | Path, name: str) -> Path:
    """The runs together; a sweep (one target) also carries the planner's calibration fields on top
    (model, prompt_tokens, results), so that `tokenfactory plan --calibrate` reads it as it is."""
    document: dict[str, Any] = {"schema": SET_SCHEMA, "name": name, "kind": kind}
    if kind == "sweep":
        try:
            document |= calibration_document(runs, None)
        except ValueError:
            pass  # no run has a throughput: nothing to calibrate with
    document["runs"] = [r.to_json() for r in runs]
    return save_document(document, result_path(results_dir, name))


def load_runs(path_or_name: str, results_dir: str | Path = "results") -> list[RunResult]:
    """The runs in a run or set file, given as a path or as a name under results_dir."""
    path = result_path(results_dir, path_or_name) if not Path(path_or_name).is_file() else Path(path_or_name)
    if not path.is_file():
        raise FileNotFoundError(f"no saved result {path_or_name!r}: {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a tokenfactory bench result (not a JSON object)")
    if data.get("schema") == SET_SCHEMA:
        return [RunResult.from_json(run, f"{path} runs[{i}]") for i, run in enumerate(data.get("runs") or [])]
    return [RunResult.from_json(data, str(path))]


# -- baseline comparison -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Change:
    name: str
    label: str
    unit: str
    baseline: Any
    current: Any
    relative: float | None  # (current - baseline) / baseline
    verdict: str  # better | worse | same | n/a


def compare_figures(baseline: dict[str, Any], current: dict[str, Any], tolerance: float = 0.01) -> list[Change]:
    """Each figure of FIGURE_SPECS that either side has, with its change and whether that is better."""
    changes = []
    for name, spec in FIGURE_SPECS.items():
        old, new = baseline.get(name), current.get(name)
        if old is None and new is None:
            continue
        relative = None
        if isinstance(old, int | float) and isinstance(new, int | float) and old != 0:
            relative = (new - old) / abs(old)
        changes.append(Change(name, spec.label, spec.unit, old, new, relative, _verdict(spec.better, old, new,
                                                                                          relative, tolerance)))
    return changes


def _verdict(better: str | None, old: Any, new: Any, relative: float | None, tolerance: float) -> str:
    if better is None or not isinstance(old, int | float) or not isinstance(new, int | float):
        return "n/a"
    if relative is None:
        if old == new:
            return "same"
        up = new > old
    else:
        if abs(relative) <= tolerance:
            return "same"
        up = relative > 0
    return "better" if up == (better == "higher") else "worse"


def render_changes(changes: Sequence[Change], baseline_name: str) -> Any:
    from rich.table import Table

    table = Table(title=f"change against baseline {baseline_name!r}")
    for col in ("figure", "unit", "baseline", "now", "change", "better is", "verdict"):
        table.add_column(col, justify="right" if col in ("baseline", "now", "change") else "left")
    colour = {"better": "green", "worse": "red"}
    for c in changes:
        spec = FIGURE_SPECS[c.name]
        change = f"{c.relative:+.1%}" if c.relative is not None else "—"
        verdict = f"[{colour[c.verdict]}]{c.verdict}[/]" if c.verdict in colour else c.verdict
        table.add_row(c.label, c.unit, display_value(c.name, c.baseline), display_value(c.name, c.current), change,
                      spec.better or "—", verdict)
    return table


# -- the planner's calibration shape -----------------------------------------------------------------------

def calibration_point(run: RunResult) -> dict[str, Any] | None:
    """One `results` row of `tokenfactory plan --calibrate` (planner/calibrate.py); None without throughput."""
    f = run.figures
    tps = f.get("output_throughput")
    if not tps:
        return None
    batch = run.config.get("load", {}).get("concurrency") or round(f.get("mean_concurrency") or 1) or 1
    if run.config.get("load", {}).get("request_rate") is not None:
        batch = max(round(f.get("mean_concurrency") or 1), 1)  # open loop: requests in flight on average
    row: dict[str, Any] = {"batch_size": int(batch), "output_tokens_per_s": tps,
                           "prompt_tokens": f.get("mean_prompt_tokens"), "output_tokens": f.get("mean_output_tokens")}
    if f.get("avg_power_w") is not None:
        row["power_w"] = f["avg_power_w"]
    return row


def calibration_document(runs: Sequence[RunResult], device: str | None) -> dict[str, Any]:
    points = [p for p in (calibration_point(r) for r in runs) if p is not None]
    if not points:
        raise ValueError("no run has an output throughput to calibrate with (did every request fail?)")
    first = runs[0].figures
    doc: dict[str, Any] = {"model": runs[0].config.get("model"),
                           "prompt_tokens": first.get("mean_prompt_tokens"),
                           "output_tokens": first.get("mean_output_tokens"), "results": points,
                           "source": "tokenfactory bench"}
    if device:
        doc["device"] = device
    return doc
