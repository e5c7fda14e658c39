"""Speculative decoding on tiny random models: greedy output identical with and without drafts (batched,
chunked prefill, prefix hits, preemption, stops), the rejection sampler's output distribution (a chi-square
test on a small vocabulary), and the decision that switches drafting off when it does not pay."""

from __future__ import annotations

import pytest
import torch

import tokenfactory.engine.speculative as speculative
from tests.reference import tiny_random_model_dir
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.kv_cache import BlockManager
from tokenfactory.engine.sampler import Sampler
from tokenfactory.engine.sequence import Draft, Sequence
from tokenfactory.engine.speculative import NgramProposer, Speculator, StepCost
from tokenfactory.models.loader import load_model
from tokenfactory.types import ParameterError, SamplingParams


def linear_cost(base_s: float, per_row_s: float) -> StepCost:
    """A frozen step cost: base + per_row x rows (not rescaled by what steps really take)."""
    return StepCost([(1, base_s + per_row_s), (1024, base_s + 1024 * per_row_s)], adapt=False)


def set_costs(spec: Speculator, base_s: float, per_row_s: float, draft_s: float) -> None:
    """Replace the measured costs: a frozen linear step, no verification overhead, draft_s per draft token."""
    spec.cost = linear_cost(base_s, per_row_s)
    spec.span_s = spec.draft_row_s = 0.0
    # The speculator scales the modelled draft cost by what drafting took on the wall clock; divided by that
    # scale, the effective cost stays draft_s whatever this (possibly loaded) machine's timings say.
    spec.draft_cost_per_token = lambda batch: draft_s / spec.draft_cost_scale


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tests check tokens, not speed; on the shared 2-core machine two busy intra-op threads make a
    tiny model's step ~30x slower (spinning against other processes), so run them on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def flat_curve(*args: object) -> list[tuple[int, float]]:
    """A flat target step curve (memory-bound decode: k + 1 rows cost what one does), as data."""
    return [(1, 0.010), (256, 0.010)]


@pytest.fixture(autouse=True)
def no_timed_target_curve(monkeypatch):
    """Every test here decides by costs it sets (force_drafting, set_costs, the flat curve), so the target's curve
    is not timed: that took ~13 of this module's ~50 s, only to be replaced. It also keeps a loaded 2-core machine
    from retiring self-int4 at start-up, before force_drafting could make its drafts pay. The real timing runs
    where a real engine builds a speculator (test_speculative_real, test_compiled_decode, test_grammar)."""
    monkeypatch.setattr(speculative, "calibrate_target", flat_curve)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    target = tiny_random_model_dir(folder, request.param, attention_bias=None, num_heads=4, num_kv_heads=2)
    draft = tiny_random_model_dir(folder, "llama", num_layers=1, num_heads=4, num_kv_heads=2, seed=7, name="draft")
    return load_model(target), draft


def make_engine(loaded, speculative: str = "none", **kw) -> LLMEngine:
    cfg = dict(dtype="float32", block_size=8, kv_cache_memory=4 << 20, max_model_len=256)
    cfg.update(kw)
    return LLMEngine(EngineConfig(speculative=speculative, **cfg), loaded)


def force_drafting(engine: LLMEngine) -> None:
    """A cost model under which every draft token pays: the exactness tests must exercise verification."""
    spec = engine.speculator
    assert isinstance(spec, Speculator)
    set_costs(spec, 1.0, 0.0, 0.0)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, 49152, (20,), generator=gen).tolist()
    return [base * 3, base[:7] * 5, torch.randint(0, 49152, (40,), generator=gen).tolist(), base[:3] * 4]


def generate(engine: LLMEngine, ps: list[list[int]], params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in ps]
    outs = engine.run_to_completion(ids)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # every slot, rejected ones included, came back
    return [outs[i].outputs[0].token_ids for i in ids]


def methods(draft_dir) -> list[str]:
    return ["ngram", f"draft:{draft_dir}", "self-int4"]


