"""Block manager and scheduler invariants, property-tested: no leaked block after any sequence of
add / step / abort / finish; ref counts match the tables holding each block; a block is shared only
through a prefix-hash hit."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfactory.engine.kv_cache import BlockManager, hash_block
from tokenfactory.engine.scheduler import Scheduler
from tokenfactory.engine.sequence import Sequence
from tokenfactory.types import FinishReason, SamplingParams


def check_invariants(kv: BlockManager) -> None:
    holders = Counter(b for table in kv.seq_to_block_ids.values() for b in table)
    for block in kv.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), block
        assert (block.ref_count == 0) == (block.block_id in kv.free_queue), block
    for h, block_id in kv.hash_to_block_id.items():
        assert kv.blocks[block_id].block_hash == h
    # Every block held by several tables must carry a hash (it was shared through a prefix hit).
    for block_id, n in holders.items():
        if n > 1:
            assert kv.blocks[block_id].block_hash is not None
    for table in kv.seq_to_block_ids.values():
        assert len(set(table)) == len(table)


def test_prefix_hit_shares_full_blocks_and_never_the_last_token() -> None:
    kv = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert kv.allocate("a", len(prompt))
    kv.cache_full_blocks("a", prompt, num_computed_tokens=10)
    hit = kv.find_prefix(prompt)
    assert hit.block_ids == kv.block_ids("a")[:2]
    # A prompt of exactly 8 tokens may reuse only the first block: the last token must be computed.
    assert len(kv.find_prefix(prompt[:8]).block_ids) == 1
    assert kv.allocate("b", len(prompt), hit)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    check_invariants(kv)
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8
    check_invariants(kv)


def test_freed_blocks_are_revived_then_evicted_lru() -> None:
    kv = BlockManager(num_blocks=4, block_size=2)
    kv.allocate("a", 4)
    kv.cache_full_blocks("a", [1, 2, 3, 4], 4)
    kv.free("a")
    assert kv.find_prefix([1, 2, 3, 4, 5]).block_ids  # still cached after free
    kv.allocate("b", 8)  # takes all four blocks: the cached ones are evicted
    assert not kv.find_prefix([1, 2, 3, 4, 5]).block_ids
    check_invariants(kv)


def test_hash_collision_is_caught_by_token_check() -> None:
    kv = BlockManager(num_blocks=4, block_size=2)
    kv.allocate("a", 3)
    kv.cache_full_blocks("a", [7, 8, 9], 3)
    block = kv.blocks[kv.block_ids("a")[0]]
    block.token_ids = (0, 0)  # as if another prefix had produced the same hash
    assert not kv.find_prefix([7, 8, 9]).block_ids
    assert hash_block(None, (7, 8)) == block.block_hash


def test_allocation_is_all_or_nothing() -> None:
    kv = BlockManager(num_blocks=2, block_size=4)
    assert not kv.allocate("a", 9)  # needs 3 blocks of 2
    assert kv.num_free_blocks == 2
    assert "a" not in kv.seq_to_block_ids  # not even an empty table is left behind
    # Growing a table that cannot grow all the way keeps what it had, and takes nothing more.
    assert kv.allocate("b", 4)
    before = kv.block_ids("b")
    assert not kv.allocate("b", 12)
    assert kv.block_ids("b") == before and len(before) == 1 and kv.num_free_blocks == 1
    check_invariants(kv)


ops = st.lists(st.tuples(st.sampled_from(["add", "step", "abort", "finish"]),
                         st.integers(0, 40), st.integers(0, 3)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]))
def test_scheduler_never_leaks_blocks(ops: list[tuple[str, int, int]], num_blocks: int, block_size: int) -> None:
    kv = BlockManager(num_blocks, block_size)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=num_blocks * block_size)
    live: list[Sequence] = []
    for i, (op, length, variant) in enumerate(ops):
        if op == "add":
            # A few shared prefixes, so prefix hits happen.
            prompt = ([variant] * 6 + list(range(length)))[: max(1, min(length + 2, kv.num_blocks * block_size - 1))]
            seq = Sequence(f"s{i}", f"s{i}", 0, prompt, SamplingParams(max_tokens=1 + variant * 3), 0.0)
            sched.add(seq)
            live.append(seq)
        elif op == "step":
            out = sched.schedule()
            budget_used = sum(c.num_new_tokens for c in out.chunks)
            assert budget_used <= 16
            sampled = {c.seq.seq_id: (length + variant) % 50 for c in out.chunks if c.samples}
            sched.update(out, sampled)
        elif live:
            seq = live[length % len(live)]
            sched.finish(seq, FinishReason.ABORT if op == "abort" else FinishReason.STOP)
        check_invariants(kv)
        live = [s for s in live if not s.is_finished]
        held = {s.seq_id for s in live if kv.block_ids(s.seq_id)}
        assert held <= {s.seq_id for s in sched.running}
    for seq in live:
        sched.finish(seq, FinishReason.ABORT)
    assert kv.num_free_blocks == kv.num_blocks
    assert not kv.seq_to_block_ids
    check_invariants(kv)


def test_preemption_frees_the_newest_and_requeues_it_first() -> None:
    kv = BlockManager(num_blocks=4, block_size=2)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=8)
    a = Sequence("a", "a", 0, [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), 0.0)
    b = Sequence("b", "b", 0, [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True), 0.0)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [c.seq.seq_id for c in out.chunks] == ["a", "b"]
    sched.update(out, {"a": 9, "b": 9})  # 4 tokens each, 3 computed
    out = sched.schedule()  # token 4 of each still fits in their 2 blocks: pool now full
    assert not out.preempted
    sched.update(out, {"a": 9, "b": 9})
    out = sched.schedule()  # a needs a 3rd block for its 5th token: b, the newest, is preempted
    assert [s.seq_id for s in out.preempted] == ["b"]
    assert b.num_computed_tokens == 0 and next(iter(sched.waiting)) is b
    assert sched.num_preemptions == 1
    check_invariants(kv)
