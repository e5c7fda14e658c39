"""The batch band in the real Scheduler, driven without a model (fast, exact): batch sequences give way to
non-batch ones within one step whatever the policy (seats and blocks), are the victims and never the
preemptors, and keep their guaranteed seats (`batch_min_share`); under the "share" yield they hold only
those while other traffic is present, and take the rest again once it has been gone a while."""

from __future__ import annotations

import itertools

import pytest

from tokenfactory.config import EngineConfig
from tokenfactory.engine.kv_cache import BlockManager
from tokenfactory.engine.scheduler import POLICIES, Scheduler, make_policy
from tokenfactory.engine.sequence import Sequence, SequenceStatus
from tokenfactory.types import BANDS, ParameterError, SamplingParams

_ids = itertools.count()
POLICY_NAMES = sorted(POLICIES)


class Shape:
    """The FLOP shape the joules policy wants (a small model's)."""

    num_params, num_layers, num_heads, head_dim, hidden_size = 1_000_000, 2, 2, 16, 32
    num_kv_heads = 2


def seq(band: str, prompt: int = 16, max_tokens: int = 64, tenant: str = "t") -> Sequence:
    i = next(_ids)
    return Sequence(f"{band}{i}", f"{band}{i}", 0, list(range(1, prompt + 1)),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=float(i), tenant=tenant,
                    priority=BANDS[band])


def scheduler(policy: str, num_blocks: int = 512, max_num_seqs: int = 4, share: float = 0.0,
              yield_: str = "seats", idle_steps: int = 4) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 16), max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                     max_model_len=1024, policy=make_policy(policy, Shape()), batch_min_share=share,
                     batch_yield=yield_, batch_idle_steps=idle_steps)


def step(s: Scheduler) -> list[Sequence]:
    out = s.schedule()
    s.update(out, {c.seq.seq_id: [7] for c in out.chunks if c.samples})
    return [c.seq for c in out.chunks]


def running_batch(s: Scheduler) -> int:
    return sum(1 for q in s.running if q.priority == BANDS["batch"])


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("band", ["interactive", "standard"])
def test_a_waiting_request_takes_a_batch_seat_in_the_same_step(policy: str, band: str) -> None:
    s = scheduler(policy)
    batch = [seq("batch") for _ in range(6)]
    for q in batch:
        s.add(q)
    for _ in range(3):
        step(s)
    assert running_batch(s) == 4  # every seat filled with batch work
    chat = seq(band)
    s.add(chat)
    served = step(s)
    assert chat in served and chat.status is SequenceStatus.RUNNING
    assert running_batch(s) == 3
    victim = next(q for q in batch if q.num_preemptions)  # the newest running batch sequence went back
    assert victim.status is SequenceStatus.WAITING and victim not in served


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_waiting_request_takes_a_batch_sequences_blocks_in_the_same_step(policy: str) -> None:
    # 8 blocks of 16: two 60-token prompts fill them, with room for 4 more tokens each
    s = scheduler(policy, num_blocks=8, max_num_seqs=8)
    for _ in range(2):
        s.add(seq("batch", prompt=60))
    step(s)
    assert running_batch(s) == 2 and s.kv.num_free_blocks == 0
    chat = seq("interactive", prompt=32, max_tokens=4)
    s.add(chat)
    assert chat in step(s)
    assert running_batch(s) == 1
    for _ in range(5):
        step(s)
    assert chat.is_finished


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_batch_never_preempts_others_and_waits_for_a_free_seat(policy: str) -> None:
    s = scheduler(policy)
    chats = [seq("standard", max_tokens=3) for _ in range(4)]
    for q in chats:
        s.add(q)
    step(s)
    job = seq("batch")
    s.add(job)
    step(s)
    assert job.status is SequenceStatus.WAITING and not any(q.num_preemptions for q in chats)
    while not all(q.is_finished for q in chats):
        step(s)
    step(s)
    assert job.status is SequenceStatus.RUNNING


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_waiting_non_batch_is_admitted_before_waiting_batch_whatever_the_arrival(policy: str) -> None:
    s = scheduler(policy, max_num_seqs=2)
    batch = [seq("batch") for _ in range(3)]
    chat = seq("standard")
    for q in [*batch, chat]:
        s.add(q)
    served = step(s)
    # The chat, last to arrive, takes one of the two seats; of the three earlier batch sequences only the
    # first in the policy's order takes the other (fcfs: the earliest), the rest wait.
    assert chat in served and len(served) == 2 and served[1 - served.index(chat)] in batch
    assert chat.status is SequenceStatus.RUNNING and running_batch(s) == 1
    assert sum(q.status is SequenceStatus.WAITING for q in batch) == 2


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_the_guaranteed_share_keeps_batch_seats_under_an_interactive_flood(policy: str) -> None:
    s = scheduler(policy, max_num_seqs=8, share=0.25)  # ceil(0.25 x 8) = 2 seats kept
    job = [seq("batch", max_tokens=200) for _ in range(4)]
    for q in job:
        s.add(q)
    step(s)
    assert running_batch(s) == 4
    for _ in range(40):  # far more interactive work than seats, for many steps
        while sum(1 for q in s.waiting if q.priority != BANDS["batch"]) < 8:
            s.add(seq("interactive", max_tokens=8))
        step(s)
        assert running_batch(s) == 2  # yielded down to the kept seats, never below
        assert len(s.running) - running_batch(s) <= 6  # nor are the kept seats given to the others
    assert all(q.num_output_tokens > 0 for q in job)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_without_a_share_batch_yields_every_seat(policy: str) -> None:
    s = scheduler(policy, max_num_seqs=4, share=0.0)
    for _ in range(4):
        s.add(seq("batch", max_tokens=200))
    step(s)
    for _ in range(4):
        s.add(seq("interactive", max_tokens=50))
    step(s)
    assert running_batch(s) == 0 and len(s.running) == 4


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_the_share_yield_cuts_batch_to_its_share_while_others_run_then_lets_it_fill_again(policy: str) -> None:
    s = scheduler(policy, max_num_seqs=8, share=0.25, yield_="share", idle_steps=4)  # 2 seats kept
    for _ in range(10):
        s.add(seq("batch", max_tokens=400))
    step(s)
    assert running_batch(s) == 8  # alone, batch fills every seat
    chat = seq("interactive", max_tokens=3)
    s.add(chat)
    assert chat in step(s)  # in the same step, and batch is down to its share although seats are free
    assert running_batch(s) == 2 and len(s.running) == 3
    while not chat.is_finished:
        step(s)
        assert running_batch(s) == 2
    for _ in range(3):  # no other traffic for fewer than idle_steps steps: still at its share (a gap)
        step(s)
        assert running_batch(s) == 2
    step(s)
    assert running_batch(s) == 8


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_with_no_share_the_share_yield_gives_batch_nothing_while_others_run(policy: str) -> None:
    s = scheduler(policy, max_num_seqs=8, share=0.0, yield_="share")
    for _ in range(4):
        s.add(seq("batch", max_tokens=400))
    step(s)
    s.add(seq("standard", max_tokens=50))
    step(s)
    assert running_batch(s) == 0 and len(s.running) == 1


def test_bad_batch_settings_name_the_parameter() -> None:
    with pytest.raises(ParameterError, match="batch_min_share"):
        scheduler("fcfs", share=1.5)
    with pytest.raises(ParameterError, match="batch_yield"):
        scheduler("fcfs", yield_="never")
    with pytest.raises(ParameterError, match="batch_yield"):
        EngineConfig(batch_yield="never")