@pytest.mark.parametrize("budget", [512, 7])
def test_greedy_identical_batched_chunked_and_prefix_hit(tiny, budget) -> None:
    loaded, draft_dir = tiny
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = generate(make_engine(loaded, max_num_batched_tokens=budget), prompts(), params)
    for method in methods(draft_dir):
        engine = make_engine(loaded, method, max_num_batched_tokens=budget)
        force_drafting(engine)
        assert generate(engine, prompts(), params) == plain, method
        m = engine.speculator.metrics()
        assert m is not None and m.num_draft_tokens > 0, method
        # Again: prompts and accepted outputs now come from the prefix cache.
        rid = engine.add_request(prompts()[0] + plain[0][:20], params)
        again = engine.run_to_completion([rid])[rid]
        assert again.num_cached_tokens >= 72
        reference = generate(make_engine(loaded), [prompts()[0] + plain[0][:20]], params)[0]
        assert again.outputs[0].token_ids == reference, method


def test_greedy_identical_after_preemption(tiny) -> None:
    loaded, draft_dir = tiny
    ps = [p * 2 for p in prompts()[:3]] + [prompts()[3]]
    per_block = loaded.config.kv_bytes_per_token(4) * 8
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(kv_cache_memory=24 * per_block, max_model_len=160, enable_prefix_caching=False)
    plain = generate(make_engine(loaded, **kw), ps, params)
    for method in methods(draft_dir)[:2]:
        engine = make_engine(loaded, method, **kw)
        force_drafting(engine)
        assert generate(engine, ps, params) == plain, method
        assert engine.scheduler.num_preemptions > 0


def test_stops_and_limits_cut_accepted_drafts(tiny) -> None:
    loaded, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = generate(make_engine(loaded), prompts()[:2], params)
    stop_token = plain[0][9]  # a token the output reaches mid-way, maybe inside an accepted draft
    for p in (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(stop_token,)),
              SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)):
        engine = make_engine(loaded, "ngram")
        force_drafting(engine)
        rids = [engine.add_request(x, p) for x in prompts()[:2]]
        spec = engine.run_to_completion(rids)
        base = make_engine(loaded)
        bids = [base.add_request(x, p) for x in prompts()[:2]]
        ref = base.run_to_completion(bids)
        for r, b in zip(rids, bids, strict=True):
            got, want = spec[r].outputs[0], ref[b].outputs[0]
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
            assert got.text == want.text
            if p.logprobs is not None:
                assert [lp[0].token_id for lp in got.logprobs] == [lp[0].token_id for lp in want.logprobs]
                assert [lp[0].logprob for lp in got.logprobs] == pytest.approx(
                    [lp[0].logprob for lp in want.logprobs], abs=1e-3)


def test_opt_out_penalties_and_seeded_sampling_are_not_drafted(tiny) -> None:
    loaded, _ = tiny
    engine = make_engine(loaded, "ngram")
    force_drafting(engine)
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False),
                   SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)):
        generate(engine, prompts()[:1], params)
    assert engine.speculator.metrics().num_drafts == 0


def test_bad_method_names_the_parameter(tiny) -> None:
    loaded, _ = tiny
    with pytest.raises(ParameterError) as e:
        make_engine(loaded, "medusa")
    assert e.value.param == "speculative"
    with pytest.raises(ParameterError) as e:
        make_engine(loaded, "draft:")
    assert e.value.param == "speculative"
    with pytest.raises(ParameterError) as e:
        EngineConfig(num_speculative_tokens=0)
    assert e.value.param == "num_speculative_tokens"


# -- the decision ---------------------------------------------------------------------------------------


