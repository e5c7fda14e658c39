"""Speculative decoding that pays for itself: proposers, acceptance statistics and the cost model.

A draft is "more tokens for this request this step": before scheduling, `Speculator.propose` gives each
decoding sequence up to k draft tokens; the scheduler turns them into a chunk of 1 + k query tokens; the
model runner computes logits at each of them and the sampler verifies them (greedy: longest matching
prefix; sampled: rejection sampling, sampler.py). Rejected tokens' KV slots are released by the scheduler.

    method        proposer
    ngram         prompt lookup (Saxena 2023; vLLM's `ngram`): the longest suffix n-gram (n = 4..2) seen
                  earlier in the prompt or output proposes the tokens that followed it; no model
    draft:PATH    a smaller model with the same tokenizer, its own KV cache
    self-int4     the target's own weights quantized to int4 (layers/quant.py), its own KV cache

When to draft is a decision from measurements: each step, the drafts that maximise expected tokens per
second. With per-token acceptance a_r for request r (Leviathan et al. 2023, eq. 1 assumes i.i.d.
acceptance), its j-th draft token adds a_r^j expected tokens; m draft tokens in a step of B decoding
sequences cost T(B + m) - T(B) more target time plus m times the proposer's d per token. Candidates are
taken in order of a_r^j and the plan keeps the prefix m that maximises

    (B + sum of the first m gains) / (T(B + m) + m d)            (m = 0: plain decoding, B / T(B))

T(rows) is not linear on a CPU: a packed int8/int4 kernel gives way to a dense one past a few rows (at 4 -> 5
rows of the bundled model's Q8_0 weights a step costs 4 ms more, then ~0.3 ms a row), so it is a
piecewise-linear curve through steps timed at start-up, scaled online by what decode steps really take.
A request whose acceptance falls gets no candidates worth their cost; above the batch size where
T(B + 1) - T(B) + d exceeds a B / T(B), nobody does. A draft model must first prefill the request's text
in its own cache: that one-off cost is weighed against what the request's remaining tokens can save.
This file is past ~400 lines because the proposers, the statistics and the decision change together.
"""

from __future__ import annotations

import bisect
import ctypes
import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from tokenfactory.engine.client import SpeculativeMetrics
from tokenfactory.engine.kv_cache import BlockManager
from tokenfactory.engine.sampler import SampledToken, Sampler, draw, first_max
from tokenfactory.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenfactory.engine.sequence import Draft, Sequence
from tokenfactory.types import ParameterError, SamplingParams, StepStats

if TYPE_CHECKING:
    from tokenfactory.config import EngineConfig, ModelConfig
    from tokenfactory.engine.memory import KVCapacity
    from tokenfactory.engine.model_runner import ModelRunner
    from tokenfactory.models.loader import LoadedModel
    from tokenfactory.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Acceptance expected before any evidence, per method: an int4 copy of the target agrees with it on ~90% of
# tokens (measured here: 0.91-0.92), prompt lookup on half, an unknown draft model on a little more. A prior
# too low for a good draft switched self-int4 off after two unlucky drafts on a bf16 target.
PRIOR_ACCEPTANCE = {"ngram": 0.5, "draft": 0.6, "self-int4": 0.8}
METHOD_PRIOR_WEIGHT = 2.0  # pseudo-observations of the prior in the method's acceptance
REQUEST_PRIOR_WEIGHT = 2.0  # pseudo-observations of the method's acceptance in a request's estimate
REQUEST_DECAY = 0.8  # per verification: a request's acceptance reflects its last ~5 drafts
METHOD_DECAY = 0.995  # per verification: the method's acceptance reflects its last ~200 drafts
REPROBE_AFTER = 16  # steps a switched-off request waits before its evidence is halved (and it may retry)
COST_DECAY = 0.9  # per decode-only step: how fast the step-cost curve follows what steps take
# A step of 8 or more sequences drafts only where it expects this much more throughput than plain decoding
# (less below 8, none for a single stream, whose step is timed as it runs): at a batch the cost model errs
# by a few percent (contexts, load), and speculation makes a batch finish unevenly, leaving a smaller batch
# for the tail; at 32 clients a predicted +5% measured -6%.
REQUIRED_GAIN = 0.10
PROBE_AFTER = 32  # steps without any draft after which one request drafts one token (to keep evidence)
DEFAULT_REMAINING = 256  # tokens a request without max_tokens is expected to make (for a draft's prefill)


# -- proposers ----------------------------------------------------------------------------------------


class Proposer(Protocol):
    """Drafts tokens for decoding sequences. `propose` returns one entry per sequence, in order, with at
    most `ks[i]` tokens (fewer or None when it has nothing worth proposing); it must not change the
    sequences. `release` is called once a sequence is finished, so per-sequence state can be dropped."""

    name: str

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft | None]: ...
    def release(self, seq_id: str) -> None: ...
    def setup_seconds(self, seq: Sequence) -> float:
        """What drafting for this sequence costs before its first draft token (a draft model's prefill)."""
        ...

    def release_all(self) -> None:
        """Drop every per-sequence state and any model it holds (the speculator retires it)."""


