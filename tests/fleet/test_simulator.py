"""The fleet simulator on small traces with known answers: one request's exact timeline and joules, a batch of two,
an arrival that cuts a decode run, M/D/1 queueing (Pollaczek-Khinchine), the gateway's real router and
autoscaler making the decisions (scale from zero with the cold start in TTFT, up and down over a day), the
planner's step model reproduced exactly, and the traces (Poisson, diurnal, replayed JSON lines and ledger)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from tokenfactory.fleet.autoscaler import SLO, AutoscalerConfig
from tokenfactory.fleet.router import LeastWork
from tokenfactory.fleet.sim_model import LinearCost, PlannerCost, ReplicaSpec, planner_spec
from tokenfactory.fleet.simulator import SimConfig, Simulation
from tokenfactory.fleet.traces import SimRequest, diurnal, poisson, replay


def spec(**kw: float) -> ReplicaSpec:
    cost = LinearCost(kw.pop("base_s", 0.01), kw.pop("per_seq_s", 0.0), kw.pop("per_prefill_token_s", 0.0),
                      kw.pop("busy_w", 100.0))
    return ReplicaSpec("lin", "cpu", cost, idle_w=kw.pop("idle_w", 10.0), busy_w=cost.busy_w,
                       **{k: int(v) if k != "cold_start_s" else v for k, v in kw.items()})


def simulate(trace: list[SimRequest], **kw: object) -> Simulation:
    sim = Simulation(SimConfig(**{"specs": [spec()], **kw}), trace)  # type: ignore[arg-type]
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def test_one_request_has_an_exact_timeline_and_energy() -> None:
    s = spec(base_s=0.01, per_prefill_token_s=0.001)
    sim = Simulation(SimConfig([s]), [SimRequest(5.0, 100, 10)])
    res = sim.run()
    # The prefill step (0.01 + 100 x 0.001) gives the first token, then 9 decode steps of 0.01.
    assert res.ttft[0] == pytest.approx(0.11) and res.e2e[0] == pytest.approx(0.11 + 0.09)
    assert res.tpot[0] == pytest.approx(0.01)
    assert res.num_tokens == 10 and res.duration_s == pytest.approx(5.2)
    assert res.busy_j == pytest.approx(100.0 * 0.2) and res.idle_j == pytest.approx(10.0 * 5.0)
    summary = res.summary()
    assert summary["joules_per_token"] == pytest.approx((20 + 50) / 10) and summary["energy_source"] == "modelled"


def test_two_requests_share_their_steps() -> None:
    s = spec(base_s=0.01, per_seq_s=0.005)
    res = Simulation(SimConfig([s]), [SimRequest(0.0, 4, 3), SimRequest(0.0, 4, 5)]).run()
    # Both prefill in the first step (2 sequences: 0.02 s), then decode together at 0.02 s a step until the
    # first finishes (2 more steps), then the second alone at 0.015 s (2 more).
    assert res.ttft.tolist() == pytest.approx([0.02, 0.02])
    assert res.e2e.tolist() == pytest.approx([0.02 + 2 * 0.02, 0.02 + 2 * 0.02 + 2 * 0.015])


def test_an_arrival_cuts_a_decode_run_at_the_step_under_way() -> None:
    res = Simulation(SimConfig([spec(base_s=0.01)]), [SimRequest(0.0, 4, 100), SimRequest(0.155, 4, 2)]).run()
    # A's steps end at 0.01, 0.02, ...; B arrives in the step ending at 0.16, is prefilled in the next one.
    assert res.ttft[1] == pytest.approx(0.17 - 0.155)
    assert res.e2e[0] == pytest.approx(1.0)  # A: 100 steps, one of them shared with B's prefill
    assert res.e2e[1] == pytest.approx(0.18 - 0.155)


def test_md1_queueing_matches_pollaczek_khinchine() -> None:
    # One sequence at a time, a deterministic 0.1 s service (a 0.01 s prefill step + 9 decode steps): M/D/1.
    rate, service = 5.0, 0.1
    res = Simulation(SimConfig([spec(base_s=0.01, max_num_seqs=1)]),
                     poisson(rate, 4000, prompt_tokens=8, output_tokens=10, seed=3)).run()
    rho = rate * service
    wq = rho * service / (2 * (1 - rho))  # mean wait in queue, M/D/1
    assert np.nanmean(res.ttft) - 0.01 == pytest.approx(wq, rel=0.06)
    assert np.nanmean(res.e2e) == pytest.approx(wq + service, rel=0.03)
    assert res.summary()["completed"] == res.num_requests


def test_the_gateways_router_spreads_work_and_a_static_fleet_pays_idle() -> None:
    trace = [SimRequest(i * 0.001, 4, 50) for i in range(8)]
    sim = Simulation(SimConfig([spec(base_s=0.01)], replicas=2), trace)
    assert isinstance(sim.router, LeastWork)
    res = sim.run()
    served = {r.replica_id: r.num_tokens for r in sim.live()}
    assert served == {"s0": 200, "s1": 200}  # least outstanding tokens alternates them
    assert res.idle_j > 0 and res.cold_start_j == 0
    assert Simulation(SimConfig([spec()], router="energy"), trace).router.name == "energy"


def test_scale_from_zero_charges_the_cold_start_to_ttft_and_energy() -> None:
    config = SimConfig([spec(base_s=0.01, cold_start_s=30.0)], replicas=0, autoscaler="slo",
                       scaling=AutoscalerConfig(min_replicas=0, max_replicas=2, up_delay_s=5, down_delay_s=20))
    sim = Simulation(config, [SimRequest(10.0, 4, 5), SimRequest(200.0, 4, 5)])
    res = sim.run()
    # Held at 10 s; the tick at 10 s (after the arrival) starts a replica, ready at 40 s: TTFT 30 s + a step.
    assert res.ttft[0] == pytest.approx(30.01)
    assert res.cold_start_j == pytest.approx(2 * 10.0 * 30.0)  # scaled to zero in between: two cold starts
    actions = [d.split()[2] for d in res.decisions]
    assert actions == ["up", "down", "up"]  # the 30 s TTFT at a load of one request adds no second replica


def day_sim(autoscaler: str | None, replicas: int) -> dict:
    """A two-hour 'day' (one diurnal cycle) on replicas that serve 4 sequences within the SLO."""
    s = spec(base_s=0.02, per_seq_s=0.001, busy_w=300.0, idle_w=60.0, max_num_seqs=32, target_seqs=4,
             cold_start_s=30.0)
    trace = diurnal(peak_rate=6.0, trough_rate=0.3, duration_s=2 * 3600, prompt_tokens=64, output_tokens=64,
                    seed=1, t_low_s=0.0, period_s=2 * 3600)
    scaling = AutoscalerConfig(min_replicas=1, max_replicas=8, slo=SLO(2.0, 0.1), up_delay_s=20, down_delay_s=120)
    res = Simulation(SimConfig([s], replicas=replicas, autoscaler=autoscaler, scaling=scaling, tick_s=5), trace).run()
    return {**res.summary(), "samples": res.samples}


def test_autoscalers_follow_demand_and_save_energy_against_a_static_fleet() -> None:
    static, slo, energy = day_sim(None, 8), day_sim("slo", 1), day_sim("energy", 1)
    assert static["replicas_mean"] == pytest.approx(8)
    assert 1 < energy["replicas_mean"] <= slo["replicas_mean"] < 8
    assert energy["joules_per_token"] < slo["joules_per_token"] < static["joules_per_token"]
    assert static["idle_kwh"] > slo["idle_kwh"]
    for r in (static, slo, energy):
        assert r["completed"] == r["requests"] and r["slo_attainment"] > 0.95
    # Replicas over time follow the rate: most around the peak (t = 1 h), fewest at the ends.
    samples = slo["samples"]
    peak = max(samples, key=lambda s: s.replicas)
    assert 0.5 * 3600 < peak.time_s < 1.6 * 3600 and samples[0].replicas == 1 and samples[-1].replicas <= 2


def test_planner_cost_equals_the_planner_step_model() -> None:
    replica = planner_spec("Llama-3.1-8B", "H100-SXM", tpot_slo_s=0.05)
    assert isinstance(replica.step, PlannerCost)
    rng = random.Random(0)
    for _ in range(200):
        b, c, p, pr = rng.randint(0, 256), rng.uniform(0, 4096), rng.choice([0, rng.uniform(0, 8192)]), \
            rng.uniform(0, 4096)
        est = replica.step.steps.step(b, c, p, pr)
        seconds, watts = replica.step.cost(b, c, p, pr)
        assert seconds == pytest.approx(est.seconds, rel=1e-9) and watts == pytest.approx(est.power_w, rel=1e-9)
    assert 1 <= replica.target_seqs <= 256 and replica.usd_per_hour == pytest.approx(2.69)
    assert replica.step.cost(replica.target_seqs, 640, 0, 0)[0] <= 0.05


def test_traces_have_the_rates_they_claim(tmp_path: Path) -> None:
    p = poisson(10.0, 2000, seed=0)
    assert len(p) / 2000 == pytest.approx(10.0, rel=0.03)
    bursty = poisson(10.0, 2000, seed=0, cv=3.0)
    gaps = np.diff([r.arrival_s for r in bursty])
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(3.0, rel=0.15)
    day = diurnal(10.0, 1.0, seed=0)
    hours = np.histogram([r.arrival_s for r in day], bins=24, range=(0, 86400))[0] / 3600
    assert hours[4] == pytest.approx(1.0, abs=0.3) and hours[16] == pytest.approx(10.0, rel=0.1)
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps({"arrival_s": 5 + i, "prompt_tokens": 10 * i + 1, "output_tokens": 7})
                              for i in range(3)))
    assert replay(path) == [SimRequest(float(i), 10 * i + 1, 7) for i in range(3)]
    path.write_text('{"arrival_s": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        replay(path)


def test_a_ledger_replays_as_a_trace(tmp_path: Path) -> None:
    import datetime as dt

    from tokenfactory.meter.ledger import Ledger, LedgerRow

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    t0 = dt.datetime(2026, 12, 1, 12, 0, 0)
    for i in range(3):  # each row written when its request ended, 1 s after it arrived
        ledger.record(LedgerRow(request_id=f"r{i}", model="m", status="finished", prompt_tokens=5 + i,
                                completion_tokens=9, latency_s=1.0, created_at=t0 + dt.timedelta(seconds=2 * i)))
    ledger.close()
    trace = replay(tmp_path / "ledger.db")
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace] == [(0.0, 5, 9), (2.0, 6, 9), (4.0, 7, 9)]
    assert math.isfinite(Simulation(SimConfig([spec()]), trace).run().summary()["ttft_p50_s"])


def test_simulate_command_side_by_side_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenfactory.cli import main
    from tokenfactory.fleet.cli import replica_counts

    assert replica_counts("4..32") == [4, 8, 16, 32] and replica_counts("3,5") == [3, 5] and replica_counts("2") == [2]
    with pytest.raises(ValueError, match="--replicas"):
        replica_counts("8..2")
    args = ["simulate", "--trace", "poisson", "--rate", "20", "--duration", "60", "--replicas", "1..2",
            "--router", "least-work,energy", "--model", "Llama-3.1-8B", "--device", "H100-SXM"]
    assert main([*args, "--plot", str(tmp_path / "sim.png")]) == 0
    table = capsys.readouterr().out
    assert "least-work / static / 1" in table and "energy / static / 2" in table and "USD/Mtok (rent)" in table
    assert (tmp_path / "sim.png").stat().st_size > 10_000
    assert main([*args, "--json", "--autoscaler", "slo", "--trace", "diurnal", "--period", "600",
                 "--peak-rate", "30", "--trough-rate", "1"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in runs] == ["least-work / slo / 1..2", "energy / slo / 1..2"]
    assert all(r["energy_source"] == "modelled" and r["timeline"] and r["completed"] == r["requests"] for r in runs)
    assert main(["simulate", "--trace", str(tmp_path / "missing.jsonl")]) == 2


def test_the_energy_autoscaler_starts_the_cheapest_kind_per_token() -> None:
    def kind(name: str, usd: float) -> ReplicaSpec:
        return ReplicaSpec(name, "cpu", LinearCost(0.02, 0.001), 10.0, 100.0, max_num_seqs=32, usd_per_hour=usd,
                           cold_start_s=5.0, target_seqs=4, tokens_per_s=100.0)
    trace = poisson(6.0, 600, prompt_tokens=16, output_tokens=64, seed=4)
    scaling = AutoscalerConfig(min_replicas=1, max_replicas=6, up_delay_s=5, down_delay_s=60)
    for policy, expected in (("energy", "cheap"), ("slo", "dear")):
        sim = Simulation(SimConfig([kind("dear", 4.0), kind("cheap", 1.0)], autoscaler=policy, scaling=scaling), trace)
        sim.run()
        started = {r.spec.name for r in sim.live() + sim._retired if r.replica_id != "s0"}
        assert started == {expected}, policy
