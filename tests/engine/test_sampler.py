"""The sampler draws from the distribution it claims to, on a small vocabulary (chi-square tests)."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from tokenfactory.engine.sampler import Sampler, SamplingBatch, apply_top_k_top_p, first_max

N = 6000


def draw(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
         min_p: float = 0.0) -> torch.Tensor:
    sampler = Sampler(frozenset())
    g = torch.Generator().manual_seed(0)
    rows = logits.expand(N, -1).contiguous()
    batch = SamplingBatch([temperature] * N, [top_k] * N, [top_p] * N, [min_p] * N, [g] * N, [], [], [None] * N)
    ids = torch.tensor([t.token_id for t in sampler.sample(rows, batch)])
    return torch.bincount(ids, minlength=logits.shape[-1]).double()


def check(counts: torch.Tensor, probs: torch.Tensor) -> None:
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token the distribution excludes"
    observed = counts[support].numpy()
    expected = (probs[support] / probs[support].sum()).numpy() * observed.sum()
    expected *= observed.sum() / expected.sum()  # exact totals, as chisquare insists
    assert chisquare(observed, expected).pvalue > 1e-3


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_plain_and_temperature() -> None:
    check(draw(LOGITS), torch.softmax(LOGITS, -1))
    check(draw(LOGITS, temperature=0.5), torch.softmax(LOGITS / 0.5, -1))


def test_top_k_top_p_min_p() -> None:
    p = torch.softmax(LOGITS, -1)
    check(draw(LOGITS, top_k=3), torch.where(torch.arange(6) < 3, p, 0))
    # top_p 0.8: the smallest prefix reaching 0.8 of the mass.
    cum = p.cumsum(0)
    keep = (cum - p) < 0.8
    check(draw(LOGITS, top_p=0.8), torch.where(keep, p, 0))
    check(draw(LOGITS, min_p=0.2), torch.where(p >= 0.2 * p.max(), p, 0))


def test_top_k_top_p_mask_keeps_at_least_one() -> None:
    out = apply_top_k_top_p(LOGITS.unsqueeze(0), [1], [0.01])
    assert torch.isfinite(out).sum() == 1 and out.argmax() == 0


def test_logit_bias_is_a_logits_processor_before_the_grammars() -> None:
    """logit_bias through the logits-processor seam (engine/logits.py): prepared only for batches that ask for
    it, on the sampler's copy, its row's alone, and seen by a later processor (the grammar's mask) as biased."""
    from tokenfactory.engine.logits import LogitBias
    from tokenfactory.engine.sequence import Sequence
    from tokenfactory.types import SamplingParams

    def seq(i: int, **kw) -> Sequence:
        return Sequence(f"s{i}", f"s{i}", 0, [1, 2], SamplingParams(temperature=0, **kw), 0.0)

    seen: list[torch.Tensor] = []

    class MaskAllBut3:  # a later stage, as a grammar's mask is
        def prepare(self, seqs):
            return self if any(s.params.logit_bias for s in seqs) else None

        def apply(self, logits: torch.Tensor) -> None:
            seen.append(logits.clone())
            logits[0, [0, 1, 2, 4, 5]] = float("-inf")

    sampler = Sampler(frozenset({5}), processors=[LogitBias(), MaskAllBut3()])
    assert sampler.prepare([seq(0), seq(1)]).processed == ()
    batch = sampler.prepare([seq(0, logit_bias={2: 10.0, 4: -100}), seq(1)])
    assert len(batch.processed) == 2
    logits = LOGITS.expand(2, -1).contiguous()
    before = logits.clone()
    assert [t.token_id for t in sampler.sample(logits, batch)] == [3, 0]
    assert torch.equal(logits, before)  # the caller's logits are left as they were
    assert seen[0][0, 2] == LOGITS[2] + 10 and seen[0][0, 4] == LOGITS[4] - 100 and torch.equal(seen[0][1], LOGITS)
    # Bias alone: +100 forces a token under sampling, -100 all but bans the argmax under greedy.
    only_bias = Sampler(frozenset(), processors=[LogitBias()])
    forced = only_bias.prepare([Sequence("f", "f", 0, [1], SamplingParams(logit_bias={5: 100}), 0.0)])
    assert {only_bias.sample(LOGITS[None], forced)[0].token_id for _ in range(50)} == {5}
    assert only_bias.sample(LOGITS[None], only_bias.prepare([seq(0, logit_bias={0: -100})]))[0].token_id == 1


def test_first_max_is_argmax_with_ties_anywhere_in_a_long_row():
    # max(dim=-1)'s vectorized CPU code must give argmax's answer: the first of equal maxima, wherever they are.
    g = torch.Generator().manual_seed(0)
    for rows in (1, 7, 48):
        x = torch.randint(-5, 3, (rows, 49152), generator=g).float()  # thousands of ties at each row's maximum
        x[0, 40000:] = 9.0  # one row's maxima only near its end
        assert first_max(x) == x.argmax(dim=-1).tolist()
        assert first_max(x.bfloat16().float()) == x.argmax(dim=-1).tolist()


def test_greedy_ids_from_the_caller_stand_only_while_nothing_changes_the_logits() -> None:
    """The decode step's head hands the sampler each row's first max: greedy rows take it as it is, and sampled
    rows never read it as their token; a penalty, logit_bias, a grammar's mask or min_tokens changes the logits,
    so the sampler finds the maxima again."""
    from tokenfactory.engine.logits import LogitBias
    from tokenfactory.engine.sequence import Sequence
    from tokenfactory.types import SamplingParams

    def seq(**kw) -> Sequence:
        return Sequence("s", "s", 0, [1, 2], SamplingParams(**kw), 0.0)

    sampler = Sampler(frozenset({5}), processors=[LogitBias()])
    logits = LOGITS[None]  # first max 0
    plain = sampler.prepare([seq(temperature=0)])
    assert [t.token_id for t in sampler.sample(logits, plain, greedy_ids=[0])] == [0]
    assert sampler.sample(logits, plain, greedy_ids=[4])[0].token_id == 4  # taken as given: the head's own search
    # A hint of 3 where the changed logits' first max is 1, 1 and 0: it must be ignored.
    for changed, token in ((dict(logit_bias={0: -100}), 1), (dict(repetition_penalty=4.0), 1),
                           (dict(min_tokens=3), 0)):
        batch = sampler.prepare([Sequence("s", "s", 0, [0, 2], SamplingParams(temperature=0, **changed), 0.0)])
        assert sampler.sample(logits, batch, greedy_ids=[3])[0].token_id == token, changed
    sampled = sampler.prepare([seq(temperature=1.0, seed=1)])
    drawn = {sampler.sample(logits, sampled, greedy_ids=[4])[0].token_id for _ in range(200)}
    assert len(drawn) > 2  # drawn from the distribution, not the given maximum
