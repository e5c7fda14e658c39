"""The machine profile: the engine's speed choices measured on this machine, for this model's shapes.

Two choices decide a CPU's small-step speed, and both moved between the CPUs we measured (issue 21): at how
many rows a quantized layer leaves its packed kernel for the dense matmul (int8 packed won up to 10 rows on a
Zen 4 and up to 4 on a Sapphire Rapids), and whether steps of a few tokens run faster on one thread. Constants
chosen on one CPU were wrong on the other, so the engine measures them at its first start:

    crossovers   per group of quantized layers sharing (format, kernel, shape, dense path): the packed and
                 the dense path timed at 1, 2, 4, ... 64 rows, each layer (up to 30 a group) where a step
                 runs it, in the model's whole stack of quantized layers on one path (so its weights come
                 back from wherever the rest of a step left them); the layer takes the packed kernel up to
                 the largest row count before the dense path first wins
    threads      the model's whole stack of linear layers (each on the path just chosen) at 1, 2, 4, 8 rows,
                 on one thread and on all, while a second Python thread does what a streaming gateway does
                 (a little work every millisecond); steps that are 10% faster on one thread take one
    steps        how many rows a decode step may have and still run faster with every decoder layer packed
                 than with each at its crossover: whole steps, timed by the engine's warm-up (`LLMEngine.
                 _time_packed_step_rows`) and added to the cached profile (`with_packed_step_rows`)

`load_or_measure` keys the profile by the CPU's name and flags, torch's version, the thread count, the
model's layer shapes and the compiled kernels' sources, and caches it as JSON (`~/.cache/tokenfactory/profiles`, or
`$TOKENFACTORY_PROFILE_CACHE`), so only the first start pays (about 6 s for the bundled model on 2 cores).
`tokenfactory doctor --machine` prints it; `serve --machine-profile remeasure` and `doctor --machine
--remeasure` measure again; `off` keeps the constants (layers/quant.py KERNELS, one thread policy for all).
Measure on a quiet machine: the profile is what the engine then believes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenfactory.engine.placement import release_freed_memory
from tokenfactory.layers import cpu_kernels
from tokenfactory.layers.quant import QuantizedLinear
from tokenfactory.types import ParameterError

logger = logging.getLogger(__name__)

PROFILE_VERSION = 5  # 2: dense paths named by their class (on-the-fly from the packed codes is its own group);
# 3: crossovers timed against `dense_linear`; 4: the prepacked dense copy (oneDNN's layout) is its own group;
# 5: crossovers timed in the model's stack order (`measure_crossovers`)
MODES = ("auto", "remeasure", "off")
DENSE_NAMES = {"PrepackedCopy": "prepacked", "DenseCopy": "copy", "DequantizeOnTheFly": "on-the-fly",
               "DequantizeFromPacked": "from-packed"}
ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
THREAD_ROWS = (1, 2, 4, 8)
MAX_LAYERS_PER_GROUP = 30
ONE_THREAD_GAIN = 1.10  # one thread must be this much faster to be chosen: a tie keeps all threads
MAX_PASSES = 4  # timings are repeated until a pass lowers no minimum by more than STEADY_TOLERANCE
STEADY_TOLERANCE = 0.15
UNSTEADY_KEEP_S = 600  # an unsteady profile is reused this long (replicas starting together), then measured again
RELEVANT_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile",
                  "avx_vnni", "fma", "f16c", "asimd", "sve", "sve2", "bf16", "i8mm")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ParameterError("machine_profile", f"machine_profile must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


@dataclass(frozen=True)
class Crossover:
    """One group of quantized layers: where its packed kernel stops winning."""

    group: str  # "int4-g32 via cpu-int4pack, 576x1536, copy"
    num_layers: int
    default_rows: int  # the constant it replaces (layers/quant.py KERNELS)
    max_packed_rows: int  # measured
    rows: list[int]
    packed_us: list[float]  # per layer, best of the repeats, at `rows`
    dense_us: list[float]


@dataclass(frozen=True)
class ThreadPolicy:
    max_threads: int
    single_thread_step_tokens: int  # steps of at most this many tokens run on one thread (0: never)
    rows: list[int]
    one_thread_ms: list[float]  # the model's linear stack, per step
    all_threads_ms: list[float]


@dataclass(frozen=True)
class MachineProfile:
    key: dict[str, Any]
    measured_at: str
    measure_s: float
    crossovers: list[Crossover]
    threads: ThreadPolicy | None
    source: str = "measured"  # "measured" now, or "cached" (read from `path`)
    path: str | None = None
    stable: bool = True  # False: the timings never settled (a busy machine); reused only UNSTEADY_KEEP_S
    packed_step_rows: int | None = None  # decode steps of up to this many rows keep every decoder layer packed
    # (whole steps timed at the engine's warm-up, `with_packed_step_rows`); None: not timed yet
    packed_steps_ms: list[list[float]] = field(default_factory=list)  # [rows, packed ms, crossovers' ms] a step

    def to_json(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any], path: Path) -> MachineProfile:
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r}, expected {PROFILE_VERSION}")
        crossovers = [Crossover(**c) for c in data["crossovers"]]
        if any(not 0 <= c.max_packed_rows <= max(ROWS) for c in crossovers):
            raise ValueError("a crossover is out of range")
        threads = ThreadPolicy(**data["threads"]) if data.get("threads") else None
        rows = data.get("packed_step_rows")
        if rows is not None and not 0 <= int(rows) <= max(ROWS):
            raise ValueError("the packed step limit is out of range")
        return cls(data["key"], data["measured_at"], float(data["measure_s"]), crossovers, threads, "cached",
                   str(path), bool(data.get("stable", True)), None if rows is None else int(rows),
                   [[float(x) for x in row] for row in data.get("packed_steps_ms", [])])

    def summary(self) -> dict[str, Any]:
        """The choices, without the timings (for /machine-profile, the benchmark JSON, the engine's info)."""
        return {"source": self.source, "stable": self.stable, "measured_at": self.measured_at, "path": self.path,
                "cpu": self.key.get("cpu"), "flags": self.key.get("flags"), "torch": self.key.get("torch"),
                "threads": self.key.get("threads"),
                "max_packed_rows": {c.group: c.max_packed_rows for c in self.crossovers},
                "single_thread_step_tokens": self.threads.single_thread_step_tokens if self.threads else None,
                "packed_step_rows": self.packed_step_rows}

    def describe(self) -> list[str]:
        """Lines for `tokenfactory doctor --machine`."""
        k = self.key
        lines = [f"machine profile ({self.source} {self.measured_at}, {self.measure_s:.1f} s to measure"
                 + (f"; {self.path}" if self.path else "")
                 + ("" if self.stable else "; timings unsteady: measured again after "
                                           f"{UNSTEADY_KEEP_S} s, measure on a quiet machine") + ")",
                 f"  cpu      {k.get('cpu')}  [{' '.join(k.get('flags', []))}]",
                 f"  torch    {k.get('torch')}, {k.get('threads')} threads"]
        for c in self.crossovers:
            pairs = "  ".join(f"{r}:{p:.0f}/{d:.0f}" for r, p, d in zip(c.rows, c.packed_us, c.dense_us, strict=True))
            lines.append(f"  {c.group} x{c.num_layers}: packed for <= {c.max_packed_rows} rows "
                         f"(constant {c.default_rows}); us per layer packed/dense at rows {pairs}")
        if self.threads:
            t = self.threads
            pairs = "  ".join(f"{r}:{a:.2f}/{b:.2f}" for r, a, b in zip(t.rows, t.one_thread_ms, t.all_threads_ms,
                                                                       strict=True))
            lines.append(f"  threads  steps of <= {t.single_thread_step_tokens} tokens on one thread "
                         f"(0: all {t.max_threads} always); linear stack ms 1/{t.max_threads} threads at rows {pairs}")
        if self.packed_step_rows is not None:
            pairs = "  ".join(f"{r:.0f}:{p:.2f}/{f:.2f}" for r, p, f in self.packed_steps_ms)
            lines.append(f"  steps    decode steps of <= {self.packed_step_rows} rows keep every decoder layer packed"
                         + (f"; step ms packed/at the crossovers at rows {pairs}" if pairs else ""))
        return lines


# ---------------------------------------------------------------------------------------------------
# Identity and cache


def cpu_identity() -> tuple[str, list[str]]:
    """The CPU's model name and the instruction-set flags that change which kernel is fastest."""
    name, flags = platform.processor() or platform.machine(), set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                name = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return name, sorted(f for f in RELEVANT_FLAGS if f in flags)


def layer_groups(model: nn.Module) -> dict[str, list[QuantizedLinear]]:
    """Quantized layers with a packed kernel, grouped by what decides their speed."""
    groups: dict[str, list[QuantizedLinear]] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.packed is not None:
            dense = DENSE_NAMES.get(type(module.dense).__name__, type(module.dense).__name__)
            name = (f"{module.format_name} via {module.kernel_name}, {module.out_features}x{module.in_features}, "
                    f"{dense}")
            groups.setdefault(name, []).append(module)
    return groups


# The OpenMP runtime's settings that change how fast a team runs (read once, as the runtime loads): a profile
# timed under one of them is not this machine's under another. GOMP_SPINCOUNT=100, set for one experiment, made
# two threads slower than one; cached under the plain key, every later start decoded on one thread, 2x slower.
OPENMP_TIMING_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY",
                     "OMP_DYNAMIC", "KMP_BLOCKTIME", "KMP_AFFINITY")


