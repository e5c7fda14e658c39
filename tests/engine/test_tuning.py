"""The machine profile (engine/tuning.py): measured at the first start for this CPU and these shapes, cached,
applied to every quantized layer, re-measured on request, refused when it is for another machine."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from tests.reference import kernel_here, tiny_gguf_file, tiny_random_model_dir
from tokenfactory.config import EngineConfig
from tokenfactory.engine import tuning
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.layers.quant import KERNELS, QuantizedLinear
from tokenfactory.models.loader import LoadedModel, load_model
from tokenfactory.types import ParameterError, SamplingParams


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> LoadedModel:
    path = tmp_path_factory.mktemp("tuning") / "tiny-q4_1.gguf"
    tiny_gguf_file(path, ggml_type="Q4_1", tie_word_embeddings=True)
    return load_model(path)


@pytest.fixture(scope="module")
def tiny_planned(tmp_path_factory) -> LoadedModel:
    """Every decoder layer on the int8-activation kernels (where the CPU has them): a compiled plan."""
    folder = tiny_random_model_dir(tmp_path_factory.mktemp("planned"), "llama", hidden_size=128,
                                   intermediate_size=256, num_heads=4, num_kv_heads=2, attention_bias=None)
    return load_model(folder)


PLANNED = dict(quantization="int4", dtype="bfloat16", block_size=8)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFACTORY_PROFILE_CACHE", str(tmp_path / "profiles"))
    # Caching is what these tests check, whatever else the machine runs: every second pass counts as steady
    # (test_unsteady_timings_serve_this_run_but_are_not_cached checks the other side).
    monkeypatch.setattr(tuning, "STEADY_TOLERANCE", float("inf"))
    return tmp_path / "profiles"


def engine(loaded: LoadedModel, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=4 << 20, max_model_len=128, **kw), loaded)


def quantized(e: LLMEngine) -> list[QuantizedLinear]:
    return [m for m in e.runner.model.modules() if isinstance(m, QuantizedLinear)]


def test_choices_from_timings() -> None:
    rows = [1, 2, 4, 8, 12]
    assert tuning.choose_crossover(rows, [10, 12, 14, 30, 40], [20, 20, 20, 20, 20]) == 4
    assert tuning.choose_crossover(rows, [30, 12, 14, 30, 40], [20, 20, 20, 20, 20]) == 0  # dense from one row
    assert tuning.choose_crossover(rows, [10, 30, 14, 1, 1], [20, 20, 20, 20, 20]) == 1  # first loss ends it
    assert tuning.choose_crossover(rows, [1, 1, 1, 1, 1], [2, 2, 2, 2, 2]) == 12
    # One thread is chosen only where it is 10% faster, at every size up to the one chosen.
    assert tuning.choose_single_thread([1, 2, 4, 8], [5, 6, 9, 20], [6, 7, 9, 12]) == 2
    assert tuning.choose_single_thread([1, 2, 4, 8], [5, 5, 5, 5], [5.2, 5.2, 5.2, 5.2]) == 0  # a tie: all threads
    assert tuning.choose_single_thread([1, 2, 4, 8], [12.8, 13.6, 20, 33], [6.3, 7.8, 12, 20]) == 0


def test_measured_at_the_first_start_cached_and_applied(tiny_q4, cache) -> None:
    first = engine(tiny_q4)
    profile = first.machine_profile
    assert profile is not None and profile.source == "measured"
    files = list(cache.glob("*.json"))
    assert len(files) == 1
    # Every quantized group was timed, and every layer took its group's measured crossover.
    groups = tuning.layer_groups(first.runner.model)
    assert sorted(c.group for c in profile.crossovers) == sorted(groups)
    measured = {c.group: c.max_packed_rows for c in profile.crossovers}
    for name, mods in groups.items():
        assert {m.max_packed_rows for m in mods} == {measured[name]}
    for c in profile.crossovers:
        assert len(c.rows) == len(c.packed_us) == len(c.dense_us) and all(v > 0 for v in c.packed_us + c.dense_us)
        assert c.max_packed_rows == tuning.choose_crossover(c.rows, c.packed_us, c.dense_us)
        assert c.default_rows in {k.max_rows["copy"] for k in KERNELS}
    # The summary says what the server and the benchmarks report, with the layers' descriptions following it.
    assert first.info.machine_profile == profile.summary()
    assert first.info.machine_profile["max_packed_rows"] == measured
    for path, text in first.quant_summary.path_to_format.items():
        assert f"<= {first.runner.model.get_submodule(path).max_packed_rows} rows" in text
    # The thread policy (2 threads here, so it was measured) is what the runner uses when the config leaves it.
    if profile.threads is not None:
        assert first.runner.single_thread_step_tokens == profile.threads.single_thread_step_tokens
        assert len(profile.threads.one_thread_ms) == len(tuning.THREAD_ROWS)

    second = engine(tiny_q4)
    again = second.runner.machine_profile
    assert again is not None and again.source == "cached" and again.path == str(files[0])
    assert again.crossovers == profile.crossovers
    assert {m.max_packed_rows for m in quantized(second)} == {m.max_packed_rows for m in quantized(first)}


def test_an_explicit_thread_setting_wins(tiny_q4, cache) -> None:
    assert engine(tiny_q4, single_thread_step_tokens=3).runner.single_thread_step_tokens == 3
    assert engine(tiny_q4, single_thread_step_tokens=0).runner.single_thread_step_tokens == 0


def test_remeasure_and_off(tiny_q4, cache) -> None:
    engine(tiny_q4)
    (path,) = cache.glob("*.json")
    stamp = json.loads(path.read_text())["measured_at"]
    redone = engine(tiny_q4, machine_profile="remeasure").runner.machine_profile
    assert redone is not None and redone.source == "measured" and path.exists()
    assert json.loads(path.read_text())["measure_s"] == redone.measure_s
    assert json.loads(path.read_text())["measured_at"] >= stamp
    off = engine(tiny_q4, machine_profile="off")
    assert off.runner.machine_profile is None and off.info.machine_profile is None
    defaults = {k.name: k.max_rows["copy"] for k in KERNELS}
    assert all(m.max_packed_rows == defaults[m.kernel_name] for m in quantized(off))
    assert off.runner.single_thread_step_tokens == 0
    with pytest.raises(ParameterError, match="machine_profile"):
        engine(tiny_q4, machine_profile="sometimes")


def test_a_profile_for_another_machine_or_a_broken_file_is_measured_again(tiny_q4, cache, caplog) -> None:
    engine(tiny_q4)
    (path,) = cache.glob("*.json")
    data = json.loads(path.read_text())
    data["key"]["cpu"] = "some other CPU"
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="tokenfactory.engine.tuning"):
        p = engine(tiny_q4).runner.machine_profile
    assert p is not None and p.source == "measured" and "another machine" in caplog.text
    assert json.loads(path.read_text())["key"]["cpu"] == tuning.cpu_identity()[0]
    for broken in ("{not json", json.dumps({**data, "version": 99}),
                   json.dumps({**json.loads(path.read_text()), "crossovers": [
                       {**json.loads(path.read_text())["crossovers"][0], "max_packed_rows": 10**6}]})):
        path.write_text(broken)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tokenfactory.engine.tuning"):
            p = engine(tiny_q4).runner.machine_profile
        assert p is not None and p.source == "measured" and "unreadable" in caplog.text


def test_changed_kernels_are_timed_again(tiny_q4, cache, monkeypatch) -> None:
    """The profile times our compiled kernels: when their sources change, the cached crossovers are not theirs."""
    first = engine(tiny_q4).runner.machine_profile
    assert first is not None and first.source == "measured"
    assert engine(tiny_q4).runner.machine_profile.source == "cached"
    monkeypatch.setattr(tuning.cpu_kernels, "source_digest", lambda: "another build")
    again = engine(tiny_q4).runner.machine_profile
    assert again is not None and again.source == "measured" and len(list(cache.glob("*.json"))) == 2


def test_a_profile_timed_under_openmp_settings_is_theirs_alone(tiny_q4, cache, monkeypatch) -> None:
    """Timed with GOMP_SPINCOUNT set, the profile is not the one a start without it reads (and the other way)."""
    for name in tuning.OPENMP_TIMING_ENV:
        monkeypatch.delenv(name, raising=False)
    plain = engine(tiny_q4).runner.machine_profile
    assert plain is not None and plain.source == "measured" and "openmp" not in plain.key
    monkeypatch.setenv("GOMP_SPINCOUNT", "100")
    spun = engine(tiny_q4).runner.machine_profile
    assert spun is not None and spun.source == "measured" and spun.key["openmp"] == {"GOMP_SPINCOUNT": "100"}
    monkeypatch.delenv("GOMP_SPINCOUNT")
    again = engine(tiny_q4).runner.machine_profile
    assert again is not None and again.source == "cached" and again.path == plain.path
    assert len(list(cache.glob("*.json"))) == 2


def test_an_unwritable_cache_still_serves(tiny_q4, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(tuning, "STEADY_TOLERANCE", float("inf"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TOKENFACTORY_PROFILE_CACHE", str(blocker / "profiles"))  # under a file: mkdir fails
    with caplog.at_level(logging.WARNING, logger="tokenfactory.engine.tuning"):
        e = engine(tiny_q4)
    assert e.runner.machine_profile is not None and "not cached" in caplog.text
    rid = e.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(e.run_to_completion([rid])[rid].outputs[0].token_ids) == 3


def test_describe_names_the_cpu_and_each_choice(tiny_q4, cache) -> None:
    profile = engine(tiny_q4).runner.machine_profile
    text = "\n".join(profile.describe())
    cpu, flags = tuning.cpu_identity()
    assert cpu in text and all(f in text for f in flags)
    for c in profile.crossovers:
        assert f"{c.group} x{c.num_layers}: packed for <= {c.max_packed_rows} rows (constant {c.default_rows})" in text


def test_doctor_machine_prints_and_remeasures(tiny_q4, cache, capsys) -> None:
    from tokenfactory.cli import main

    assert main(["doctor", "--machine", str(tiny_q4.path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("machine profile (measured") and tuning.cpu_identity()[0] in out
    assert main(["doctor", "--machine", str(tiny_q4.path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["source"] == "cached" and data["version"] == tuning.PROFILE_VERSION
    assert main(["doctor", "--machine", str(tiny_q4.path), "--remeasure", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == "measured"


@pytest.mark.slow
def test_doctor_machine_on_the_bundled_model(tmp_path) -> None:
    """As a user runs it: a fresh cache, the bundled model, every int4 group and the thread policy measured."""
    import subprocess
    import sys

    env = {**os.environ, "TOKENFACTORY_PROFILE_CACHE": str(tmp_path)}

    def doctor() -> dict:
        run = subprocess.run([sys.executable, "-m", "tokenfactory.cli", "doctor", "--machine", "--json",
                              "--threads", "2"],  # two whatever the machine has: one has no thread policy to choose
                             env=env, capture_output=True, text=True, timeout=300, check=True)
        return json.loads(run.stdout)

    data = doctor()
    assert data["source"] == "measured" and data["measure_s"] > 0
    groups = [c["group"] for c in data["crossovers"]]
    fused_gate_up = f"int4-g32 via {kernel_here('cpu-int4pack')}, 3072x576"  # the MLP's
    assert any(g.startswith(fused_gate_up) for g in groups)
    assert data["threads"]["max_threads"] == 2 and data["threads"]["rows"] == list(tuning.THREAD_ROWS)
    # Kept, steady or not (an unsteady one for UNSTEADY_KEEP_S): the next start reads the same choices back.
    (path,) = tmp_path.glob("*.json")
    again = doctor()
    assert again["source"] == "cached" and again["path"] == str(path)
    assert again["crossovers"] == data["crossovers"] and again["threads"] == data["threads"]


def test_passes_repeat_until_steady() -> None:
    passes = iter([[10.0, 20.0], [6.0, 19.0], [5.9, 19.5], [1.0, 1.0]])
    best, steady = tuning.steady_minimum(lambda: next(passes))
    assert steady and best == [5.9, 19.0]  # the third pass lowered nothing by more than the tolerance
    falling = iter([[100.0 / 2**i] for i in range(10)])
    best, steady = tuning.steady_minimum(lambda: next(falling))
    assert not steady and best == [100.0 / 2 ** (tuning.MAX_PASSES - 1)]


def test_unsteady_timings_are_shared_a_while_then_measured_again(tiny_q4, cache, monkeypatch, caplog) -> None:
    monkeypatch.setattr(tuning, "STEADY_TOLERANCE", -1.0)  # no pass is ever steady: a machine that never settles
    with caplog.at_level(logging.WARNING, logger="tokenfactory.engine.tuning"):
        e = engine(tiny_q4)
    profile = e.runner.machine_profile
    assert profile is not None and not profile.stable and "measures again" in caplog.text
    assert e.info.machine_profile["stable"] is False
    assert "timings unsteady" in profile.describe()[0]
    # An engine starting soon after (a second replica) runs the same choices; a later one measures again.
    again = engine(tiny_q4).runner.machine_profile
    assert again.source == "cached" and again.crossovers == profile.crossovers
    (path,) = cache.glob("*.json")
    old = time.time() - tuning.UNSTEADY_KEEP_S - 1
    os.utime(path, (old, old))
    assert engine(tiny_q4).runner.machine_profile.source == "measured"
    measured = {c.group: c.max_packed_rows for c in profile.crossovers}
    assert all(m.max_packed_rows == measured[g] for g, mods in tuning.layer_groups(e.runner.model).items()
               for m in mods)


def narrowed(e: LLMEngine, rows: int) -> int:
    """Every decoder layer's measured crossover taken as `rows` (the plan built again over them)."""
    runner = e.runner
    for m in runner._crossovers:
        runner._crossovers[m] = rows
    return runner.set_packed_rows(0)