@dataclass
class _NgramIndex:
    num_indexed: int = 0  # n-grams ending before this position are indexed
    ngram_to_end: dict[tuple[int, ...], int] = field(default_factory=dict)


class NgramProposer:
    """Prompt lookup: match the last n tokens (n = max_n down to min_n) against earlier text and propose
    what followed the most recent earlier occurrence. The index is incremental: each step adds only the
    n-grams ending at positions appended since the last one (token_ids only ever grow)."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.seq_to_index: dict[str, _NgramIndex] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft | None]:
        return [self._one(seq, k) for seq, k in zip(seqs, ks, strict=True)]

    def _one(self, seq: Sequence, k: int) -> Draft | None:
        tokens = seq.token_ids
        index = self.seq_to_index.setdefault(seq.seq_id, _NgramIndex())
        last = len(tokens) - 1
        # Index n-grams ending at positions < last: the suffix itself must not match itself.
        for end in range(index.num_indexed, last):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                index.ngram_to_end[tuple(tokens[end - n + 1:end + 1])] = end
        index.num_indexed = max(index.num_indexed, last)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = index.ngram_to_end.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                follow = tokens[end + 1:end + 1 + k]
                return Draft(list(follow)) if follow else None
        return None

    def release(self, seq_id: str) -> None:
        self.seq_to_index.pop(seq_id, None)

    def setup_seconds(self, seq: Sequence) -> float:
        return 0.0

    def release_all(self) -> None:
        self.seq_to_index.clear()


class _RetiredProposer:
    """What a retired speculator keeps: a name, why, and nothing to propose."""

    def __init__(self, name: str, reason: str = "") -> None:
        self.name, self.reason = name, reason

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft | None]:
        return [None] * len(seqs)

    def release(self, seq_id: str) -> None:
        pass

    def setup_seconds(self, seq: Sequence) -> float:
        return 0.0

    def release_all(self) -> None:
        pass


class DraftModelProposer:
    """A smaller model (or the target's int4 copy) drafts k tokens autoregressively, with its own KV
    cache. Its cache is kept per sequence as a shadow sequence: the tokens whose KV it holds are the
    target's accepted tokens plus the previous drafts; each step it rolls back to the longest prefix the
    target kept, computes what is missing (the whole prompt the first time), then decodes k tokens.
    Greedy requests draft the argmax; sampled ones draw from the draft's distribution q, which goes with
    the draft for rejection sampling."""

    def __init__(self, name: str, runner: ModelRunner, kv: BlockManager, sampler: Sampler,
                 prefill_s_per_token: float = 0.0) -> None:
        self.name = name
        self.runner, self.kv, self.sampler = runner, kv, sampler
        self.prefill_s_per_token = prefill_s_per_token
        self.shadows: dict[str, Sequence] = {}
        self.shadow_to_num_target: dict[str, int] = {}  # target tokens the shadow copied at the last draft

    def release(self, seq_id: str) -> None:
        self.shadows.pop(seq_id, None)
        self.shadow_to_num_target.pop(seq_id, None)
        self.kv.free(seq_id)
        self.sampler.release(seq_id)

    def release_all(self) -> None:
        self.shadows.clear()
        self.shadow_to_num_target.clear()
        del self.runner, self.kv  # the draft's weights and KV cache go with them

    def setup_seconds(self, seq: Sequence) -> float:
        shadow = self.shadows.get(seq.seq_id)
        missing = seq.num_tokens - (shadow.num_computed_tokens if shadow is not None else 0)
        return self.prefill_s_per_token * max(missing - 1, 0)  # the last token is a draft step's anyway

    def _sync(self, seq: Sequence) -> Sequence:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = Sequence(seq.seq_id, seq.request_id, seq.index,
                                                         seq.prompt_token_ids, seq.params, seq.arrival_time)
        num_target = self.shadow_to_num_target.get(seq.seq_id, 0)
        valid = num_target
        while (valid < shadow.num_computed_tokens and valid < seq.num_tokens
               and shadow.token_ids[valid] == seq.token_ids[valid]):
            valid += 1
        # At least the last token is recomputed: its logits give the first draft token.
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, valid, seq.num_tokens - 1)
        del shadow.token_ids[valid:]
        shadow.token_ids.extend(seq.token_ids[valid:])
        self.shadow_to_num_target[seq.seq_id] = seq.num_tokens
        return shadow

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft | None]:
        active: list[tuple[int, Sequence, int]] = []  # (position in seqs, shadow, k)
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            if k < 1:
                continue
            shadow = self._sync(seq)
            if not self.kv.allocate(shadow.seq_id, shadow.num_tokens + k):
                self.release(seq.seq_id)  # the draft's pool is full: this one goes without
                continue
            active.append((i, shadow, k))
        tokens: dict[str, list[int]] = {s.seq_id: [] for _, s, _ in active}
        probs: dict[str, list[torch.Tensor]] = {s.seq_id: [] for _, s, _ in active}
        for step in range(max((k for _, _, k in active), default=0)):
            batch = [s for _, s, k in active if k > step]
            for shadow, tok, q in zip(batch, *self._forward(batch), strict=True):
                shadow.token_ids.append(tok)
                tokens[shadow.seq_id].append(tok)
                if q is not None:
                    probs[shadow.seq_id].append(q)
        drafts: list[Draft | None] = [None] * len(seqs)
        for i, shadow, _ in active:
            q = probs[shadow.seq_id]
            drafts[i] = Draft(tokens[shadow.seq_id], torch.stack(q) if q else None)
        return drafts

    def _forward(self, batch: list[Sequence]) -> tuple[list[int], list[torch.Tensor | None]]:
        chunks = [ScheduledChunk(s, s.num_tokens - s.num_computed_tokens, s.num_computed_tokens) for s in batch]
        order = sorted(range(len(batch)), key=lambda j: chunks[j].num_new_tokens > 1)  # decodes first
        out = SchedulerOutput([chunks[j] for j in order])
        inputs = self.runner.prepare(out, self.kv.seq_to_block_ids)
        logits = torch.empty(0)
        if inputs.sampling is not None:
            logits = self.runner.logits(inputs)  # (S, V) in `order`
        for s in batch:
            s.num_computed_tokens = s.num_tokens
        sampling = inputs.sampling
        assert sampling is not None
        greedy = first_max(logits)
        dist = None if sampling.all_greedy else self.sampler.probs(logits, sampling)  # (S, V)
        toks: list[int] = [0] * len(batch)
        qs: list[torch.Tensor | None] = [None] * len(batch)
        for row, j in enumerate(order):
            if dist is None or sampling.temperatures[row] < 1e-5:
                toks[j] = greedy[row]
            else:
                toks[j], qs[j] = draw(dist[row], sampling.generators[row]), dist[row]
        return toks, qs


# -- measurements -------------------------------------------------------------------------------------


class StepCost:
    """Seconds for a decode step of `rows` query rows: piecewise linear through calibrated points (made
    non-decreasing; extrapolated with the last segment's slope). Each real decode-only step pulls the two
    points around its row count toward what it took (an exponentially weighted correction), so the curve
    learns the contexts and the load it actually serves, where it serves them."""

    def __init__(self, points: list[tuple[int, float]], adapt: bool = True, context: int = 0,
                 s_per_context_token: float = 0.0) -> None:
        """`points` were timed with rows of `context` cached tokens each; a row of c tokens costs
        (c - context) * s_per_context_token more (attention reads and scores its keys)."""
        if not points:
            raise ValueError("a step cost needs at least one timed point")
        self.context, self.s_per_context_token = context, s_per_context_token
        pts = sorted(points)
        if pts[0][0] > 1:
            pts.insert(0, (1, pts[0][1]))
        self.rows = [x for x, _ in pts]
        self.seconds = [max(y for _, y in pts[:i + 1]) for i in range(len(pts))]  # running max
        self.adapt = adapt

    def _segment(self, rows: float) -> tuple[int, float]:
        """(i, w): rows lies w of the way from point i to point i + 1 (w > 1 past the last segment)."""
        xs = self.rows
        if len(xs) == 1:
            return 0, 0.0
        i = min(max(bisect.bisect_right(xs, rows) - 1, 0), len(xs) - 2)
        return i, (rows - xs[i]) / (xs[i + 1] - xs[i])

    def _curve(self, rows: float) -> float:
        i, w = self._segment(rows)
        if len(self.rows) == 1:
            return self.seconds[0] * max(rows, 1) / self.rows[0]
        return max(self.seconds[i] + w * (self.seconds[i + 1] - self.seconds[i]), 1e-6)

    def predict(self, rows: float, context_tokens: float | None = None) -> float:
        """`context_tokens`: the sum over rows of their cached tokens (None: `context` each)."""
        extra = 0.0 if context_tokens is None else (context_tokens - rows * self.context) * self.s_per_context_token
        return max(self._curve(rows) + extra, 1e-6)

    def observe(self, rows: int, seconds: float, context_tokens: float | None = None) -> None:
        if not self.adapt or rows < 1 or len(self.rows) == 1:
            return
        i, w = self._segment(rows)
        w = min(w, 1.0)
        curve = self._curve(rows)
        seconds -= self.predict(rows, context_tokens) - curve  # what the curve itself should have said
        error = min(max(seconds, 0.25 * curve), 4 * curve) - curve
        rate = 1 - COST_DECAY
        self.seconds[i] = max(self.seconds[i] + rate * (1 - w) * error, 1e-6)
        self.seconds[i + 1] = max(self.seconds[i + 1] + rate * w * error, 1e-6)


@dataclass
class _RequestEvidence:
    num_accepted: float = 0.0  # decayed counts of accepted draft tokens and of rejections
    num_rejected: float = 0.0
    num_skipped: int = 0  # steps without a draft since the evidence was last decayed


# -- the speculator -----------------------------------------------------------------------------------


class NoSpeculation:
    """The null object: no drafts, nothing measured."""

    method = "none"

    def propose(self, running: list[Sequence]) -> dict[str, Draft]:
        return {}

    def observe(self, sched: SchedulerOutput, results: list[tuple[Sequence, list[SampledToken]]],
                stats: StepStats) -> None:
        pass

    def release(self, seq_id: str) -> None:
        pass

    def metrics(self) -> SpeculativeMetrics | None:
        return None


class Speculator:
    """Proposes drafts where they pay, and measures acceptance and cost to know where that is."""

    def __init__(self, method: str, proposer: Proposer, num_speculative_tokens: int, max_model_len: int,
                 max_num_seqs: int, target_cost: StepCost, draft_cost_per_token: Callable[[int], float],
                 verify_cost: tuple[float, float] = (0.0, 0.0)) -> None:
        self.method, self.proposer = method, proposer
        # Verification beyond the rows' own cost: seconds per drafting sequence and per draft token (their
        # logits over the whole vocabulary, the sampler's checks), measured at start-up.
        self.span_s, self.draft_row_s = verify_cost
        self.k = num_speculative_tokens
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.cost = target_cost
        self.draft_cost_per_token = draft_cost_per_token  # seconds per drafted token per sequence, at batch B
        self.draft_cost_scale = 1.0  # measured propose time / modelled, EWMA
        self.num_accepted_decayed, self.num_rejected_decayed = 0.0, 0.0
        self.seq_to_evidence: dict[str, _RequestEvidence] = {}
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = self.num_emitted_tokens = 0
        self.accepted_by_position = [0] * num_speculative_tokens
        self.drafted_by_position = [0] * num_speculative_tokens
        self.time_saved_s = 0.0
        self.last_batch_size = 1
        self.last_propose_s = 0.0
        self.last_setup_s = 0.0  # of last_propose_s, the modelled catch-up (prefill) part
        self.steps_without_draft = 0
        self.last_mean_context = float(target_cost.context)
        # Retired: nothing will ever be drafted (a draft that cannot pay); checked: that was decided.
        self.retired = self.checked = isinstance(proposer, _RetiredProposer)
        self.enabled = not self.retired and self._pays(1, self.acceptance_rate)
        self.num_decision_changes = 0
        self.last_logged = 0.0

    # -- decision -----------------------------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float:
        n = self.num_accepted_decayed + self.num_rejected_decayed
        prior = PRIOR_ACCEPTANCE.get(self.method.partition(":")[0], 0.5)
        return (self.num_accepted_decayed + METHOD_PRIOR_WEIGHT * prior) / (n + METHOD_PRIOR_WEIGHT)

    def _draft_s(self, batch: int) -> float:
        return self.draft_cost_scale * self.draft_cost_per_token(batch)

    def _best_prefix(self, batch: int, gains: list[tuple[float, bool, int]], context: float) -> int:
        """How many of the candidate draft tokens maximise tokens per second. `gains`: (expected tokens,
        whether it is its request's first draft token, its context), in decreasing order; `context`: the
        plain step's cached tokens summed over its rows."""
        d = self._draft_s(batch) + self.draft_row_s
        plain_rate = batch / self.cost.predict(batch, context)
        margin = REQUIRED_GAIN * min(1.0, (batch - 1) / 7)  # none for a single stream, whose cost is timed as is
        best_rate, best_m, tokens, spans = plain_rate * (1 + margin), 0, float(batch), 0
        for m, (gain, first, ctx) in enumerate(gains, 1):
            tokens += gain
            spans += first
            context += ctx
            rate = tokens / (self.cost.predict(batch + m, context) + d * m + self.span_s * spans)
            if rate > best_rate:
                best_rate, best_m = rate, m
        return best_m

    def _pays(self, batch: int, alpha: float) -> bool:
        """Would a batch of `batch` requests that all accept at `alpha` draft anything?"""
        ctx = self.last_mean_context
        gains = [(alpha ** j, j == 1, ctx) for j in range(1, self.k + 1) for _ in range(batch)]
        return self._best_prefix(batch, gains, ctx * batch) > 0

    def break_even(self, batch: int) -> float:
        """The least acceptance at which drafting pays at this batch size (1.0: it never does)."""
        if not self._pays(batch, 0.999):
            return 1.0
        lo, hi = 0.0, 0.999
        for _ in range(10):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self._pays(batch, mid) else (mid, hi)
        return hi

    def break_even_batch(self) -> int:
        alpha = self.acceptance_rate
        return max((b for b in range(1, self.max_num_seqs + 1) if self._pays(b, alpha)), default=0)

    def _request_acceptance(self, ev: _RequestEvidence) -> float:
        return ((ev.num_accepted + REQUEST_PRIOR_WEIGHT * self.acceptance_rate)
                / (ev.num_accepted + ev.num_rejected + REQUEST_PRIOR_WEIGHT))

    def _setup_pays(self, seq: Sequence, alpha: float, batch: int) -> bool:
        """A draft model's one-off prefill of this request against what its remaining tokens can save."""
        setup = self.proposer.setup_seconds(seq)
        if setup <= 0:
            return True
        p = seq.params
        remaining = (p.max_tokens - seq.num_output_tokens if p.max_tokens is not None
                     else min(DEFAULT_REMAINING, self.max_model_len - seq.num_tokens))
        per_token = self.cost.predict(batch) / batch
        best = 0.0
        for k in range(1, self.k + 1):  # the best number of drafts at this acceptance
            expected = sum(alpha ** j for j in range(k + 1))  # tokens per speculative step
            extra = (self.cost.predict(batch + k) - self.cost.predict(batch) + self.span_s
                     + (self._draft_s(batch) + self.draft_row_s) * k)
            best = max(best, ((expected - 1) * per_token - extra) * remaining / expected)
        return best > setup

    def retire_if_hopeless(self) -> bool:
        """Where drafts that were always accepted would not pay even alone (a draft as slow as the target),
        drop the proposer for good, freeing a draft model's weights and cache; metrics keep the evidence."""
        if self.retired or self._pays(1, 0.999):
            return False
        self.proposer.release_all()
        self.proposer = _RetiredProposer(self.proposer.name)
        self.retired = True
        _return_freed_memory()
        return True

    def plan(self, running: list[Sequence]) -> dict[str, int]:
        """Draft tokens per request this step (absent: none)."""
        if not self.checked:  # at the first step, so that a cost model set after start-up counts
            self.checked = True
            if self.retire_if_hopeless():
                logger.warning("speculative %s switched off for good: even drafts that were always accepted "
                               "would not pay on this machine, not even for a single stream (%s); its draft "
                               "model is freed", self.method, self.describe(1))
        if self.retired:
            return {}
        batch = max(len(running), 1)
        candidates: list[tuple[float, int, int]] = []  # (expected tokens it adds, position in running, j)
        context = sum(seq.num_tokens for seq in running)
        self.last_mean_context = context / batch
        for i, seq in enumerate(running):
            if (limit := draft_limit(seq, self.k, self.max_model_len)) < 1:
                continue
            ev = self.seq_to_evidence.setdefault(seq.seq_id, _RequestEvidence())
            alpha = self._request_acceptance(ev)
            if self._setup_pays(seq, alpha, batch):
                candidates.extend((alpha ** j, i, j) for j in range(1, limit + 1))
        candidates.sort(key=lambda c: (-c[0], c[2]))
        gains = [(g, j == 1, running[i].num_tokens + j) for g, i, j in candidates]
        chosen = candidates[:self._best_prefix(batch, gains, context)]
        ks: dict[str, int] = {}
        for _, i, _ in chosen:
            ks[running[i].seq_id] = ks.get(running[i].seq_id, 0) + 1
        if not ks and candidates:
            self.steps_without_draft += 1
            if self.steps_without_draft >= PROBE_AFTER:  # keep some evidence: one request drafts one token
                ks[running[candidates[0][1]].seq_id] = 1
        for seq in running:
            if seq.seq_id not in ks and (ev := self.seq_to_evidence.get(seq.seq_id)) is not None:
                ev.num_skipped += 1
                if ev.num_skipped >= REPROBE_AFTER:  # forget half: the method's acceptance pulls it back
                    ev.num_accepted, ev.num_rejected, ev.num_skipped = ev.num_accepted / 2, ev.num_rejected / 2, 0
        if ks:
            self.steps_without_draft = 0
        return ks

    # -- the step -----------------------------------------------------------------------------------

    def propose(self, running: list[Sequence]) -> dict[str, Draft]:
        start = time.perf_counter()
        self.last_batch_size = max(len(running), 1)
        ks = self.plan(running)
        drafts: dict[str, Draft] = {}
        self.last_setup_s = 0.0
        if ks:
            seqs = [seq for seq in running if seq.seq_id in ks]
            # A draft model's catch-up (a new request's prompt) is costed apart, not as per-token drafting.
            self.last_setup_s = sum(self.proposer.setup_seconds(seq) for seq in seqs)
            for seq, draft in zip(seqs, self.proposer.propose(seqs, [ks[s.seq_id] for s in seqs]), strict=True):
                if draft is not None and draft.token_ids:
                    drafts[seq.seq_id] = draft
        self.last_propose_s = time.perf_counter() - start
        return drafts

    def observe(self, sched: SchedulerOutput, results: list[tuple[Sequence, list[SampledToken]]],
                stats: StepStats) -> None:
        """Count acceptance, refine the cost model, and note a change of the global decision."""
        seq_to_num_emitted = {seq.seq_id: len(toks) for seq, toks in results}
        num_draft = num_accepted = 0
        has_prefill = False
        for chunk in sched.chunks:
            has_prefill |= chunk.is_prefill
            if chunk.draft is None:
                continue
            k = chunk.num_draft_tokens
            accepted = max(seq_to_num_emitted.get(chunk.seq.seq_id, 1) - 1, 0)
            self._count(chunk.seq.seq_id, k, accepted)
            num_draft += k
            num_accepted += accepted
        verify_s = stats.duration_s - self.last_propose_s
        rows = sched.num_batched_tokens
        if not has_prefill and sched.chunks:
            self.cost.observe(rows, verify_s, sum(c.num_new_tokens * (c.num_context_tokens + 1) for c in sched.chunks))
        batch = max(len(sched.chunks), 1)
        if num_draft:
            modelled = self.draft_cost_per_token(batch) * num_draft
            if modelled > 0:
                drafting_s = max(self.last_propose_s - self.last_setup_s, 0.0)
                self.draft_cost_scale = 0.9 * self.draft_cost_scale + 0.1 * min(max(drafting_s / modelled, 0.1), 10.0)
            plain = self.cost.predict(rows - num_draft)
            extra = (self.cost.predict(rows) - plain + self.last_propose_s + self.draft_row_s * num_draft
                     + self.span_s * sum(c.draft is not None for c in sched.chunks))
            self.time_saved_s += num_accepted * plain / batch - extra
        for seq, _ in results:
            if seq.is_finished:
                self.release(seq.seq_id)
        self._note_decision(batch)

    def _count(self, seq_id: str, k: int, accepted: int) -> None:
        rejected = 1 if accepted < k else 0
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += accepted + 1
        for j in range(k):
            self.drafted_by_position[j] += 1
        for j in range(accepted):
            self.accepted_by_position[j] += 1
        self.num_accepted_decayed = METHOD_DECAY * self.num_accepted_decayed + accepted
        self.num_rejected_decayed = METHOD_DECAY * self.num_rejected_decayed + rejected
        ev = self.seq_to_evidence.setdefault(seq_id, _RequestEvidence())
        ev.num_accepted = REQUEST_DECAY * ev.num_accepted + accepted
        ev.num_rejected = REQUEST_DECAY * ev.num_rejected + rejected
        ev.num_skipped = 0

    def _note_decision(self, batch: int) -> None:
        enabled = not self.retired and self._pays(batch, self.acceptance_rate)
        if enabled == self.enabled:
            return
        self.enabled = enabled
        self.num_decision_changes += 1
        now = time.monotonic()
        if now - self.last_logged > 10.0:  # a decision that flaps with the batch size is logged rarely
            self.last_logged = now
            logger.info("speculative %s: now %s at batch %d — %s", self.method, "on" if enabled else "off",
                        batch, self.describe(batch))

    def _per_draft_row_s(self, batch: int) -> float:
        rows = (self.cost.predict(batch * (1 + self.k)) - self.cost.predict(batch)) / (batch * self.k)
        return rows + self.draft_row_s + self.span_s / self.k

    def describe(self, batch: int) -> str:
        return (f"acceptance {self.acceptance_rate:.2f} vs break-even {self.break_even(batch):.2f}; a plain step "
                f"{self.cost.predict(batch) * 1e3:.2f} ms, verifying {self.k} drafts each "
                f"{self._per_draft_row_s(batch) * 1e3:.3f} ms/token, drafting {self._draft_s(batch) * 1e3:.3f} "
                f"ms/token; pays up to batch {self.break_even_batch()}")

    def release(self, seq_id: str) -> None:
        self.seq_to_evidence.pop(seq_id, None)
        self.proposer.release(seq_id)

    def metrics(self) -> SpeculativeMetrics:
        batch = self.last_batch_size
        return SpeculativeMetrics(
            method=self.method, num_speculative_tokens=self.k, num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens,
            num_emitted_tokens=self.num_emitted_tokens, accepted_by_position=tuple(self.accepted_by_position),
            drafted_by_position=tuple(self.drafted_by_position), time_saved_s=self.time_saved_s,
            enabled=self.enabled, acceptance_rate=self.acceptance_rate,
            break_even_acceptance=1.0 if self.retired else self.break_even(batch),
            break_even_batch=0 if self.retired else self.break_even_batch(),
            batch_size=batch, step_base_s=self.cost.predict(batch), step_per_token_s=self._per_draft_row_s(batch),
            draft_per_token_s=self._draft_s(batch), num_decision_changes=self.num_decision_changes)


def _return_freed_memory() -> None:
    """Hand the freed draft model back to the OS (glibc keeps freed heap pages otherwise): measured here, a
    process holding ~500 MB more than it uses decoded ~7% slower, the same steps on the same weights."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the allocator keeps what it keeps


def draft_limit(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many draft tokens this sequence may take now (0: none). Not drafted: prefilling sequences,
    requests that opted out, penalties (they depend on every previous token), min_tokens not yet met,
    and seeded sampling (a seed promises the same tokens whatever the batch, and whether a step drafts
    depends on the batch). Never past max_tokens or the context window."""
    p = seq.params
    if not p.speculative or seq.num_tokens - seq.num_computed_tokens != 1:
        return 0
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        return 0
    if seq.num_output_tokens < p.min_tokens or (p.seed is not None and not p.greedy):
        return 0
    if p.max_tokens is not None:
        k = min(k, p.max_tokens - seq.num_output_tokens - 1)
    return max(min(k, max_model_len - seq.num_tokens), 0)


# -- calibration and construction ---------------------------------------------------------------------


def time_step(runner: ModelRunner, kv: BlockManager, batch: int, k: int, ctx: int, repeats: int = 5,
              new_tokens: int = 1) -> float:
    """Seconds for one step of `batch` sequences with `ctx` cached tokens, each computing `new_tokens`
    tokens plus k draft tokens (k = 0, new_tokens = 1: plain decode; new_tokens > 1: prefill chunks),
    sampling or verification included; the least of `repeats` runs. Run only while the pool holds no
    cached prefix: it writes KV into blocks it allocates and frees."""
    params = SamplingParams(temperature=0.0, max_tokens=None)
    length = ctx + new_tokens
    seqs = [Sequence(f"calibrate-{i}", f"calibrate-{i}", 0, [0] * length, params, 0.0) for i in range(batch)]
    chunks = []
    for seq in seqs:
        seq.num_computed_tokens = ctx
        if not kv.allocate(seq.seq_id, length + k):
            for s in seqs:
                kv.free(s.seq_id)
            raise ValueError("the KV cache is too small to calibrate speculative decoding")
        chunks.append(ScheduledChunk(seq, new_tokens + k, ctx, Draft([0] * k) if k else None))
    # The context was never written: zero it, so that no non-finite leftover reaches the KV it writes.
    runner.zero_kv_blocks([b for seq in seqs for b in kv.block_ids(seq.seq_id)])
    best = math.inf
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            runner.run(runner.prepare(SchedulerOutput(chunks), kv.seq_to_block_ids))
            best = min(best, time.perf_counter() - start)
    finally:
        for seq in seqs:
            kv.free(seq.seq_id)
            runner.sampler.release(seq.seq_id)
    return best


def calibration_context(kv: BlockManager, k: int, max_model_len: int) -> int:
    """Cached tokens per calibration sequence: up to 128, as long as 4 sequences fit the pool."""
    per_seq_blocks = kv.num_free_blocks // 4
    return max(min(128, max_model_len - k - 2, (per_seq_blocks - 1) * kv.block_size - k - 1), 1)


CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def calibrate_target(runner: ModelRunner, kv: BlockManager, k: int, max_model_len: int,
                     max_rows: int) -> list[tuple[int, float]]:
    """(rows, seconds) of plain decode steps of 1 .. max_rows sequences (a speculative chunk's rows cost
    what as many decode rows do: the attention kernel reads each sequence's keys once either way)."""
    ctx = calibration_context(kv, k, max_model_len)
    time_step(runner, kv, 1, 0, ctx, repeats=1)  # warm-up
    points = []
    for rows in (r for r in CALIBRATION_ROWS if r <= max(max_rows, 1)):
        per_seq = max(min(ctx, kv.num_free_blocks // rows * kv.block_size - kv.block_size), 1)
        try:
            points.append((rows, time_step(runner, kv, rows, 0, per_seq, repeats=3)))
        except ValueError:
            break  # the pool holds no more sequences: extrapolate from the last points
    return points


def calibrate_context(runner: ModelRunner, kv: BlockManager, k: int, max_model_len: int) -> float:
    """Seconds a decode row costs per cached token it attends to: 8 rows at the calibration context and
    at up to 1024 tokens (the curve is timed at the former; real requests run at any)."""
    short = calibration_context(kv, k, max_model_len)
    long = min(1024, max_model_len - 2, (kv.num_free_blocks // 8 - 1) * kv.block_size - 1)
    if long <= 2 * short:
        return 0.0
    t_short = time_step(runner, kv, 8, 0, short, repeats=3)
    t_long = time_step(runner, kv, 8, 0, long, repeats=3)
    return max((t_long - t_short) / (8 * (long - short)), 0.0)


def calibrate_verify(runner: ModelRunner, kv: BlockManager, k: int, max_model_len: int,
                     cost: StepCost) -> tuple[float, float]:
    """(seconds per drafting sequence, seconds per draft token) that speculative chunks cost beyond as many
    plain decode rows: each draft row needs logits over the whole vocabulary (the LM head is ~20% of the
    bundled model's weights) and the sampler's check. Per token from 8 sequences verifying k drafts each
    (big enough to stand out of the timing noise), per sequence from one verifying a single draft."""
    ctx = calibration_context(kv, k, max_model_len)
    batch = max(min(8, kv.num_free_blocks // (-(-(ctx + k + 1) // kv.block_size))), 1)
    per_row = max((time_step(runner, kv, batch, k, ctx, repeats=3) - cost.predict(batch * (1 + k))) / (batch * k), 0.0)
    span = time_step(runner, kv, 1, 1, ctx, repeats=3) - cost.predict(2) - per_row
    return max(span, 0.0), per_row


@dataclass(frozen=True)
class SpecHost:
    """What building a speculator needs of the engine being built: passed in, never a half-built engine."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    capacity: KVCapacity
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    runner: ModelRunner
    kv: BlockManager


def _draft_model_proposer(name: str, host: SpecHost, draft: LoadedModel, quantization: str
                          ) -> tuple[DraftModelProposer, Callable[[int], float]]:
    from tokenfactory.engine.model_runner import ModelRunner

    target = host.model_config
    if draft.config.vocab_size != target.vocab_size or draft.tokenizer.vocab_size != host.tokenizer.vocab_size:
        raise ParameterError("speculative", f"the draft model {draft.path} has a vocabulary of "
                             f"{draft.config.vocab_size} (tokenizer {draft.tokenizer.vocab_size}) but the "
                             f"target's is {target.vocab_size} ({host.tokenizer.vocab_size}): they must "
                             f"share one tokenizer")
    sampler = Sampler(host.eos_token_ids, seed=host.config.seed + 1)
    kv = BlockManager(host.capacity.num_blocks, host.config.block_size, enable_prefix_caching=False)
    runner = ModelRunner(draft.config, draft.weights, device=host.device, dtype=host.dtype,
                         num_blocks=host.capacity.num_blocks, block_size=host.config.block_size,
                         max_model_len=host.max_model_len, sampler=sampler, quantization=quantization,
                         raw_gguf=draft.raw_gguf, decode_step=host.config.decode_step,
                         max_num_seqs=host.config.max_num_seqs)  # the draft's decode steps run as the target's
    ctx = calibration_context(kv, 0, host.max_model_len)
    time_step(runner, kv, 1, 0, ctx, repeats=1)
    d1, d4 = time_step(runner, kv, 1, 0, ctx), time_step(runner, kv, 4, 0, ctx)
    slope = max((d4 - d1) / 3, 0.0)
    base = max(d1 - slope, 0.0)
    prefill = time_step(runner, kv, 1, 0, 0, repeats=2, new_tokens=ctx) / ctx
    # One draft forward per drafted position serves the whole batch: per sequence and token (base + slope B) / B.
    return (DraftModelProposer(name, runner, kv, sampler, prefill_s_per_token=prefill),
            lambda b: (base + slope * b) / max(b, 1))


Built = tuple[Proposer, Callable[[int], float]]  # a proposer and its modelled seconds per draft token at batch B


def _ngram(host: SpecHost, target: LoadedModel, arg: str | None, cost: StepCost, k: int) -> Built:
    return NgramProposer(), lambda b: 2e-5  # a dict lookup per sequence; refined by the measured scale


def _draft(host: SpecHost, target: LoadedModel, arg: str | None, cost: StepCost, k: int) -> Built:
    from tokenfactory.models.loader import load_model

    if not arg:
        raise ParameterError("speculative", "speculative 'draft:PATH' needs the draft model's path after 'draft:'")
    return _draft_model_proposer(f"draft:{arg}", host, load_model(arg), "none")


def int4_bytes_ratio(model: torch.nn.Module) -> float:
    """Bytes an int4 (group 32) copy of the model reads per decode token / what the model reads now."""
    from tokenfactory.layers.quant import QuantizedLinear, decode_weight_bytes

    int4 = sum(0.625 * m.in_features * m.out_features  # 4-bit codes + a bf16 scale and zero per 32
               for m in model.modules() if isinstance(m, torch.nn.Linear | QuantizedLinear))
    int4 += sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 1)
    return int4 / max(decode_weight_bytes(model), 1)


def _self_int4(host: SpecHost, target: LoadedModel, arg: str | None, cost: StepCost, k: int) -> Built:
    # Decode is bound by the bytes it reads: an int4 copy of a target that is int4 already (a Q4 GGUF under
    # `auto`) decodes as slowly as the target. If drafts that were always accepted could not pay at that
    # speed (k drafts: (1 + k) tokens for T(1 + k) + k d vs 1 token for T(1)), do not build it at all.
    ratio = int4_bytes_ratio(host.runner.model)
    d = ratio * cost.predict(1)
    if (1 + k) * cost.predict(1) <= cost.predict(1 + k) + k * d:
        return _RetiredProposer("self-int4", f"an int4 copy reads {ratio:.2f}x the target's bytes per token, "
                                f"so a draft token would cost ~{d * 1e3:.2f} ms against a "
                                f"{cost.predict(1) * 1e3:.2f} ms target step"), lambda b: ratio * cost.predict(b) / b
    return _draft_model_proposer("self-int4", host, target, "int4")


METHODS: dict[str, Callable[[SpecHost, LoadedModel, str | None, StepCost, int], Built]] = {
    "ngram": _ngram, "draft": _draft, "self-int4": _self_int4,
}


def build_speculator(host: SpecHost, target: LoadedModel) -> Speculator | NoSpeculation:
    """The configured method, calibrated on this machine; logs the decision and its evidence."""
    config = host.config
    if config.speculative == "none":
        return NoSpeculation()
    name, _, arg = config.speculative.partition(":")
    if name not in METHODS:
        raise ParameterError("speculative", f"speculative must be none, ngram, draft:PATH or self-int4, "
                             f"got {config.speculative!r}")
    k = config.num_speculative_tokens
    points = calibrate_target(host.runner, host.kv, k, host.max_model_len,
                              min(config.max_num_batched_tokens, config.max_num_seqs * (1 + k)))
    cost = StepCost(points, context=calibration_context(host.kv, k, host.max_model_len),
                    s_per_context_token=calibrate_context(host.runner, host.kv, k, host.max_model_len))
    proposer, draft_cost = METHODS[name](host, target, arg or None, cost, k)
    verify = calibrate_verify(host.runner, host.kv, k, host.max_model_len, cost)
    spec = Speculator(config.speculative, proposer, k, host.max_model_len, config.max_num_seqs, cost, draft_cost,
                      verify)
    if isinstance(proposer, _RetiredProposer):
        logger.warning("speculative %s is off for good and its draft was never built: %s", config.speculative,
                       proposer.reason)
        return spec
    logger.info("speculative %s, up to %d draft tokens: %s at batch 1 — %s", config.speculative,
                config.num_speculative_tokens, "on" if spec.enabled else "off", spec.describe(1))
    return spec
