"""The paged KV cache's bookkeeping: which blocks each sequence holds, and the prefix cache. Pure CPU.

Layout (one sequence, block_size 4, 10 tokens computed, 1 more scheduled):

    token index:  0  1  2  3 | 4  5  6  7 | 8  9 10 __
    block table:  [   b7     |    b2      |    b9     ]
                  full, hashed  full, hashed  partial: not hashed, never shared

A full block is keyed by a chained hash of its tokens and its parent's hash, so equal hashes mean equal
prefixes (the stored token ids are compared too, against collisions). A freed block keeps its hash and
goes to the back of the free queue: it can be revived by a later prefix hit until it is reused for new
tokens, and reuse takes the least recently freed block first (LRU).

Sliding windows: when every layer attends only to its last `sliding_window` keys, a block wholly before
the window of the next token a sequence computes is never read again, so `release_outside_window` gives it
back to the pool. Its table entry stays (positions still index the table) but holds the padding block 0,
the same padding the runner puts past a table's end, and `seq_to_num_dropped_blocks` says how many leading
entries are padding; attention never reads them (it starts at the window).

    window 8, block_size 4, 14 tokens computed (the next token is position 14, which sees keys 7..14):
    token index:  0  1  2  3 | 4  5  6  7 | 8 ...
    block table:  [  pad 0   |    b2      |    b9  ...]     the first block is back in the pool

Invariants (property-tested in tests/engine/test_kv_cache.py and tests/engine/test_sliding_window_blocks.py):
- every block is either free (ref_count 0, in the free queue) or held (ref_count = number of sequences
  whose table holds it past its dropped entries);
- a block appears in two tables only after a prefix-hash hit;
- with a window, no held block of a sequence lies wholly before the window of its next token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens the hash covers, to rule out collisions


@dataclass(frozen=True)
class PrefixHit:
    block_ids: list[int]

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: the widest window of any layer when every layer has one; None: some layer (or
        every one) attends to the whole sequence, and no block is ever released early."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.seq_to_num_dropped_blocks: dict[str, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.seq_to_block_ids: dict[str, list[int]] = {}
        self.seq_to_num_hashed_blocks: dict[str, int] = {}
        self.num_prefix_queries = 0  # tokens looked up
        self.num_prefix_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, seq_id: str) -> list[int]:
        return self.seq_to_block_ids.get(seq_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------------

    def find_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        """The longest run of cached full blocks at the start of `token_ids`. Never covers the last
        token: the model must compute at least one token to produce logits."""
        if not self.enable_prefix_caching:
            return PrefixHit([])
        max_blocks = (len(token_ids) - 1) // self.block_size
        hit: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = hash_block(parent, chunk)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hit.append(block_id)
            parent = h
        self.num_prefix_queries += len(token_ids)
        self.num_prefix_hits += len(hit) * self.block_size
        return PrefixHit(hit)

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Hash the blocks that became full (and computed) since the last call."""
        if not self.enable_prefix_caching:
            return
        table = self.seq_to_block_ids[seq_id]
        num_hashed = self.seq_to_num_hashed_blocks.get(seq_id, 0)
        num_full = min(num_computed_tokens // self.block_size, len(table))
        # A released block was hashed before it was released, and the last hashed one is never released.
        assert not num_hashed or num_hashed > self.seq_to_num_dropped_blocks.get(seq_id, 0)
        parent = self.blocks[table[num_hashed - 1]].block_hash if num_hashed else None
        for i in range(num_hashed, num_full):
            block = self.blocks[table[i]]
            chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = hash_block(parent, chunk)
            if block.block_hash is None:
                block.block_hash, block.token_ids = h, chunk
                # First writer wins; an identical block computed twice is simply not shared.
                self.hash_to_block_id.setdefault(h, block.block_id)
            parent = h
        self.seq_to_num_hashed_blocks[seq_id] = max(num_hashed, num_full)

    # -- allocation ---------------------------------------------------------------------------------

    def can_allocate(self, seq_id: str, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        held = len(self.seq_to_block_ids.get(seq_id, ()))
        reused = len(prefix.block_ids) if prefix else 0
        revived = sum(1 for b in (prefix.block_ids if prefix else ()) if self.blocks[b].ref_count == 0)
        need = max(self.blocks_needed(num_tokens) - held - reused, 0)
        return need + revived <= self.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Make the sequence's table cover `num_tokens` tokens, first taking the prefix hit's blocks.
        All or nothing: returns False and changes nothing when the pool is short."""
        if not self.can_allocate(seq_id, num_tokens, prefix):
            return False
        table = self.seq_to_block_ids.setdefault(seq_id, [])
        if prefix and prefix.block_ids:
            assert not table, "a prefix hit is applied only to a sequence that holds no blocks"
            for block_id in prefix.block_ids:
                self._take(block_id)
                table.append(block_id)
            self.seq_to_num_hashed_blocks[seq_id] = len(prefix.block_ids)
        while len(table) < self.blocks_needed(num_tokens):
            block_id = next(iter(self.free_queue))
            self._take(block_id)
            self._evict_hash(block_id)
            table.append(block_id)
        return True

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks. Tail blocks go to the free queue first so they are reused
        first: a shared prefix outlives the sequence-specific tail."""
        table = self.seq_to_block_ids.pop(seq_id, [])
        self.seq_to_num_hashed_blocks.pop(seq_id, None)
        num_dropped = self.seq_to_num_dropped_blocks.pop(seq_id, 0)
        for block_id in reversed(table[num_dropped:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Release the blocks past those covering the first `num_tokens` tokens: the slots of rejected
        draft tokens. Those blocks were never hashed (only computed, accepted tokens are), so they go to
        the front of the free queue and are reused first, ahead of blocks that may still be revived."""
        table = self.seq_to_block_ids.get(seq_id)
        if table is None:
            return
        keep = self.blocks_needed(num_tokens)
        assert keep >= self.seq_to_num_hashed_blocks.get(seq_id, 0), "trim would drop a hashed block"
        assert keep >= self.seq_to_num_dropped_blocks.get(seq_id, 0), "trim would drop a released block"
        while len(table) > keep:
            block_id = table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                self.free_queue.move_to_end(block_id, last=False)

    def release_outside_window(self, seq_id: str, num_computed_tokens: int) -> int:
        """Give back the sequence's blocks that lie wholly before the window of its next token (position
        `num_computed_tokens`, which sees keys from num_computed_tokens - window + 1 on); returns how many.
        With prefix caching, the last hashed block is kept: the next block's hash chains from it."""
        if self.sliding_window is None or seq_id not in self.seq_to_block_ids:
            return 0
        table = self.seq_to_block_ids[seq_id]
        first_needed = max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        if self.enable_prefix_caching:
            first_needed = min(first_needed, max(self.seq_to_num_hashed_blocks.get(seq_id, 0) - 1, 0))
        first_needed = min(first_needed, len(table))
        num_dropped = self.seq_to_num_dropped_blocks.get(seq_id, 0)
        for i in range(num_dropped, first_needed):
            block = self.blocks[table[i]]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None  # hashed: may still be revived by a prefix hit
            table[i] = 0  # padding, as past a table's end: outside every window, never read
        if first_needed > num_dropped:
            self.seq_to_num_dropped_blocks[seq_id] = first_needed
        return max(first_needed - num_dropped, 0)

    def num_held_blocks(self, seq_id: str) -> int:
        """Blocks the sequence holds (its table's entries past those released outside the window)."""
        return len(self.seq_to_block_ids.get(seq_id, ())) - self.seq_to_num_dropped_blocks.get(seq_id, 0)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _evict_hash(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.hash_to_block_id.get(block.block_hash) == block_id:
                del self.hash_to_block_id[block.block_hash]
            block.block_hash, block.token_ids = None, None

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.free_queue):
            self._evict_hash(block_id)
