"""The block manager with a sliding window (#18), property-tested through the scheduler: blocks wholly
before the window of a sequence's next token are back in the pool, the rest of the invariants of
tests/engine/test_kv_cache.py still hold (ref counts equal the live table entries, no leak after any add / step /
abort / finish, sharing only through a prefix hit), and a released block that kept its hash is revived by a
later prefix hit."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfactory.engine.kv_cache import BlockManager
from tokenfactory.engine.scheduler import Scheduler
from tokenfactory.engine.sequence import Sequence
from tokenfactory.types import FinishReason, SamplingParams


def live_entries(kv: BlockManager, seq_id: str) -> list[int]:
    return kv.seq_to_block_ids[seq_id][kv.seq_to_num_dropped_blocks.get(seq_id, 0):]


def check_invariants(kv: BlockManager, seqs: list[Sequence]) -> None:
    holders = Counter(b for seq_id in kv.seq_to_block_ids for b in live_entries(kv, seq_id))
    for block in kv.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), block
        assert (block.ref_count == 0) == (block.block_id in kv.free_queue), block
    for block_id, n in holders.items():
        if n > 1:
            assert kv.blocks[block_id].block_hash is not None
    for seq_id in kv.seq_to_block_ids:
        live = live_entries(kv, seq_id)
        assert len(set(live)) == len(live)
        assert kv.num_held_blocks(seq_id) == len(live)
    assert kv.sliding_window is not None
    for seq in seqs:
        if seq.seq_id not in kv.seq_to_block_ids:
            continue
        # No held block lies wholly before the next token's window (prefix caching may keep the one block its
        # next hash chains from).
        first_needed = max(seq.num_computed_tokens - kv.sliding_window + 1, 0) // kv.block_size
        num_hashed = kv.seq_to_num_hashed_blocks.get(seq.seq_id, 0)
        allowed = min(first_needed, max(num_hashed - 1, 0)) if kv.enable_prefix_caching else first_needed
        assert kv.seq_to_num_dropped_blocks.get(seq.seq_id, 0) >= min(allowed, len(kv.seq_to_block_ids[seq.seq_id]))


ops = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort", "finish"]),
                         st.integers(0, 40), st.integers(0, 3)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(6, 24), block_size=st.sampled_from([1, 2, 4]),
       window=st.integers(1, 12), prefix_caching=st.booleans())
def test_scheduler_releases_and_never_leaks(ops: list[tuple[str, int, int]], num_blocks: int, block_size: int,
                                            window: int, prefix_caching: bool) -> None:
    kv = BlockManager(num_blocks, block_size, prefix_caching, sliding_window=window)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=num_blocks * block_size)
    live: list[Sequence] = []
    for i, (op, length, variant) in enumerate(ops):
        if op == "add":
            prompt = ([variant] * 6 + list(range(length)))[: max(1, min(length + 2, kv.num_blocks * block_size - 1))]
            seq = Sequence(f"s{i}", f"s{i}", 0, prompt, SamplingParams(max_tokens=1 + variant * 6), 0.0)
            sched.add(seq)
            live.append(seq)
        elif op == "step":
            out = sched.schedule()
            sched.update(out, {c.seq.seq_id: (length + variant) % 50 for c in out.chunks if c.samples})
        elif live:
            sched.finish(live[length % len(live)], FinishReason.ABORT if op == "abort" else FinishReason.STOP)
        check_invariants(kv, live)
        live = [s for s in live if not s.is_finished]
    for seq in live:
        sched.finish(seq, FinishReason.ABORT)
    assert kv.num_free_blocks == kv.num_blocks
    assert not kv.seq_to_block_ids and not kv.seq_to_num_dropped_blocks


def test_a_released_block_is_revived_by_a_prefix_hit() -> None:
    kv = BlockManager(num_blocks=8, block_size=2, sliding_window=3)
    tokens = list(range(10))
    assert kv.allocate("a", 10)
    kv.cache_full_blocks("a", tokens, 10)
    assert kv.release_outside_window("a", 10) == 4  # position 10 sees 8..10: only block 4 (tokens 8, 9) stays
    assert kv.block_ids("a")[:4] == [0, 0, 0, 0] and kv.num_held_blocks("a") == 1
    hit = kv.find_prefix(tokens)
    assert len(hit.block_ids) == 4  # the released blocks still carry their hashes (the last token is never hit)
    assert kv.allocate("b", 10, hit)
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_without_a_window_nothing_is_released() -> None:
    kv = BlockManager(num_blocks=8, block_size=2)
    kv.allocate("a", 10)
    assert kv.release_outside_window("a", 10) == 0 and kv.num_held_blocks("a") == 5