def profile_key(model: nn.Module, device: torch.device) -> dict[str, Any]:
    cpu, flags = cpu_identity()
    shapes = sorted((name, len(mods)) for name, mods in layer_groups(model).items())
    linears = sorted({(m.out_features, m.in_features) for m in model.modules() if isinstance(m, nn.Linear)})
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # the dense path multiplies in it
    key = {"cpu": cpu, "flags": flags, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "device": device.type, "dtype": dtype, "groups": shapes, "dense_linears": linears,
           "kernels": cpu_kernels.source_digest()}
    openmp = {name: os.environ[name] for name in OPENMP_TIMING_ENV if name in os.environ}
    if openmp:  # only where one is set: the profiles cached under the plain key stay theirs
        key["openmp"] = openmp
    return key


def cache_root() -> Path:
    return Path(os.environ.get("TOKENFACTORY_PROFILE_CACHE") or Path.home() / ".cache" / "tokenfactory" / "profiles")


def profile_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / f"{digest}.json"


def load_or_measure(model: nn.Module, device: torch.device, mode: str = "auto") -> MachineProfile | None:
    """The profile for this machine and model: cached, or measured now (and cached); None for "off" or a
    device other than the CPU (CUDA keeps the constants: its kernels were not measured here)."""
    if check_mode(mode) == "off" or device.type != "cpu":
        return None
    key = profile_key(model, device)
    path = profile_path(key)
    # Replicas starting together on one machine take turns: the first measures (alone, not against the others)
    # and caches; the rest read what it found, so they run the same kernel choices.
    with _measuring_lock(path):
        return _load_or_measure(model, key, path, mode)


