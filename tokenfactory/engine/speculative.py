"""Speculative decoding that pays for itself: proposers, acceptance statistics and the cost model.

A draft is "more tokens for this request this step": before scheduling, `Speculator.propose` gives each
decoding sequence up to k draft tokens; the scheduler turns them into a chunk of 1 + k query tokens; the
model runner computes logits at each of them and the sampler verifies them (greedy: longest matching
prefix; sampled: rejection sampling, sampler.py). Rejected tokens' KV slots are released by the scheduler.

    method        proposer
    ngram         prompt lookup (Saxena 2023; vLLM's `ngram`): the longest suffix n-gram (n = 4..2) seen
                  earlier in the prompt or output proposes the tokens that followed it; no model
    draft:PATH    a smaller model with the same tokenizer, its own KV cache
    self-int4     the target's own weights quantized to int4 (engine/quant.py), its own KV cache

When to draft is a decision from measurements (rule: the marginal draft token must earn more tokens per
second than the step already makes). With per-token acceptance a (Leviathan et al. 2023, eq. 1 assumes
i.i.d. acceptance) the j-th draft token adds a^j expected tokens; it costs c seconds of verification
(c_tok per token, c_span more for a sequence's first draft: its chunk leaves the batched decode path)
plus the proposer's time per draft token d. Plain decoding at batch B makes R = B / T(B) tokens/s, and
adding work dT that yields dN tokens raises N / T iff dN / dT > R. So a request drafts its j-th token iff

    a_r^j > R * (c_tok + d + [j = 1] c_span)            (seconds x tokens/s: dimensionless)

which switches a request off when its own acceptance a_r falls, and everyone off above the batch size
where R * c approaches 1. T(tokens, spans) = c0 + c_tok tokens + c_span spans is calibrated at start-up
with timed steps and refined online by exponentially weighted least squares on decode-only steps.
This file is past ~400 lines because the proposers, the statistics and the decision change together.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from tokenfactory.engine.kv_cache import BlockManager
from tokenfactory.engine.sampler import SampledToken, Sampler, draw
from tokenfactory.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenfactory.engine.sequence import Draft, Sequence
from tokenfactory.types import ParameterError, SamplingParams, StepStats

if TYPE_CHECKING:
    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.engine import LLMEngine
    from tokenfactory.engine.model_runner import ModelRunner
    from tokenfactory.models.loader import LoadedModel

logger = logging.getLogger(__name__)

PRIOR_ACCEPTANCE = 0.5  # before any evidence
METHOD_PRIOR_WEIGHT = 2.0  # pseudo-observations of the prior in the method's acceptance
REQUEST_PRIOR_WEIGHT = 2.0  # pseudo-observations of the method's acceptance in a request's estimate
REQUEST_DECAY = 0.8  # per verification: a request's acceptance reflects its last ~5 drafts
METHOD_DECAY = 0.995  # per verification: the method's acceptance reflects its last ~200 drafts
REPROBE_AFTER = 16  # steps a switched-off request waits before its evidence is halved (and it may retry)
COST_DECAY = 0.98  # per decode-only step, in the online least squares


# -- proposers ----------------------------------------------------------------------------------------


class Proposer(Protocol):
    """Drafts tokens for decoding sequences. `propose` returns one entry per sequence, in order, with at
    most `ks[i]` tokens (fewer or None when it has nothing worth proposing); it must not change the
    sequences. `release` is called once a sequence is finished, so per-sequence state can be dropped."""

    name: str

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft | None]: ...
    def release(self, seq_id: str) -> None: ...


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


class DraftModelProposer:
    """A smaller model (or the target's int4 copy) drafts k tokens autoregressively, with its own KV
    cache. Its cache is kept per sequence as a shadow sequence: the tokens whose KV it holds are the
    target's accepted tokens plus the previous drafts; each step it rolls back to the longest prefix the
    target kept, computes what is missing (the whole prompt the first time), then decodes k tokens.
    Greedy requests draft the argmax; sampled ones draw from the draft's distribution q, which goes with
    the draft for rejection sampling."""

    def __init__(self, name: str, runner: ModelRunner, kv: BlockManager, sampler: Sampler) -> None:
        self.name = name
        self.runner, self.kv, self.sampler = runner, kv, sampler
        self.shadows: dict[str, Sequence] = {}
        self.shadow_to_num_target: dict[str, int] = {}  # target tokens the shadow copied at the last draft

    def release(self, seq_id: str) -> None:
        self.shadows.pop(seq_id, None)
        self.shadow_to_num_target.pop(seq_id, None)
        self.kv.free(seq_id)
        self.sampler.release(seq_id)

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
        greedy = logits.argmax(dim=-1).tolist()
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


class LinearCost:
    """Step time y (s) = theta . x, fitted by exponentially weighted least squares, shrunk toward the
    start-up calibration theta0 (a ridge prior worth `prior_weight` observations), so a batch size never
    seen yet is predicted from the calibration."""

    def __init__(self, theta0: list[float], prior_weight: float = 8.0, decay: float = COST_DECAY) -> None:
        n = len(theta0)
        self.theta0 = list(theta0)
        self.decay = decay
        self.prior = prior_weight
        self.xx = torch.zeros(n, n, dtype=torch.float64)  # weighted sum of x x^T
        self.xy = torch.zeros(n, dtype=torch.float64)
        self.theta = list(theta0)
        self.num_observations = 0

    def observe(self, x: list[float], y: float) -> None:
        xt = torch.tensor(x, dtype=torch.float64)
        self.xx.mul_(self.decay).add_(torch.outer(xt, xt))
        self.xy.mul_(self.decay).add_(xt * y)
        self.num_observations += 1
        if self.num_observations % 8 == 0:
            self._solve()

    def _solve(self) -> None:
        # Ridge toward theta0, scaled per coordinate so the prior weighs like `prior` observations.
        scale = torch.diagonal(self.xx).clamp(min=1e-12) / max(self.num_observations, 1)
        ridge = torch.diag(self.prior * scale)
        theta0 = torch.tensor(self.theta0, dtype=torch.float64)
        theta = torch.linalg.solve(self.xx + ridge, self.xy + ridge @ theta0)
        self.theta = [max(float(t), 0.0) for t in theta]

    def predict(self, x: list[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))


@dataclass
class _RequestEvidence:
    num_accepted: float = 0.0  # decayed counts of accepted draft tokens and of rejections
    num_rejected: float = 0.0
    num_skipped: int = 0  # steps without a draft since the evidence was last decayed


@dataclass(frozen=True)
class SpeculativeMetrics:
    """What /metrics shows: the counters, the current decision and its evidence."""

    method: str
    num_speculative_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_emitted_tokens: int
    accepted_by_position: tuple[int, ...]
    drafted_by_position: tuple[int, ...]
    time_saved_s: float
    enabled: bool
    acceptance_rate: float
    break_even_acceptance: float  # at the current batch size
    break_even_batch: int  # largest batch at which drafting pays at the method's acceptance (0: none)
    batch_size: int
    step_base_s: float  # calibrated/refined cost model: c0, c_tok, c_span (seconds)
    step_per_token_s: float
    step_per_span_s: float
    draft_per_token_s: float
    num_decision_changes: int


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
                 max_num_seqs: int, target_cost: LinearCost, draft_cost_per_token: Callable[[int], float]) -> None:
        self.method, self.proposer = method, proposer
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
        self.enabled = self.acceptance_rate > self.decide(1)[0]
        self.num_decision_changes = 0
        self.last_logged = 0.0

    # -- decision -----------------------------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float:
        n = self.num_accepted_decayed + self.num_rejected_decayed
        return (self.num_accepted_decayed + METHOD_PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (n + METHOD_PRIOR_WEIGHT)

    def decide(self, batch_size: int) -> tuple[float, float]:
        """Break-even acceptances (first draft token, each later one) at this batch size: R * c."""
        t_plain = max(self.cost.predict([1.0, batch_size, 0.0]), 1e-6)
        rate = batch_size / t_plain  # tokens/s of plain decoding
        per_token = self.cost.theta[1] + self.draft_cost_scale * self.draft_cost_per_token(batch_size)
        return rate * (per_token + self.cost.theta[2]), rate * per_token

    def break_even_batch(self) -> int:
        alpha = self.acceptance_rate
        return max((b for b in range(1, self.max_num_seqs + 1) if alpha > self.decide(b)[0]), default=0)

    def _request_acceptance(self, ev: _RequestEvidence) -> float:
        return ((ev.num_accepted + REQUEST_PRIOR_WEIGHT * self.acceptance_rate)
                / (ev.num_accepted + ev.num_rejected + REQUEST_PRIOR_WEIGHT))

    def _num_to_draft(self, seq: Sequence, first: float, later: float) -> int:
        limit = draft_limit(seq, self.k, self.max_model_len)
        if limit < 1:
            return 0
        ev = self.seq_to_evidence.setdefault(seq.seq_id, _RequestEvidence())
        alpha = self._request_acceptance(ev)
        if alpha <= first:
            ev.num_skipped += 1
            if ev.num_skipped >= REPROBE_AFTER:  # forget half: the method's acceptance pulls it back
                ev.num_accepted, ev.num_rejected, ev.num_skipped = ev.num_accepted / 2, ev.num_rejected / 2, 0
            return 0
        k = 1
        while k < limit and alpha ** (k + 1) > later:
            k += 1
        return k

    # -- the step -----------------------------------------------------------------------------------

    def propose(self, running: list[Sequence]) -> dict[str, Draft]:
        start = time.perf_counter()
        self.last_batch_size = batch = max(len(running), 1)
        first, later = self.decide(batch)
        seqs, ks = [], []
        for seq in running:
            if (k := self._num_to_draft(seq, first, later)) > 0:
                seqs.append(seq)
                ks.append(k)
        drafts: dict[str, Draft] = {}
        if seqs:
            for seq, draft in zip(seqs, self.proposer.propose(seqs, ks), strict=True):
                if draft is not None and draft.token_ids:
                    drafts[seq.seq_id] = draft
        self.last_propose_s = time.perf_counter() - start
        return drafts

    def observe(self, sched: SchedulerOutput, results: list[tuple[Sequence, list[SampledToken]]],
                stats: StepStats) -> None:
        """Count acceptance, refine the cost model, and note a change of the global decision."""
        seq_to_num_emitted = {seq.seq_id: len(toks) for seq, toks in results}
        num_spans = num_draft = num_accepted = 0
        has_prefill = False
        for chunk in sched.chunks:
            has_prefill |= chunk.is_prefill
            if chunk.draft is None:
                continue
            k = chunk.num_draft_tokens
            accepted = max(seq_to_num_emitted.get(chunk.seq.seq_id, 1) - 1, 0)
            self._count(chunk.seq.seq_id, k, accepted)
            num_spans += 1
            num_draft += k
            num_accepted += accepted
        verify_s = stats.duration_s - self.last_propose_s
        if not has_prefill and sched.chunks:
            self.cost.observe([1.0, float(sched.num_batched_tokens), float(num_spans)], verify_s)
        batch = max(len(sched.chunks), 1)
        if num_draft:
            modelled = self.draft_cost_per_token(batch) * num_draft
            if modelled > 0:
                self.draft_cost_scale = 0.9 * self.draft_cost_scale + 0.1 * min(self.last_propose_s / modelled, 10.0)
            t_plain = self.cost.predict([1.0, batch, 0.0])
            extra = self.cost.theta[1] * num_draft + self.cost.theta[2] * num_spans + self.last_propose_s
            self.time_saved_s += num_accepted * t_plain / batch - extra
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
        enabled = self.acceptance_rate > self.decide(batch)[0]
        if enabled == self.enabled:
            return
        self.enabled = enabled
        self.num_decision_changes += 1
        now = time.monotonic()
        if now - self.last_logged > 10.0:  # a decision that flaps with the batch size is logged rarely
            self.last_logged = now
            logger.info("speculative %s: now %s at batch %d — %s", self.method, "on" if enabled else "off",
                        batch, self.describe(batch))

    def describe(self, batch: int) -> str:
        first, _ = self.decide(batch)
        return (f"acceptance {self.acceptance_rate:.2f} vs break-even {first:.2f}; step cost "
                f"{self.cost.theta[0] * 1e3:.2f} ms + {self.cost.theta[1] * 1e3:.3f} ms/token + "
                f"{self.cost.theta[2] * 1e3:.3f} ms per speculative sequence, drafting "
                f"{self.draft_cost_scale * self.draft_cost_per_token(batch) * 1e3:.3f} ms/token; "
                f"pays up to batch {self.break_even_batch()}")

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
            break_even_acceptance=self.decide(batch)[0], break_even_batch=self.break_even_batch(),
            batch_size=batch, step_base_s=self.cost.theta[0], step_per_token_s=self.cost.theta[1],
            step_per_span_s=self.cost.theta[2],
            draft_per_token_s=self.draft_cost_scale * self.draft_cost_per_token(batch),
            num_decision_changes=self.num_decision_changes)


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


def time_step(runner: ModelRunner, kv: BlockManager, batch: int, k: int, ctx: int, repeats: int = 5) -> float:
    """Seconds for one step of `batch` sequences with `ctx` cached tokens, each decoding one token plus
    k draft tokens (k = 0: plain decode), verification included; the least of `repeats` runs. Run only
    while the pool holds no cached prefix: it writes KV into blocks it allocates and frees."""
    params = SamplingParams(temperature=0.0, max_tokens=None)
    seqs = [Sequence(f"calibrate-{i}", f"calibrate-{i}", 0, [0] * (ctx + 1), params, 0.0) for i in range(batch)]
    chunks = []
    for seq in seqs:
        seq.num_computed_tokens = ctx
        if not kv.allocate(seq.seq_id, ctx + 1 + k):
            raise ValueError("the KV cache is too small to calibrate speculative decoding")
        chunks.append(ScheduledChunk(seq, 1 + k, ctx, Draft([0] * k) if k else None))
    # The context was never written: zero it, so that no non-finite leftover reaches the KV it writes
    # (padded decode reads of a freed block must stay finite, see model_runner.py).
    used = torch.tensor([b for seq in seqs for b in kv.block_ids(seq.seq_id)], dtype=torch.long)
    for k_cache, v_cache in runner.kv_caches:
        k_cache[:, used.to(k_cache.device)] = 0
        v_cache[:, used.to(v_cache.device)] = 0
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


def calibrate_target(runner: ModelRunner, kv: BlockManager, k: int, max_model_len: int) -> list[float]:
    """[c0, c_tok, c_span] in seconds, least squares over timed steps at batch 1 and 4 with and without
    k draft tokens."""
    ctx = calibration_context(kv, k, max_model_len)
    time_step(runner, kv, 1, k, ctx, repeats=1)  # warm-up
    rows, ys = [], []
    for batch in (1, 4):
        for kk in (0, k):
            rows.append([1.0, batch * (1 + kk), batch if kk else 0])
            ys.append(time_step(runner, kv, batch, kk, ctx))
    theta = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                               torch.tensor(ys, dtype=torch.float64).unsqueeze(1)).solution.squeeze(1)
    return [max(float(t), 0.0) for t in theta]


def _draft_model_proposer(name: str, engine: LLMEngine, draft: LoadedModel, quantization: str
                          ) -> tuple[DraftModelProposer, Callable[[int], float]]:
    from tokenfactory.engine.model_runner import ModelRunner

    target = engine.model_config
    if draft.config.vocab_size != target.vocab_size or draft.tokenizer.vocab_size != engine.tokenizer.vocab_size:
        raise ParameterError("speculative", f"the draft model {draft.path} has a vocabulary of "
                             f"{draft.config.vocab_size} (tokenizer {draft.tokenizer.vocab_size}) but the "
                             f"target's is {target.vocab_size} ({engine.tokenizer.vocab_size}): they must "
                             f"share one tokenizer")
    sampler = Sampler(engine.eos_token_ids, seed=engine.config.seed + 1)
    kv = BlockManager(engine.capacity.num_blocks, engine.config.block_size, enable_prefix_caching=False)
    runner = ModelRunner(draft.config, draft.weights, device=engine.device, dtype=engine.dtype,
                         num_blocks=engine.capacity.num_blocks, block_size=engine.config.block_size,
                         max_model_len=engine.max_model_len, sampler=sampler, quantization=quantization,
                         raw_gguf=draft.raw_gguf)
    ctx = calibration_context(kv, 0, engine.max_model_len)
    time_step(runner, kv, 1, 0, ctx, repeats=1)
    d1, d4 = time_step(runner, kv, 1, 0, ctx), time_step(runner, kv, 4, 0, ctx)
    slope = max((d4 - d1) / 3, 0.0)
    base = max(d1 - slope, 0.0)
    # One draft forward per drafted position serves the whole batch: per sequence and token (base + slope B) / B.
    return DraftModelProposer(name, runner, kv, sampler), lambda b: (base + slope * b) / max(b, 1)


def _ngram(engine: LLMEngine, target: LoadedModel, arg: str | None) -> tuple[Proposer, Callable[[int], float]]:
    return NgramProposer(), lambda b: 2e-5  # a dict lookup per sequence; refined by the measured scale


def _draft(engine: LLMEngine, target: LoadedModel, arg: str | None) -> tuple[Proposer, Callable[[int], float]]:
    from tokenfactory.models.loader import load_model

    if not arg:
        raise ParameterError("speculative", "speculative 'draft:PATH' needs the draft model's path after 'draft:'")
    return _draft_model_proposer(f"draft:{arg}", engine, load_model(arg), "none")


def _self_int4(engine: LLMEngine, target: LoadedModel, arg: str | None) -> tuple[Proposer, Callable[[int], float]]:
    return _draft_model_proposer("self-int4", engine, target, "int4")


METHODS: dict[str, Callable[[LLMEngine, LoadedModel, str | None], tuple[Proposer, Callable[[int], float]]]] = {
    "ngram": _ngram, "draft": _draft, "self-int4": _self_int4,
}


def build_speculator(config: EngineConfig, target: LoadedModel, engine: LLMEngine) -> Speculator | NoSpeculation:
    """The configured method, calibrated on this machine; logs the decision and its evidence."""
    if config.speculative == "none":
        return NoSpeculation()
    name, _, arg = config.speculative.partition(":")
    if name not in METHODS:
        raise ParameterError("speculative", f"speculative must be none, ngram, draft:PATH or self-int4, "
                             f"got {config.speculative!r}")
    proposer, draft_cost = METHODS[name](engine, target, arg or None)
    theta0 = calibrate_target(engine.runner, engine.kv, config.num_speculative_tokens, engine.max_model_len)
    spec = Speculator(config.speculative, proposer, config.num_speculative_tokens, engine.max_model_len,
                      config.max_num_seqs, LinearCost(theta0), draft_cost)
    logger.info("speculative %s, up to %d draft tokens: %s at batch 1 — %s", config.speculative,
                config.num_speculative_tokens, "on" if spec.enabled else "off", spec.describe(1))
    return spec
