"""The sampler draws from the distribution it claims to, on a small vocabulary (chi-square tests)."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from tokenfactory.engine.sampler import Sampler, SamplingBatch, apply_top_k_top_p

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