def _load_or_measure(model: nn.Module, key: dict[str, Any], path: Path, mode: str) -> MachineProfile:
    if mode == "auto" and path.is_file():
        try:
            profile = MachineProfile.from_json(json.loads(path.read_text()), path)
            fresh = profile.stable or time.time() - path.stat().st_mtime < UNSTEADY_KEEP_S
            if profile.key == json.loads(json.dumps(key)) and fresh:
                return profile
            if profile.key != json.loads(json.dumps(key)):
                logger.warning("machine profile %s is for another machine or model; measuring again", path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("machine profile %s is unreadable (%s); measuring again", path, e)
    profile = measure(model, key)
    if not profile.stable:  # kept a while, so engines starting together still share one set of kernel choices
        logger.warning("machine profile: the timings did not settle in %d passes (is something else running?); "
                       "using them, and a start more than %d s from now measures again", MAX_PASSES, UNSTEADY_KEEP_S)
    return replace(profile, path=str(path)) if _save(profile, path) else profile


@contextmanager
def _measuring_lock(path: Path) -> Iterator[None]:
    """An exclusive lock beside the profile's file (none where the cache cannot be created)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.with_suffix(".lock").open("a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _save(profile: MachineProfile, path: Path) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(profile.to_json(), indent=1))
        tmp.replace(path)
        return True
    except OSError as e:
        logger.warning("machine profile not cached (%s): the next start measures again", e)
        return False


def with_packed_step_rows(profile: MachineProfile, rows: int, steps_ms: list[list[float]]) -> MachineProfile:
    """The profile with the packed step limit the engine timed (`LLMEngine.warmup`), cached beside the rest."""
    timed = replace(profile, packed_step_rows=rows, packed_steps_ms=steps_ms)
    if profile.path is not None:
        with _measuring_lock(Path(profile.path)):
            _save(replace(timed, source="measured", path=None), Path(profile.path))
    return timed


def apply(model: nn.Module, profile: MachineProfile) -> None:
    """Set each quantized layer's crossover from the profile."""
    measured = {c.group: c.max_packed_rows for c in profile.crossovers}
    for name, mods in layer_groups(model).items():
        if name in measured:
            for m in mods:
                m.max_packed_rows = measured[name]


# ---------------------------------------------------------------------------------------------------
# Measuring


def measure(model: nn.Module, key: dict[str, Any]) -> MachineProfile:
    start = time.perf_counter()
    with torch.inference_mode():
        crossovers, crossovers_stable = measure_crossovers(model)
        apply(model, MachineProfile(key, "", 0.0, crossovers, None))
        threads, threads_stable = measure_threads(model) if torch.get_num_threads() > 1 else (None, True)
    release_freed_memory()  # the timing runs' outputs and dequantized weights: not the server's steady memory
    elapsed = time.perf_counter() - start
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    stable = threads_stable and crossovers_stable
    logger.info("machine profile measured in %.1f s%s", elapsed, "" if stable else " (timings unsteady)")
    return MachineProfile(key, stamp, round(elapsed, 2), crossovers, threads, stable=stable)


def _best_us(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def steady_minimum(measure_pass: Callable[[], list[float]]) -> tuple[list[float], bool]:
    """Elementwise minimum over passes of `measure_pass` (contention only ever adds time), until a pass lowers no
    point by more than STEADY_TOLERANCE; False when MAX_PASSES did not get there (a busy machine)."""
    best = measure_pass()
    for _ in range(MAX_PASSES - 1):
        again = measure_pass()
        steady = all(b <= a * (1 + STEADY_TOLERANCE) for a, b in zip(again, best, strict=True))
        best = [min(a, b) for a, b in zip(again, best, strict=True)]
        if steady:
            return best, True
    return best, False


def measure_crossovers(model: nn.Module, repeats: int = 2) -> tuple[list[Crossover], bool]:
    """Packed against dense for every group at once, each layer timed where a step runs it: the model's whole stack
    of quantized layers in its order, all on one path, so that a layer's weights come back from wherever the rest of
    a step left them. Timed alone, a group's dense copy stayed in a large L3 between repeats and looked twice as fast
    as in a step (a Xeon with 480 MiB of L3: crossovers of 8 rows where whole steps are faster packed up to 16).
    Rows up to two past the first where the dense path wins in any group; passes repeat until steady (whether they
    were, second)."""
    groups = layer_groups(model)
    if not groups:  # nothing packed (a dense model): no crossover to choose
        return [], True
    timed = {id(m): name for name, mods in groups.items() for m in mods[:MAX_LAYERS_PER_GROUP]}
    order = [(timed[id(m)], m) for m in model.modules() if id(m) in timed]
    counts = {name: min(len(mods), MAX_LAYERS_PER_GROUP) for name, mods in groups.items()}  # layers timed a group
    stacks = [_timed_stack(order, t) for t in ROWS]
    for stack in stacks[:2]:  # warm: first-call allocations, the kernels' own set-up
        stack(True)
        stack(False)

    def one_pass(upto: int) -> list[float]:
        """Per group and row count: packed then dense us per layer, best of the repeats."""
        times = []
        for stack in stacks[:upto]:
            best = {path: {name: float("inf") for name in groups} for path in (True, False)}
            for _ in range(repeats):
                for path in (True, False):
                    for name, seconds in stack(path).items():
                        best[path][name] = min(best[path][name], seconds)
            times += [best[path][name] * 1e6 / counts[name] for name in groups for path in (True, False)]
        return times

    def split(times: list[float], k: int, path: int) -> list[float]:
        """Group k's per-layer times on one path (0: packed, 1: dense) at each timed row count."""
        return times[2 * k + path::2 * len(groups)]

    first = one_pass(len(ROWS))
    upto = max(_rows_needed(split(first, k, 0), split(first, k, 1)) for k in range(len(groups)))
    times, steady = steady_minimum(lambda: one_pass(upto))
    times = [min(a, b) for a, b in zip(times, first, strict=False)]
    rows = list(ROWS[:upto])
    crossovers = []
    for k, (name, mods) in enumerate(groups.items()):
        packed_us, dense_us = [round(t, 1) for t in split(times, k, 0)], [round(t, 1) for t in split(times, k, 1)]
        crossovers.append(Crossover(name, len(mods), mods[0].max_packed_rows,
                                    choose_crossover(rows, packed_us, dense_us), rows, packed_us, dense_us))
    return crossovers, steady


def _timed_stack(order: list[tuple[str, QuantizedLinear]], t: int) -> Callable[[bool], dict[str, float]]:
    """The layers in `order` at t rows, all packed (True) or all dense: seconds spent in each group."""
    xs = [torch.randn(t, m.in_features, dtype=torch.bfloat16) for _, m in order]
    dtype = order[0][1]._dense_fn().dtype if order else torch.bfloat16  # what the dense path multiplies in
    dense_xs = [x.to(dtype) for x in xs]

    def run(packed: bool) -> dict[str, float]:
        spent: dict[str, float] = dict.fromkeys((name for name, _ in order), 0.0)
        for (name, m), x, dx in zip(order, xs, dense_xs, strict=True):
            start = time.perf_counter()
            if packed:
                m._packed_fn(x)  # type: ignore[misc]
            else:
                m.dense_linear(dx)
            spent[name] += time.perf_counter() - start
        return spent
    return run


def _rows_needed(packed: list[float], dense: list[float]) -> int:
    """How many of ROWS to time again: up to two past the first where dense wins (all when it never does)."""
    first_loss = next((i for i, (p, d) in enumerate(zip(packed, dense, strict=True)) if d <= p), len(ROWS))
    return min(len(ROWS), first_loss + 3)


def choose_crossover(rows: list[int], packed_us: list[float], dense_us: list[float]) -> int:
    """The largest row count before the dense path first wins (0: it wins from one row)."""
    best = 0
    for t, p, d in zip(rows, packed_us, dense_us, strict=True):
        if p >= d:
            break
        best = t
    return best


def choose_single_thread(rows: list[int], one_thread: list[float], all_threads: list[float]) -> int:
    """The largest step size up to which one thread is at least ONE_THREAD_GAIN faster at every size (0: none)."""
    chosen = 0
    for t, a, b in zip(rows, one_thread, all_threads, strict=True):
        if a * ONE_THREAD_GAIN > b:
            break
        chosen = t
    return chosen


@contextmanager
def gateway_like_load() -> Iterator[None]:
    """A second Python thread doing a little work every millisecond, as a streaming server's event loop does
    while one sequence decodes (detokenize, an SSE write): what makes OpenMP's spinning threads stall."""
    stop = threading.Event()

    def loop() -> None:
        payload = {"choices": [{"delta": {"content": "token"}, "index": 0}], "usage": None}
        while not stop.is_set():
            deadline = time.perf_counter() + 1e-4
            while time.perf_counter() < deadline:
                json.dumps(payload)
            stop.wait(1e-3)

    thread = threading.Thread(target=loop, name="profile-load", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _linear_stack(model: nn.Module, t: int) -> Callable[[], object]:
    """Every linear layer of the model once, at t rows, each on the path it takes at t rows."""
    calls: list[Callable[[], object]] = []
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            x = torch.randn(t, m.in_features, dtype=m._dense_fn().dtype)
            calls.append(lambda m=m, x=x: m(x))
        elif isinstance(m, nn.Linear) and m.weight.device.type != "meta":
            x = torch.randn(t, m.in_features, dtype=m.weight.dtype)
            calls.append(lambda m=m, x=x: F.linear(x, m.weight))
    return lambda: [c() for c in calls]


def measure_threads(model: nn.Module, repeats: int = 5) -> tuple[ThreadPolicy, bool]:
    """Small steps on one thread against all, with a gateway-like neighbour, in passes until steady (whether
    they were, second); the caller's thread count is kept."""
    max_threads = torch.get_num_threads()
    stacks = [_linear_stack(model, t) for t in THREAD_ROWS]

    def one_pass() -> list[float]:
        times = []
        for stack in stacks:
            for threads in (1, max_threads):
                torch.set_num_threads(threads)
                stack()  # the first region on a new team size pays its start-up
                times.append(_best_us(stack, repeats) / 1e3)
        return times

    try:
        with gateway_like_load():
            times, steady = steady_minimum(one_pass)
    finally:
        torch.set_num_threads(max_threads)
    one, many = [round(t, 3) for t in times[0::2]], [round(t, 3) for t in times[1::2]]
    return ThreadPolicy(max_threads, choose_single_thread(list(THREAD_ROWS), one, many), list(THREAD_ROWS), one,
                        many), steady