def test_the_packed_step_limit_is_timed_at_warm_up_and_cached(tiny_planned, cache, monkeypatch) -> None:
    first = engine(tiny_planned, max_num_seqs=64, **PLANNED)
    if first.runner.packed_rows() == 0:
        pytest.skip("no compiled plan here: the int8-activation kernels need AVX-512 VNNI")
    assert narrowed(first, 4) == 4
    head = [m.max_packed_rows for m in quantized(first) if m not in first.runner._crossovers]
    calls: list[int] = []

    def timed(self, rows: int, base: int, steps: int = 5) -> tuple[float, float]:
        calls.append(rows)
        assert base == 4
        return (1.0, 2.0) if rows <= 16 else (3.0, 2.0)  # all packed wins up to 16 rows

    monkeypatch.setattr(LLMEngine, "_packed_against_crossovers", timed)
    first.warmup()
    assert calls == [6, 8, 12, 16, 24]  # up to the first row count where the forward won
    assert first.runner.packed_rows() == 16
    assert {m.max_packed_rows for m in first.runner._crossovers} == {16}
    assert [m.max_packed_rows for m in quantized(first) if m not in first.runner._crossovers] == head  # LM head
    profile = first.machine_profile
    assert profile.packed_step_rows == 16 and profile.packed_steps_ms[-1] == [24, 3.0, 2.0]
    assert first.info.machine_profile["packed_step_rows"] == 16
    assert any(line.startswith("  steps    decode steps of <= 16 rows") for line in profile.describe())
    (path,) = cache.glob("*.json")
    assert json.loads(path.read_text())["packed_step_rows"] == 16

    def never(self, rows: int, base: int, steps: int = 5) -> tuple[float, float]:
        raise AssertionError("a cached limit is not timed again")

    monkeypatch.setattr(LLMEngine, "_packed_against_crossovers", never)
    second = engine(tiny_planned, max_num_seqs=64, **PLANNED)
    assert second.machine_profile.packed_step_rows == 16 and second.runner.packed_rows() >= 16  # applied at start-up
    second.warmup()
    assert second.runner.packed_rows() >= 16


