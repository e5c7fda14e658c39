"""Attribution: each engine step's energy, split across the requests in that step by their FLOPs.

The engine calls `Meter.on_step(stats)` after every step; the meter reads its power source there
(and nothing else: no I/O, no logging) and settles the energy since the previous reading:

    window      [t0, t1]: from the previous settled reading to this one, energy ΔE = E(t1) − E(t0)
    idle part   [t0, s]: s is the step's start_time; when s − t0 > idle_gap_s the engine was idle,
                E(s) is estimated from the readings taken while idle (the ticker's) as
                E(a) + P_idle · (s − a), a the last idle reading, clamped between the readings around s
    step part   E(t1) − E(s), split across steps pending in the window by duration, and within a
                step across its sequences in proportion to their forward FLOPs:

    F(n, c) = 2 · N · n  +  4 · L · d_attn · (n · c + n (n + 1) / 2)          [FLOP]

for a sequence computing n new tokens over c cached ones, N parameters, L layers and
d_attn = num_heads · head_dim. Per token this is Kaplan et al. 2020 (Scaling Laws for Neural Language
Models, table 1), C_forward ≈ 2N + 2·L·n_ctx·d_attn, with the attention term doubled for both QKᵀ and
A·V, as in PaLM (Chowdhery et al. 2022, appendix B: 6N + 12·L·H·Q·T for training = 3 × forward);
the token at position i attends to c + i + 1 keys, hence the exact sum. Prefill chunks (n large)
and decode steps (n = 1, c large) are weighed on the same scale.

Device time is split the same way: a request's device_seconds is Σ step duration · num_devices ·
its FLOP share. Energy read while no step ran is idle energy, counted apart and never inside a
request. Invariant, tested: Σ request joules + idle + unattributed + unsettled = E(latest reading) −
E(first reading). Unattributed joules belong to steps whose request had already finished before the
energy could be read (only after a failed read) or to steps with no work; unsettled joules are read
but not yet split (idle readings younger than settle_after_s, or steps waiting for a reading).

This file runs past 400 lines on purpose: the settlement rules, the formula and the result types
they fill are read together when checking the invariant, and splitting them would scatter it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenfactory.config import FlopShape, work_flops  # noqa: F401 - re-exported: the meter's FLOP split
from tokenfactory.meter.power import Clock, EnergyReading, PowerSource
from tokenfactory.meter.prices import Prices
from tokenfactory.types import ParameterError, StepStats


@dataclass(frozen=True)
class MeterConfig:
    num_devices: int = 1  # devices a step occupies (tensor parallel: all of them)
    idle_gap_s: float = 0.05  # a shorter gap before a step is engine overhead, charged to the step
    tick_interval_s: float | None = 1.0  # idle readings by a background thread; None: call tick()
    settle_after_s: float = 30.0  # idle readings older than this are settled (longer than any step)
    watts_window_s: float = 5.0  # current_watts averages over this trailing window
    device: str = "cpu"  # the device the steps run on, as /metrics and the utilisation rollup name it

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ParameterError("num_devices", f"num_devices must be >= 1, got {self.num_devices}")
        if self.idle_gap_s < 0:
            raise ParameterError("idle_gap_s", f"idle_gap_s must be >= 0, got {self.idle_gap_s}")
        if self.tick_interval_s is not None and self.tick_interval_s <= 0:
            raise ParameterError("tick_interval_s", f"tick_interval_s must be > 0, got {self.tick_interval_s}")
        if self.settle_after_s <= 0:
            raise ParameterError("settle_after_s", f"settle_after_s must be > 0, got {self.settle_after_s}")


@dataclass(frozen=True)
class RequestEnergy:
    """One request's share. Missing energy is None, never 0; cost_usd is None when a part is."""

    request_id: str
    energy_joules: float | None  # measured scope only (see energy_scope), before overheads
    energy_source: str | None  # nvml | rapl | modelled | constant | a+b; None when energy is None
    energy_scope: str | None  # gpu | cpu-package | ... ; None when energy is None
    energy_overhead_factor: float  # psu_loss_factor · pue, applied in facility_energy_joules and cost
    facility_energy_joules: float | None  # energy_joules · energy_overhead_factor
    device_seconds: float  # share of device time (Σ step duration · devices · FLOP share)
    flops: float
    num_steps: int
    num_output_tokens: int | None
    cost_device_usd: float
    cost_energy_usd: float | None
    cost_usd: float | None

    @property
    def joules_per_output_token(self) -> float | None:
        if self.energy_joules is None or not self.num_output_tokens:
            return None
        return self.energy_joules / self.num_output_tokens


