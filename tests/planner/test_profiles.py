"""Scenario profiles from the planner's model: what each sets, which one `plan --profile auto` chooses and why,
`serve --profile` applying them under the flags a user gave, and (slow) a real server started with one."""

from __future__ import annotations

import openai
import pytest

from tokenfactory.cli import build_parser, main
from tokenfactory.planner.catalog import load_catalog
from tokenfactory.planner.hardware import hardware_from_catalog
from tokenfactory.planner.memory import plan_memory, resolve_weights
from tokenfactory.planner.modelsrc import load_model
from tokenfactory.planner.perf import StepModel, Workload
from tokenfactory.planner.precision import parse_kv_dtype
from tokenfactory.planner.scenarios import choose_profile, make_profile
from tokenfactory.serve.scenario import apply_profile


def h100_8b() -> tuple[StepModel, Workload, int]:
    catalog = load_catalog()
    model, hw = load_model("Llama-3.1-8B", catalog), hardware_from_catalog(catalog, catalog.device("H100-SXM"))
    weights = resolve_weights(model, None)
    kv = parse_kv_dtype("auto", weights.precision)
    memory = plan_memory(hw, model, weights, kv, 8192, 256, 8192)
    wl = Workload(512, 256)
    return StepModel(hw, model, weights, kv), wl, memory.max_seqs(768)


def test_the_three_profiles_trade_latency_for_tokens_and_joules() -> None:
    steps, wl, kv = h100_8b()
    lat, thr, eff = (make_profile(n, steps, wl, kv) for n in ("latency", "throughput", "efficiency"))
    assert lat.max_num_seqs < eff.max_num_seqs <= thr.max_num_seqs == min(kv, 256)
    assert lat.speculative == "ngram" and thr.speculative == eff.speculative == "none"
    assert lat.max_num_batched_tokens < eff.max_num_batched_tokens < thr.max_num_batched_tokens
    assert lat.tpot_slo_s < eff.tpot_slo_s < thr.tpot_slo_s
    assert lat.tokens_per_s < eff.tokens_per_s <= thr.tokens_per_s
    assert eff.joules_per_token < lat.joules_per_token
    assert (lat.autoscaler, thr.autoscaler, eff.autoscaler) == ("slo", "slo", "energy")
    # Each one's SLO is met by its own batch, as the planner models it.
    for p in (lat, thr, eff):
        assert steps.serving(p.max_num_seqs, wl).seconds <= p.tpot_slo_s
    with pytest.raises(ValueError, match="unknown profile"):
        make_profile("fast", steps, wl, kv)


def test_choose_profile_says_why() -> None:
    steps, wl, kv = h100_8b()
    one = steps.serving(1, wl).seconds
    p = choose_profile(steps, wl, kv, tpot_slo_s=1.2 * one)
    assert p.name == "latency" and "leaves room for" in p.reason
    p = choose_profile(steps, wl, kv, tokens_per_s_demand=500.0)
    assert p.name == "efficiency" and "under half" in p.reason
    p = choose_profile(steps, wl, kv, tokens_per_s_demand=1e6)
    assert p.name == "throughput" and "needs at least half" in p.reason


def test_plan_prints_the_profile_it_would_choose(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "Llama-3.1-8B", "--device", "H100-SXM", "--profile", "auto", "--tokens-per-day", "1e7"]) == 0
    out = capsys.readouterr().out
    assert "Profile efficiency:" in out and "because the demand (116 tok/s) is under half" in out
    # A stated workload is enough: the plan says which profile fits it without being asked.
    assert main(["plan", "Llama-3.1-8B", "--device", "H100-SXM", "--tokens-per-day", "1e7"]) == 0
    assert "Profile efficiency:" in capsys.readouterr().out
    assert main(["plan", "Llama-3.1-8B", "--device", "H100-SXM"]) == 0
    assert "Profile" not in capsys.readouterr().out


def test_serve_profile_sets_what_the_user_left_at_its_default() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--profile", "latency", "--profile-device", "H100-SXM", "--max-num-seqs", "3",
                              "--autoscaler"])
    given = vars(args).copy()
    chosen, line = apply_profile(args, args.flag_defaults)
    assert vars(args) == given  # the user's flags are not written to
    assert chosen.max_num_seqs == 3  # given: kept
    assert chosen.max_num_batched_tokens == 512 and chosen.speculative == "ngram" and chosen.autoscaler == "slo"
    assert line is not None and line.startswith("latency:") and "H100-SXM" in line
    args = parser.parse_args(["serve"])
    chosen, line = apply_profile(args, args.flag_defaults)
    assert line is None and chosen is args and args.max_num_batched_tokens != 512


@pytest.mark.slow
def test_a_server_started_with_a_profile_serves_with_its_limits(tmp_path) -> None:
    from tests.server_util import start_server

    server = start_server(tmp_path, "--profile", "efficiency", "--profile-device", "H100-SXM")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8,
                                           messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].message.content
        assert "profile efficiency:" in server.log()
        assert server.metric("tokenfactory:max_num_batched_tokens") == 2048
    finally:
        server.stop()