def test_a_limit_cut_short_by_the_engines_size_is_used_but_not_cached(tiny_planned, cache, monkeypatch) -> None:
    small = engine(tiny_planned, max_num_seqs=12, **PLANNED)
    if small.runner.packed_rows() == 0:
        pytest.skip("no compiled plan here: the int8-activation kernels need AVX-512 VNNI")
    assert narrowed(small, 4) == 4
    monkeypatch.setattr(LLMEngine, "_packed_against_crossovers", lambda self, rows, base, steps=5: (1.0, 2.0))
    small.warmup()  # packed wins at 6, 8 and 12 rows; 16 is past this engine's max_num_seqs
    assert small.runner.packed_rows() == 12
    assert small.machine_profile.packed_step_rows is None and small.info.machine_profile["packed_step_rows"] is None
    (path,) = cache.glob("*.json")
    assert json.loads(path.read_text())["packed_step_rows"] is None  # a bigger engine times it again
    # A pool that turned out not to hold the sequences (an infinite time): the same, nothing cached.
    monkeypatch.setattr(LLMEngine, "_packed_against_crossovers",
                        lambda self, rows, base, steps=5: (float("inf"), 0.0))
    full = engine(tiny_planned, max_num_seqs=64, **PLANNED)
    assert narrowed(full, 4) == 4
    full.warmup()
    assert full.runner.packed_rows() == 4 and full.machine_profile.packed_step_rows is None
    assert json.loads(path.read_text())["packed_step_rows"] is None


def test_packed_against_crossovers_times_real_steps_and_leaves_nothing_behind(tiny_planned, cache) -> None:
    e = engine(tiny_planned, max_num_seqs=16, **PLANNED)
    if e.runner.packed_rows() == 0:
        pytest.skip("no compiled plan here: the int8-activation kernels need AVX-512 VNNI")
    assert narrowed(e, 4) == 4
    steps = e.num_steps
    packed_ms, crossover_ms = e._packed_against_crossovers(8, 4)
    assert packed_ms > 0 and crossover_ms > 0
    assert not e.has_unfinished_requests and e.kv.num_free_blocks == e.kv.num_blocks
    assert e.num_steps == steps and e.runner.packed_rows() == 4
    rid = e.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))  # and it still serves
    assert len(e.run_to_completion([rid])[rid].outputs[0].token_ids) == 3


def test_a_dense_model_has_no_crossovers_and_still_starts(tiny_planned, cache) -> None:
    e = engine(tiny_planned, quantization="none", dtype="bfloat16")
    assert e.machine_profile is not None and e.machine_profile.crossovers == []
    assert e.runner.packed_rows() == 0
    e.warmup()  # nothing packed: no step limit to time
    assert e.machine_profile.packed_step_rows is None