@dataclass(frozen=True)
class MeterTotals:
    """Counters since the meter started, for /metrics. Energy fields are None without a source."""

    source: str
    scope: str
    energy_joules_by_source: dict[str, float]  # read from the source ({} when it cannot measure)
    energy_joules_by_component: dict[str, float]
    attributed_joules: float | None  # settled into requests (finished or running)
    idle_joules: float | None
    unattributed_joules: float | None
    unsettled_joules: float | None  # read but not yet split (recent idle readings, steps awaiting a read)
    current_watts: float | None  # average over the trailing watts_window_s
    busy_device_seconds: float
    idle_device_seconds: float
    num_requests_finished: int
    num_output_tokens: int  # of finished requests that reported them
    joules_per_output_token: float | None  # finished requests with energy and output tokens
    cost_device_usd: float  # finished requests
    cost_energy_usd: float  # finished requests whose energy is known
    cost_usd: float  # finished requests whose cost is known
    idle_cost_usd: float | None  # idle device time and idle energy, at the same prices
    energy_overhead_factor: float
    # Utilisation joined to tokens (meter/utilisation.py): what the busy device-seconds made.
    device: str = "cpu"
    busy_joules: float | None = None  # settled into steps: attributed + unattributed
    num_prefill_tokens: int = 0  # prompt tokens computed in steps (prefix-cache hits are not)
    num_decode_tokens: int = 0  # tokens computed in decode rows (speculative verification included)


@dataclass
class _Account:
    joules: float = 0.0
    device_seconds: float = 0.0
    flops: float = 0.0
    num_steps: int = 0
    num_pending_steps: int = 0  # reported but not yet settled against a reading
    num_unmeasured_steps: int = 0  # ran while no reading existed: energy cannot be known


@dataclass(frozen=True)
class _PendingStep:
    start: float
    duration_s: float
    request_id_to_share: dict[str, float]


@dataclass
class _Finished:
    num_requests: int = 0
    num_output_tokens: int = 0
    joules_with_tokens: float = 0.0  # numerator of joules per output token
    tokens_with_joules: int = 0
    cost_device_usd: float = 0.0
    cost_energy_usd: float = 0.0
    cost_usd: float = 0.0


@dataclass
class _Energy:
    first: EnergyReading | None = None
    settled: EnergyReading | None = None
    latest: EnergyReading | None = None
    idle_samples: list[EnergyReading] = field(default_factory=list)  # since `settled`, ticker's
    watts_window: deque[EnergyReading] = field(default_factory=deque)
    idle_watts: float | None = None
    attributed_joules: float = 0.0
    idle_joules: float = 0.0
    unattributed_joules: float = 0.0
    rebase: bool = False  # pending steps were given up: the next reading starts a fresh window


