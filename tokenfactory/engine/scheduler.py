"""The engine's scheduler: how many tokens each sequence gets this step.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). Running
sequences are served first, oldest first: a decode needs one token, an unfinished prefill takes what
the budget allows (chunked prefill), so prefill and decode share a step. Then waiting sequences are
admitted in the order the policy gives, each first looking up its prompt in the prefix cache. When
the KV pool runs dry, the newest running sequence is preempted by recompute: its blocks are freed
(keeping their hashes, so the recompute often hits the prefix cache) and it waits again at the front.

Which *tenant's* request enters is admission's business (the gateway); the order of the waiting queue
is the pluggable `SchedulingPolicy` here, the seam for priorities and fair share.

The batch band (`BANDS["batch"]`: offline jobs) fills idle capacity and gives way within one step, whatever
the policy: running batch sequences are served after the others and are the first victims when blocks run
out; a waiting non-batch sequence that finds no seat (`max_num_seqs`) or no blocks preempts the newest
running batch sequence in the same step; waiting non-batch sequences are admitted before waiting batch
ones. `batch_min_share` keeps ceil(share x max_num_seqs) seats for batch work while it has any, so a busy
server still finishes it: non-batch sequences never preempt batch below that, nor are admitted into it.

How far batch gives way is `batch_yield`. "share" (the default): while other traffic is present, batch holds
only its kept seats, and takes the rest again once no other work has been seen for `batch_idle_steps`
steps (so a closed loop's gaps between requests do not make it expand and be preempted again). Extra rows
in a step are not free where compute is short (a CPU: each one lengthens the step every other sequence
waits for). "seats": batch gives up only the seats and blocks other sequences need, and otherwise fills
every free seat (where a decode row costs little, as on a GPU).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from tokenfactory.config import FlopShape
from tokenfactory.engine.fair import FairPolicy, JoulesFairPolicy
from tokenfactory.engine.kv_cache import BlockManager, PrefixHit
from tokenfactory.engine.sequence import Draft, Sequence, SequenceStatus
from tokenfactory.types import BANDS, FinishReason, ParameterError

BATCH_BAND = BANDS["batch"]
BATCH_YIELDS = ("share", "seats")  # how far the batch band gives way (the module's docstring)


class BatchDemand(NamedTuple):
    """What the batch band must make room for, counted once per step."""

    num_waiting_other: int  # waiting non-batch sequences
    num_running_other: int  # running non-batch sequences
    num_kept: int  # seats batch keeps: its guaranteed seats, or fewer if it has less work


class SchedulingPolicy(Protocol):
    """Orders the waiting queue. Every waiting sequence is in the policy exactly once; the scheduler
    iterates it in admission order and removes what it admits. A preempted sequence is re-added with
    `add_preempted` and should come before new arrivals of the same standing."""

    def add(self, seq: Sequence) -> None: ...
    def add_preempted(self, seq: Sequence) -> None: ...
    def remove(self, seq: Sequence) -> None: ...
    def __iter__(self) -> Iterator[Sequence]: ...
    def __len__(self) -> int: ...
    def on_scheduled(self, seq: Sequence, num_new_tokens: int) -> None:
        """Service received this step (for fair-share policies)."""


class FCFSPolicy:
    """First come, first served; preempted sequences go back to the front."""

    def __init__(self) -> None:
        self.queue: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.queue.append(seq)

    def add_preempted(self, seq: Sequence) -> None:
        self.queue.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        self.queue.remove(seq)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self.queue))

    def __len__(self) -> int:
        return len(self.queue)

    def on_scheduled(self, seq: Sequence, num_new_tokens: int) -> None:
        pass


POLICIES: dict[str, type] = {"fcfs": FCFSPolicy, "vtc": FairPolicy, "vtc-joules": JoulesFairPolicy}  # fair.py


def make_policy(name: str, shape: FlopShape) -> SchedulingPolicy:
    """The named policy, given what it needs at construction (the joules policy: the model's FLOP shape)."""
    cls = POLICIES[name]
    return cls(shape=shape) if cls is JoulesFairPolicy else cls()


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int
    num_context_tokens: int  # already in the KV cache before this step
    # Speculative tokens appended after the sequence's last token (counted in num_new_tokens): the step
    # computes logits at each of them and the sampler verifies them.
    draft: Draft | None = None

    @property
    def num_draft_tokens(self) -> int:
        return 0 if self.draft is None else len(self.draft.token_ids)

    @property
    def is_prefill(self) -> bool:
        return (self.num_new_tokens - self.num_draft_tokens > 1
                or self.num_context_tokens < self.seq.num_prompt_tokens)

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the sequence's tokens, so the step samples a next token."""
        return self.num_context_tokens + self.num_new_tokens - self.num_draft_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks if c.is_prefill)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: SchedulingPolicy | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), batch_min_share: float = 0.0,
                 batch_yield: str = "share", batch_idle_steps: int = 16) -> None:
        if not 0.0 <= batch_min_share <= 1.0:
            raise ParameterError("batch_min_share", f"batch_min_share must be in [0, 1], got {batch_min_share}")
        if batch_yield not in BATCH_YIELDS:
            raise ParameterError("batch_yield", f"batch_yield must be one of {', '.join(BATCH_YIELDS)}, "
                                 f"got {batch_yield!r}")
        self.kv = block_manager
        # The batch band (the module's docstring): seats kept while it has work, how far it gives way.
        self.num_batch_seats = math.ceil(batch_min_share * max_num_seqs)
        self.batch_yield, self.batch_idle_steps = batch_yield, batch_idle_steps
        self.num_steps_without_others = batch_idle_steps  # steps since non-batch work was last present
        self.demand = BatchDemand(0, 0, 0)
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: SchedulingPolicy = policy if policy is not None else FCFSPolicy()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def schedule(self, drafts: dict[str, Draft] | None = None, isolate: str | None = None) -> SchedulerOutput:
        """`drafts`: speculative tokens per decoding sequence; each is scheduled if the budget and the KV
        pool allow it right away (a draft never preempts anyone), else dropped or shortened. `isolate`: fault
        isolation (faults.py): only this request's sequences are served this step."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        drafts = drafts or {}
        # Batch sequences last (stable: oldest first within each group), so they are served after the
        # others and the newest batch sequence is the first victim when blocks run out.
        self.running.sort(key=lambda s: s.priority >= BATCH_BAND)
        self.demand = self._batch_demand()  # moves between running and waiting this step do not change it
        others = self.demand.num_waiting_other + self.demand.num_running_other > 0
        self.num_steps_without_others = 0 if others else self.num_steps_without_others + 1
        self._yield_seats(out, isolate)
        num_yielded = len(out.preempted)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if isolate is not None and seq.request_id != isolate:
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if (chunk := self._try_draft(seq, drafts.get(seq.seq_id), num_new, budget)) is not None:
                out.chunks.append(chunk)
                budget -= chunk.num_new_tokens
                i += 1
                continue
            while not self.kv.allocate(seq.seq_id, seq.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.chunks.append(ScheduledChunk(seq, num_new, seq.num_computed_tokens))
                budget -= num_new
                i += 1
                continue
            break  # preempted itself: nothing behind it can be served either
        if len(out.preempted) == num_yielded:  # no sequence preempted for lack of blocks
            budget = self._admit_waiting(out, budget, isolate)
        for chunk in out.chunks:
            self.waiting.on_scheduled(chunk.seq, chunk.num_new_tokens)
        # Decodes first, then prefills: the model runner batches the decodes' attention together.
        out.chunks.sort(key=lambda c: c.num_new_tokens > 1)
        return out

    def _try_draft(self, seq: Sequence, draft: Draft | None, num_new: int, budget: int) -> ScheduledChunk | None:
        if draft is None or num_new != 1 or seq.num_tokens - seq.num_computed_tokens != 1:
            return None
        k = min(len(draft.token_ids), budget - 1)
        if k < 1 or not self.kv.allocate(seq.seq_id, seq.num_computed_tokens + 1 + k):
            return None
        return ScheduledChunk(seq, 1 + k, seq.num_computed_tokens, draft.head(k))

    def _batch_demand(self) -> BatchDemand:
        num_waiting_other = num_waiting_batch = 0
        for seq in self.waiting:
            if seq.priority >= BATCH_BAND:
                num_waiting_batch += 1
            else:
                num_waiting_other += 1
        num_running_batch = sum(1 for s in self.running if s.priority >= BATCH_BAND)
        return BatchDemand(num_waiting_other, len(self.running) - num_running_batch,
                           min(self.num_batch_seats, num_running_batch + num_waiting_batch))

    @property
    def batch_cap(self) -> int:
        """The most seats batch may hold this step: its kept seats while other traffic is (or was just)
        present under the "share" yield, else all of them."""
        if self.batch_yield == "share" and self.num_steps_without_others < self.batch_idle_steps:
            return self.demand.num_kept
        return self.max_num_seqs

    def _yield_seats(self, out: SchedulerOutput, isolate: str | None) -> None:
        """Preempt the newest running batch sequences (never below the kept seats): those above the cap,
        and as many as waiting non-batch sequences lack seats; the running list is sorted, batch last."""
        if not self.running or self.running[-1].priority < BATCH_BAND:
            return
        num_batch = sum(1 for s in self.running if s.priority >= BATCH_BAND)
        num_short = self.demand.num_waiting_other - (self.max_num_seqs - len(self.running))
        num_yield = min(max(num_short, num_batch - self.batch_cap), num_batch - self.demand.num_kept)
        for _ in range(max(num_yield, 0)):
            if isolate is not None and self.running[-1].request_id != isolate:
                break
            self._preempt(self.running.pop(), out)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, isolate: str | None) -> int:
        """Non-batch sequences first (up to the seats batch does not keep), then batch ones (up to its cap)."""
        num_kept = self.demand.num_kept
        num_preempted = len(out.preempted)
        budget, blocked = self._admit_pass(out, budget, isolate, batch=False, max_seats=self.max_num_seqs - num_kept)
        if not blocked and len(out.preempted) == num_preempted:  # an evicted batch sequence waits a step
            budget, _ = self._admit_pass(out, budget, isolate, batch=True, max_seats=self.batch_cap)
        return budget

    def _admit_pass(self, out: SchedulerOutput, budget: int, isolate: str | None, batch: bool,
                    max_seats: int) -> tuple[int, bool]:
        """Admit waiting sequences of one side of the batch line in policy order; returns the budget
        left and whether the head of the line is blocked for lack of blocks."""
        num_seats = sum(1 for s in self.running if (s.priority >= BATCH_BAND) == batch)
        for seq in self.waiting:
            if (seq.priority >= BATCH_BAND) != batch:
                continue
            if budget <= 0 or len(self.running) >= self.max_num_seqs or num_seats >= max_seats:
                break
            if isolate is not None and seq.request_id != isolate:
                continue
            leader = seq.wait_for
            if leader is not None and not leader.is_finished and \
                    leader.num_computed_tokens < leader.num_prompt_tokens:
                continue  # admitted once its sibling's prompt blocks are cached
            prefix = PrefixHit([])
            if seq.num_computed_tokens == 0 and not seq.reads_every_position:
                prefix = self.kv.find_prefix(seq.token_ids)
            num_context = prefix.num_tokens(self.kv.block_size)
            num_new = min(seq.num_tokens - num_context, budget)
            while not self.kv.allocate(seq.seq_id, num_context + num_new, prefix):
                freed = None if batch else self._evict_batch(out)
                if freed is None:
                    return budget, True  # head-of-line: wait for blocks rather than let later arrivals overtake
                budget += freed
                num_new = min(seq.num_tokens - num_context, budget)
            self.waiting.remove(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_tokens = num_context
            seq.num_computed_tokens = num_context
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, num_new, num_context))
            budget -= num_new
            num_seats += 1
        return budget, False

    def _evict_batch(self, out: SchedulerOutput) -> int | None:
        """Preempt the newest running batch sequence (above the kept seats) for a non-batch one that
        lacks blocks, dropping its chunk from this step; returns the tokens its chunk had, or None."""
        batch = [s for s in self.running if s.priority >= BATCH_BAND]
        if len(batch) <= self.demand.num_kept:
            return None
        victim = batch[-1]
        chunk = next((c for c in out.chunks if c.seq is victim), None)
        if chunk is not None:
            out.chunks.remove(chunk)
        self.running.remove(victim)
        self._preempt(victim, out)
        return chunk.num_new_tokens if chunk is not None else 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(seq)
        out.preempted.append(seq)

    def update(self, out: SchedulerOutput, sampled: Mapping[str, int | list[int]]) -> None:
        """Apply a step's results: advance progress, append sampled tokens (the accepted draft tokens
        and one more, for a speculative chunk; then the tokens a grammar forced after them, which the next
        step computes as one chunk), cache newly full blocks, release the rejected draft
        tokens' slots, and finish sequences that hit a token-level stop (dropping tokens after it)."""
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.is_finished:
                continue  # aborted while the step ran
            got = sampled.get(seq.seq_id, [])
            tokens = [got] if isinstance(got, int) else got  # one sampled token, or a speculative step's
            # A speculative chunk's tokens are the accepted drafts and one more (then any a grammar forced: none
            # of those is computed yet). The accepted drafts' KV is valid, the rejected ones' is not.
            num_rejected = chunk.num_draft_tokens - min(max(len(tokens) - 1, 0), chunk.num_draft_tokens)
            seq.num_computed_tokens += chunk.num_new_tokens - num_rejected
            reason = None
            for token in tokens:
                seq.token_ids.append(token)
                if (reason := self._stop_reason(seq, token)) is not None:
                    break
            self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, min(seq.num_computed_tokens, seq.num_tokens))
            self.kv.release_outside_window(seq.seq_id, seq.num_computed_tokens)
            if seq.prompt_only and seq.num_computed_tokens >= seq.num_tokens:
                # Its prompt is computed and nothing is sampled: done, its blocks freed now (their hashes stay
                # in the prefix cache for the next request with the same prefix).
                reason = FinishReason.STOP if seq.pooling is not None else FinishReason.LENGTH
            if reason is not None:
                self.finish(seq, reason)
            elif num_rejected:
                self.kv.trim(seq.seq_id, seq.num_tokens)

    def stop_at(self, seq: Sequence, num_tokens: int) -> None:
        """Output processing found a stop string ending at the sequence's `num_tokens`-th token: drop the
        tokens after it (a speculative step accepts several at once) and finish it as stopped, also when a
        length limit had finished it at a later token of the same step."""
        del seq.token_ids[num_tokens:]
        if seq.is_finished:
            seq.finish_reason = FinishReason.STOP
        else:
            self.finish(seq, FinishReason.STOP)

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                return FinishReason.STOP
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence wherever it is (running, waiting, mid-step, or not yet here: compiling its grammar)
        and free its blocks at once."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