def test_poor_acceptance_switches_a_request_off_and_then_the_method(tiny) -> None:
    loaded, draft_dir = tiny
    engine = make_engine(loaded, f"draft:{draft_dir}")
    spec = engine.speculator
    # A CPU-like single-stream cost: 10 ms a step, 0.2 ms a row, 4 ms a draft token (a slow draft model).
    set_costs(spec, 0.010, 0.0002, 0.004)
    # The prior (0.6) is above break-even at batch 1: a token pays iff (1 + a) / 14.4 ms beats plain
    # decoding's 1 / 10.2 ms (no margin for a single stream), i.e. a > 14.4 / 10.2 - 1, ~0.41.
    assert spec.break_even(1) == pytest.approx(0.0144 / 0.0102 - 1, abs=0.002)
    assert spec.break_even(1) < spec.acceptance_rate
    drafts_after: list[int] = []
    engine.step_listeners.append(lambda s: drafts_after.append(spec.num_drafts))
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    out = generate(engine, prompts()[2:3], params)
    assert out == generate(make_engine(loaded), prompts()[2:3], params)
    m = spec.metrics()
    assert m.num_drafts > 0 and m.num_accepted_tokens <= m.num_draft_tokens // 4  # a random draft model
    # It stops after a few failures; in the second half at most a rare re-probe (REPROBE_AFTER steps).
    assert drafts_after[len(drafts_after) // 2] <= 8 and drafts_after[-1] - drafts_after[len(drafts_after) // 2] <= 2
    generate(engine, prompts()[:1], params)  # the next request starts from the method's poor record
    m = spec.metrics()
    assert not m.enabled and m.num_decision_changes >= 1 and m.acceptance_rate < m.break_even_acceptance
    assert m.num_drafts <= drafts_after[-1] + 3


def test_large_batch_switches_off_small_batch_drafts(tiny) -> None:
    loaded, _ = tiny
    engine = make_engine(loaded, "ngram", max_num_seqs=64, kv_cache_memory=16 << 20)
    spec = engine.speculator
    # Compute-bound at large batch: 5 ms + 1 ms per row.
    set_costs(spec, 0.005, 0.001, 0.0)
    copy = prompts()[1]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    generate(engine, [copy] * 32, params)
    assert spec.metrics().num_drafts == 0 and spec.break_even(32) > spec.acceptance_rate
    generate(engine, [copy], params)
    assert spec.metrics().num_drafts > 0 and spec.enabled
    # Drafting pays at batch B iff some m draft tokens (the B first ones worth a each, then a^2, ...) give
    # (B + their worth) / (T(B) + m ms) > (1 + margin) B / T(B), with T(B) = 5 + B ms and a margin rising
    # from 0 for one stream to 10% from 8 on.
    alpha = spec.acceptance_rate

    def pays(b: int) -> bool:
        gains = sorted((alpha ** j for j in range(1, spec.k + 1) for _ in range(b)), reverse=True)
        need = (1 + 0.1 * min(1.0, (b - 1) / 7)) * b / (5 + b)
        return any((b + sum(gains[:m])) / (5 + b + m) > need for m in range(1, len(gains) + 1))

    assert spec.break_even_batch() == max((b for b in range(1, 65) if pays(b)), default=0) > 0


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    seq = Sequence("s", "s", 0, [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3], SamplingParams(), 0.0)
    proposer = NgramProposer()
    assert proposer.propose([seq], [3]) == [Draft([5, 7, 1])]  # "1 2 3" last seen before "5 7 1"
    seq.token_ids.extend([5, 7])  # incremental index: "3 5 7" occurred before
    assert proposer.propose([seq], [2]) == [Draft([1, 2])]
    assert proposer.propose([Sequence("t", "t", 0, [8, 6], SamplingParams(), 0.0)], [3]) == [None]


def test_trim_releases_only_unhashed_tail_blocks() -> None:
    kv = BlockManager(8, 4)
    assert kv.allocate("a", 14)  # 4 blocks
    kv.cache_full_blocks("a", list(range(14)), 9)  # 2 full computed blocks hashed
    kv.trim("a", 10)
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 5
    freed = next(iter(kv.free_queue))
    assert kv.blocks[freed].block_hash is None  # reused first
    with pytest.raises(AssertionError):
        kv.trim("a", 4)
    kv.free("a")
    assert kv.num_free_blocks == 8 and all(b.ref_count == 0 for b in kv.blocks)


# -- the output distribution ----------------------------------------------------------------------------


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit over the outcomes of non-zero probability; an outcome of
    zero probability that occurs at all gives p = 0."""
    possible = probs > 0
    if counts[~possible].sum() > 0:
        return 0.0
    expected = probs[possible] * counts.sum()
    stat = float(((counts[possible] - expected) ** 2 / expected).sum())
    df = int(possible.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def markov(seed: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    m = torch.rand(vocab, vocab, generator=gen, dtype=torch.float64) + 0.3
    return m / m.sum(dim=1, keepdim=True)  # (V, V): row a is the next-token distribution after a


def speculative_chain(target: torch.Tensor, draft: torch.Tensor | None, params: SamplingParams, length: int,
                      k: int, num: int, seed: int, accept_all: bool = False) -> torch.Tensor:
    """Sample `num` sequences of `length` tokens from a Markov-chain "model" by rounds of speculation
    through Sampler.verify; returns counts over the V ** length outcomes. `draft` None: a point-mass
    draft that always proposes token 0 (as n-gram lookup does)."""
    vocab = target.shape[0]
    sampler = Sampler(frozenset(), seed=seed)
    seq = Sequence("s", "s", 0, [0], params, 0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(vocab ** length, dtype=torch.float64)
    for _ in range(num):
        out: list[int] = []
        last = 0
        while len(out) < length:
            toks, q_rows = [], []
            for _ in range(k):
                prev = toks[-1] if toks else last
                if draft is None:
                    toks.append(0)
                else:
                    toks.append(int(torch.multinomial(draft[prev], 1, generator=gen)))
                    q_rows.append(draft[prev].float())
            d = Draft(toks, torch.stack(q_rows) if q_rows else None)
            if accept_all:
                emitted = toks
            else:
                rows = torch.stack([target[t] for t in [last, *toks]]).float().log()  # (k + 1, V)
                batch = sampler.prepare([seq] * (k + 1))
                emitted = [t.token_id for t in sampler.verify(rows, batch, [d])[0]]
            out.extend(emitted)
            last = out[-1]
        index = 0
        for t in out[:length]:
            index = index * vocab + t
        counts[index] += 1
    return counts


def chain_probs(target: torch.Tensor, length: int) -> torch.Tensor:
    vocab = target.shape[0]
    probs = torch.ones(1, dtype=torch.float64)
    last = torch.zeros(1, dtype=torch.long)
    for _ in range(length):
        probs = (probs.unsqueeze(1) * target[last]).flatten()  # (V ** i, V) -> (V ** (i + 1),)
        last = torch.arange(vocab).repeat(probs.numel() // vocab)
    return probs


def processed(target: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    logits = target.log() / temperature
    kth = logits.topk(top_k, dim=1).values[:, -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=1)


@pytest.mark.parametrize("draft_kind", ["model", "point-mass"])
def test_rejection_sampling_keeps_the_target_distribution(draft_kind) -> None:
    vocab, length, num = 3, 3, 4000
    target, draft = markov(0, vocab), markov(1, vocab)
    q = draft if draft_kind == "model" else None
    counts = speculative_chain(target, q, SamplingParams(temperature=1.0), length, k=3, num=num, seed=5)
    assert chi_square_p_value(counts, chain_probs(target, length)) > 1e-3
    # Temperature and top-k apply to the target: the output follows the processed distribution.
    params = SamplingParams(temperature=0.7, top_k=2)
    counts = speculative_chain(target, q, params, length, k=2, num=num, seed=6)
    assert chi_square_p_value(counts, chain_probs(processed(target, 0.7, 2), length)) > 1e-3


def test_the_distribution_test_catches_a_wrong_sampler() -> None:
    vocab, length = 3, 3
    target, draft = markov(0, vocab), markov(1, vocab)
    counts = speculative_chain(target, draft, SamplingParams(temperature=1.0), length, k=3, num=4000, seed=5,
                               accept_all=True)  # the draft's distribution, not the target's
    assert chi_square_p_value(counts, chain_probs(target, length)) < 1e-6


def test_a_step_cost_that_jumps_is_crossed_only_when_what_lies_past_it_pays() -> None:
    # As the bundled model's Q8_0 weights on a CPU: 7 ms, +0.6 ms a row up to 4 rows, then a dense kernel.
    cost = StepCost([(1, 0.007), (4, 0.0088), (5, 0.0100), (64, 0.030)], adapt=False)
    spec = Speculator("ngram", NgramProposer(), 4, 1024, 64, cost, lambda batch: 0.0)
    seq = Sequence("s", "s", 0, list(range(20)), SamplingParams(temperature=0, max_tokens=100), 0.0)
    seq.num_computed_tokens = 19
    for alpha, want in ((0.6, 3), (0.97, 4)):
        spec.num_accepted_decayed, spec.num_rejected_decayed = alpha * 1e6, (1 - alpha) * 1e6
        assert spec.plan([seq]) == {"s": want}, alpha  # 3 drafts stop short of the jump unless the 4th pays
    spec.num_accepted_decayed, spec.num_rejected_decayed = 0.05 * 1e6, 0.95 * 1e6
    assert spec.plan([seq]) == {} and spec.break_even(1) > 0.05
    # What verification costs beyond its rows counts too: 2 ms per drafting sequence turns 0.3 off.
    spec.num_accepted_decayed, spec.num_rejected_decayed = 0.3e6, 0.7e6
    assert spec.plan([seq]) == {"s": 1}
    spec.span_s = 0.002
    assert spec.plan([seq]) == {}


def test_a_draft_models_prefill_is_weighed_against_the_tokens_left() -> None:
    class Proposer(NgramProposer):
        def setup_seconds(self, seq: Sequence) -> float:
            return 0.5  # seconds to prefill the draft's cache for this request

    cost = StepCost([(1, 0.010), (64, 0.050)], adapt=False)
    spec = Speculator("draft", Proposer(), 4, 100_000, 64, cost, lambda batch: 0.001)
    spec.num_accepted_decayed, spec.num_rejected_decayed = 0.9e6, 0.1e6
    short, long = (Sequence(n, n, 0, list(range(20)), SamplingParams(temperature=0, max_tokens=m), 0.0)
                   for n, m in (("short", 20), ("long", 20_000)))
    for seq in (short, long):
        seq.num_computed_tokens = 19
    assert spec.plan([short]) == {}  # ~20 tokens cannot win back half a second
    assert spec.plan([long]) == {"long": 4}


def test_a_draft_as_slow_as_the_target_is_retired_and_its_model_freed(tiny) -> None:
    loaded, draft_dir = tiny
    engine = make_engine(loaded, f"draft:{draft_dir}")
    spec = engine.speculator
    set_costs(spec, 0.010, 0.0002, 0.0)  # a free draft pays: nothing to retire
    assert not spec.retire_if_hopeless()
    set_costs(spec, 0.010, 0.0002, 0.011)  # a draft token costs more than a target step
    proposer = spec.proposer
    spec.checked = False  # as at start-up: the first step checks
    assert spec.plan([]) == {} and spec.retired and not hasattr(proposer, "runner")  # the draft model is dropped
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert generate(engine, prompts()[:2], params) == generate(make_engine(loaded), prompts()[:2], params)
    m = spec.metrics()
    assert m.num_drafts == 0 and not m.enabled and m.break_even_acceptance == 1.0


@pytest.mark.parametrize("ratio,built", [(1.0, False), (0.25, True)])
def test_self_int4_of_a_target_as_small_is_never_built(tiny, monkeypatch, ratio, built) -> None:

    loaded, _ = tiny
    monkeypatch.setattr(speculative, "int4_bytes_ratio", lambda model: ratio)
    spec = make_engine(loaded, "self-int4").speculator
    # Flat T (no_timed_target_curve): k always-accepted drafts pay iff (1 + k) T > T + k ratio T, i.e. iff ratio < 1.
    assert isinstance(spec.proposer, speculative.DraftModelProposer) is built
    assert spec.retired is not built and spec.metrics().enabled is built