class Meter:
    """Splits measured energy and device time across requests. Thread-safe: the engine's thread calls
    on_step, the server's threads call finish_request and totals, the ticker calls tick."""

    MIN_IDLE_WINDOW_S = 0.1  # shorter idle windows are too noisy to estimate idle power from
    MAX_PENDING_STEPS = 10_000  # reads failing this long: the source is gone, stop waiting for it

    def __init__(self, source: PowerSource, model: FlopShape, prices: Prices,
                 config: MeterConfig | None = None, clock: Clock = time.monotonic) -> None:
        self._source, self._model, self._prices = source, model, prices
        self._config = config if config is not None else MeterConfig()
        self._flops_per_token = 2.0 * model.num_params  # work_flops, split for the step loop
        self._flops_per_key = 4.0 * model.num_layers * model.num_heads * model.head_dim
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._accounts: dict[str, _Account] = {}
        self._pending: list[_PendingStep] = []
        self._energy = _Energy()
        self._finished = _Finished()
        self._busy_device_seconds = 0.0
        self._num_prefill_tokens = self._num_decode_tokens = 0
        # Called (under the meter's lock: keep them to a queue put) with the joules each settlement gave
        # each request: the joule-counting fair share hears of measured energy this way.
        self.energy_listeners: list[Callable[[dict[str, float]], None]] = []
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        with self._lock:
            self._observe(source.read())

    @property
    def source(self) -> PowerSource:
        return self._source

    @property
    def prices(self) -> Prices:
        return self._prices

    def start(self) -> Meter:
        """Start the idle ticker (when tick_interval_s is set). Returns self, for `with`."""
        if self._config.tick_interval_s is not None and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick_loop, name="meter-ticker", daemon=True)
            self._ticker.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
            self._ticker = None

    def __enter__(self) -> Meter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_step(self, stats: StepStats) -> None:
        """Account one finished step. Cheap: one counter read and arithmetic, no I/O or logging."""
        per_token, per_key = self._flops_per_token, self._flops_per_key  # see work_flops
        request_id_to_flops: dict[str, float] = {}
        for w in stats.work:
            n = w.num_new_tokens
            f = per_token * n + per_key * (n * w.num_context_tokens + n * (n + 1) / 2)
            request_id_to_flops[w.request_id] = request_id_to_flops.get(w.request_id, 0.0) + f
        total_flops = sum(request_id_to_flops.values())
        count = len(request_id_to_flops)
        request_id_to_share = {r: (f / total_flops if total_flops > 0 else 1.0 / count)
                               for r, f in request_id_to_flops.items()}
        device_seconds = stats.duration_s * self._config.num_devices
        with self._lock:
            self._busy_device_seconds += device_seconds
            self._num_prefill_tokens += stats.num_prefill_tokens
            self._num_decode_tokens += stats.num_decode_tokens
            accounts = self._accounts
            for request_id, share in request_id_to_share.items():
                account = accounts.get(request_id)
                if account is None:
                    account = accounts[request_id] = _Account()
                account.device_seconds += device_seconds * share
                account.flops += request_id_to_flops[request_id]
                account.num_steps += 1
                account.num_pending_steps += 1
            self._pending.append(_PendingStep(stats.start_time, stats.duration_s, request_id_to_share))
            self._read_and_settle()

    def tick(self) -> None:
        """An idle reading: keeps wrapping counters read, and measures idle power between steps."""
        with self._lock:
            reading = self._source.read()
            self._observe(reading)
            energy = self._energy
            if reading is None or energy.settled is None or reading is energy.settled:
                return
            if energy.rebase:
                self._give_up_pending()
                self._rebase(reading)
                return
            energy.idle_samples.append(reading)
            if not self._pending:
                self._settle_old_idle(reading.timestamp - self._config.settle_after_s)

    def finish_request(self, request_id: str, num_output_tokens: int | None = None) -> RequestEnergy:
        """The request's energy and cost; forgets the request. Unknown ids get zero work."""
        with self._lock:
            if request_id in self._accounts and self._accounts[request_id].num_pending_steps:
                self._read_and_settle()  # only after a failed read: try once more
            account = self._accounts.pop(request_id, _Account())
            result = self._request_energy(request_id, account, num_output_tokens)
            self._count_finished(result)
            return result

    def totals(self) -> MeterTotals:
        with self._lock:
            energy, finished, prices = self._energy, self._finished, self._prices
            measured = energy.first is not None and energy.latest is not None
            total_j = energy.latest.joules - energy.first.joules if measured else 0.0
            by_component = ({k: v - energy.first.joules_by_component.get(k, 0.0)
                             for k, v in energy.latest.joules_by_component.items()} if measured else {})
            wall_s = (energy.latest.timestamp if measured else self._clock()) - self._started
            idle_device_s = max(wall_s * self._config.num_devices - self._busy_device_seconds, 0.0)
            return MeterTotals(
                source=self._source.name, scope=self._source.scope,
                energy_joules_by_source={self._source.name: total_j} if measured else {},
                energy_joules_by_component=by_component,
                attributed_joules=energy.attributed_joules if measured else None,
                idle_joules=energy.idle_joules if measured else None,
                unattributed_joules=energy.unattributed_joules if measured else None,
                unsettled_joules=energy.latest.joules - energy.settled.joules if measured else None,
                current_watts=self._current_watts(),
                busy_device_seconds=self._busy_device_seconds,
                idle_device_seconds=idle_device_s,
                num_requests_finished=finished.num_requests,
                num_output_tokens=finished.num_output_tokens,
                joules_per_output_token=(finished.joules_with_tokens / finished.tokens_with_joules
                                         if finished.tokens_with_joules else None),
                cost_device_usd=finished.cost_device_usd,
                cost_energy_usd=finished.cost_energy_usd,
                cost_usd=finished.cost_usd,
                idle_cost_usd=(prices.device_cost_usd(idle_device_s) + prices.energy_cost_usd(energy.idle_joules)
                               if measured else None),
                energy_overhead_factor=prices.energy_overhead_factor,
                device=self._config.device,
                busy_joules=energy.attributed_joules + energy.unattributed_joules if measured else None,
                num_prefill_tokens=self._num_prefill_tokens,
                num_decode_tokens=self._num_decode_tokens,
            )

    # --- inside the lock ---------------------------------------------------------------------------

    def _read_and_settle(self) -> None:
        reading = self._source.read()
        energy = self._energy
        if reading is None:
            if energy.settled is None or len(self._pending) > self.MAX_PENDING_STEPS:
                self._give_up_pending()  # no source, or one that stopped answering
            return
        if energy.settled is None:
            self._observe(reading)  # the first reading: earlier steps cannot be measured
            self._give_up_pending()
            return
        self._observe(reading)
        if energy.rebase:  # the window spans steps given up on (and these): nobody's, but counted
            self._give_up_pending()
            self._rebase(reading)
        elif self._pending:
            self._settle(reading)

    def _rebase(self, reading: EnergyReading) -> None:
        energy = self._energy
        energy.unattributed_joules += reading.joules - energy.settled.joules
        energy.settled, energy.rebase = reading, False
        energy.idle_samples.clear()

    def _give_up_pending(self) -> None:
        for step in self._pending:
            for request_id in step.request_id_to_share:
                account = self._accounts.get(request_id)
                if account is not None:
                    account.num_pending_steps -= 1
                    account.num_unmeasured_steps += 1
        self._pending.clear()
        self._energy.rebase = self._energy.settled is not None

    def _settle(self, reading: EnergyReading) -> None:
        energy, settled = self._energy, self._energy.settled
        first_start = self._pending[0].start
        if first_start - settled.timestamp > self._config.idle_gap_s:
            at_start = self._energy_at(first_start, reading)
        else:
            at_start = settled.joules  # back-to-back: the gap is engine overhead, part of the step
        energy.idle_joules += at_start - settled.joules
        busy_joules = reading.joules - at_start
        total_s = sum(step.duration_s for step in self._pending)
        request_id_to_joules: dict[str, float] = {}
        for step in self._pending:
            fraction = step.duration_s / total_s if total_s > 0 else 1.0 / len(self._pending)
            step_joules = busy_joules * fraction
            if not step.request_id_to_share:
                energy.unattributed_joules += step_joules
            for request_id, share in step.request_id_to_share.items():
                account = self._accounts.get(request_id)
                if account is None:  # finished before this energy could be read
                    energy.unattributed_joules += step_joules * share
                    continue
                account.joules += step_joules * share
                account.num_pending_steps -= 1
                energy.attributed_joules += step_joules * share
                request_id_to_joules[request_id] = request_id_to_joules.get(request_id, 0.0) + step_joules * share
        self._pending.clear()
        if request_id_to_joules:
            for listener in self.energy_listeners:
                listener(request_id_to_joules)
        energy.settled = reading
        energy.idle_samples.clear()

    def _energy_at(self, when: float, reading: EnergyReading) -> float:
        """Estimated counter value at `when`, from idle readings before it (see module docstring)."""
        energy = self._energy
        points = [energy.settled, *energy.idle_samples, reading]
        before = [p for p in points if p.timestamp <= when]
        after = [p for p in points if p.timestamp > when]
        a = before[-1]
        b = after[0] if after else reading
        idle_span = a.timestamp - energy.settled.timestamp
        if idle_span >= self.MIN_IDLE_WINDOW_S:
            energy.idle_watts = (a.joules - energy.settled.joules) / idle_span
        if energy.idle_watts is not None:
            estimate = a.joules + energy.idle_watts * (when - a.timestamp)
        elif b.timestamp > a.timestamp:  # no idle power known yet: assume constant power across [a, b]
            estimate = a.joules + (b.joules - a.joules) * (when - a.timestamp) / (b.timestamp - a.timestamp)
        else:
            estimate = a.joules
        return min(max(estimate, a.joules), b.joules)

    def _settle_old_idle(self, horizon: float) -> None:
        """With no step pending, idle readings older than `horizon` can only have been idle."""
        energy = self._energy
        old = [s for s in energy.idle_samples if s.timestamp < horizon]
        if not old:
            return
        newest, settled = old[-1], energy.settled
        span = newest.timestamp - settled.timestamp
        if span >= self.MIN_IDLE_WINDOW_S:
            energy.idle_watts = (newest.joules - settled.joules) / span
        energy.idle_joules += newest.joules - settled.joules
        energy.settled = newest
        energy.idle_samples = [s for s in energy.idle_samples if s.timestamp > newest.timestamp]

    def _observe(self, reading: EnergyReading | None) -> None:
        if reading is None:
            return
        energy = self._energy
        if energy.first is None:
            energy.first = energy.settled = reading
        energy.latest = reading
        window = energy.watts_window
        if not window or reading.timestamp - window[-1].timestamp >= self.MIN_IDLE_WINDOW_S:
            window.append(reading)
        while len(window) > 1 and window[0].timestamp < reading.timestamp - self._config.watts_window_s:
            window.popleft()

    def _current_watts(self) -> float | None:
        window, latest = self._energy.watts_window, self._energy.latest
        if not window or latest is None or latest.timestamp <= window[0].timestamp:
            return None
        return (latest.joules - window[0].joules) / (latest.timestamp - window[0].timestamp)

    def _request_energy(self, request_id: str, account: _Account, num_output_tokens: int | None) -> RequestEnergy:
        prices = self._prices
        known = (self._energy.first is not None and account.num_pending_steps == 0
                 and account.num_unmeasured_steps == 0)
        joules = account.joules if known else None
        cost_device = prices.device_cost_usd(account.device_seconds)
        cost_energy = prices.energy_cost_usd(joules) if joules is not None else None
        return RequestEnergy(
            request_id=request_id,
            energy_joules=joules,
            energy_source=self._source.name if known else None,
            energy_scope=self._source.scope if known else None,
            energy_overhead_factor=prices.energy_overhead_factor,
            facility_energy_joules=joules * prices.energy_overhead_factor if joules is not None else None,
            device_seconds=account.device_seconds,
            flops=account.flops,
            num_steps=account.num_steps,
            num_output_tokens=num_output_tokens,
            cost_device_usd=cost_device,
            cost_energy_usd=cost_energy,
            cost_usd=cost_device + cost_energy if cost_energy is not None else None,
        )

    def _count_finished(self, result: RequestEnergy) -> None:
        finished = self._finished
        finished.num_requests += 1
        finished.cost_device_usd += result.cost_device_usd
        if result.num_output_tokens:
            finished.num_output_tokens += result.num_output_tokens
        if result.energy_joules is not None and result.cost_energy_usd is not None:
            finished.cost_energy_usd += result.cost_energy_usd
            if result.num_output_tokens:
                finished.joules_with_tokens += result.energy_joules
                finished.tokens_with_joules += result.num_output_tokens
        if result.cost_usd is not None:
            finished.cost_usd += result.cost_usd

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._config.tick_interval_s):
            self.tick()
