"""The KV pool's bookkeeping: fixed-size blocks, block tables, ref counts and the prefix cache. Chapter 06.

The pool holds `num_blocks` blocks of `block_size` token positions each. A sequence owns a block table,
the list of physical blocks that hold its positions in order: position p lives in block
`block_table[p // block_size]` at offset `p % block_size`. Blocks are handed out when a sequence needs
room and come back when it finishes, so memory follows what is used, not `max_seq_len`.

Prefix caching works the way vLLM's design document describes it:

- a full block is named by a hash of its tokens *and* the hash of the block before it, so equal hashes
  mean equal prefixes (`hash_block_tokens`);
- a block may be shared by several sequences; its `ref_count` says by how many;
- a block whose ref count drops to zero goes to the tail of the free queue but keeps its hash, so a
  later request with the same prefix can take it back ("touch") instead of recomputing it;
- new blocks are taken from the head of the free queue (least recently freed first); taking a block
  that still has a hash evicts it from the cache. A finished sequence returns its blocks in reverse
  order, so its last blocks, which hash the longest and most specific prefixes, are evicted first.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

from .sequence import Sequence

__all__ = ["Block", "BlockManager", "hash_block_tokens", "PoolSnapshot", "BlockView"]

NO_PARENT = 0xFFFF_FFFF_FFFF_FFFF      # stands for "no block before this one" in the hash chain


def hash_block_tokens(parent_hash: int | None, token_ids) -> int:
    """A 64-bit name for a full block: sha256 of the parent block's hash and this block's tokens. Chapter 06.

    Chained through the parent, the hash of block i depends on every token in blocks 0..i, so two
    sequences share block i's K/V only if their first (i + 1) · block_size tokens are equal. sha256
    rather than Python's hash(): the same on every run and machine, and collisions are negligible.
    """
    payload = struct.pack(f"<Q{len(token_ids)}q", NO_PARENT if parent_hash is None else parent_hash, *token_ids)
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


@dataclass(eq=False)
class Block:
    """One physical block of the pool: its id, how many sequences use it, its prefix hash if full. Chapter 06."""
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


@dataclass(frozen=True)
class BlockView:
    """One block as the chapter 06 widget draws it."""
    block_id: int
    owners: tuple[int, ...]          # request ids whose block tables hold it
    ref_count: int
    block_hash: int | None
    num_tokens: int                  # positions of it that hold K/V (for its first owner)


@dataclass(frozen=True)
class PoolSnapshot:
    """The whole pool at one moment: every block, the free queue in eviction order. Chapter 06."""
    blocks: tuple[BlockView, ...]
    free_queue: tuple[int, ...]
    block_size: int
    step: int = 0
    label: str = ""
    block_tables: dict = field(default_factory=dict)   # request id -> block ids

    @property
    def num_used(self) -> int:
        return sum(1 for b in self.blocks if b.ref_count > 0)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self.blocks if b.ref_count == 0 and b.block_hash is not None)


class BlockManager:
    """Hands out blocks, tracks ref counts and the free queue, and finds cached prefixes. Chapter 06."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1 \
                or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a positive power of two (1, 2, 4, ... 16 ...), got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}       # block hash -> the block that holds it
        self.hit_tokens = 0                      # prompt positions found in the cache
        self.queried_tokens = 0                  # prompt positions looked up
        self.evictions = 0

    # --- counts ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no user: never used, or freed (some still holding a cached prefix)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (evicted only when taken)."""
        return sum(1 for b in self.free_queue.values() if b.block_hash is not None)

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt positions served from the cache / positions looked up (0 before any lookup)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens positions: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    # --- hashing ---------------------------------------------------------------------------------

    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Grows seq.block_hashes to cover every full block among its first num_tokens tokens."""
        size = self.block_size
        while (len(seq.block_hashes) + 1) * size <= num_tokens:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block_tokens(parent, seq.token_ids[i * size:(i + 1) * size]))

    # --- allocation ------------------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        """The cached blocks that hold seq's longest cached prefix (full blocks only). Chapter 06.

        At most num_tokens - 1 positions may come from the cache: the last token must go through the
        model so that its logits give the next token. So a prompt shorter than one block, or one
        block plus one token, never hits.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        limit = seq.num_tokens - 1
        self._extend_hashes(seq, limit)
        hits = []
        for i, block_hash in enumerate(seq.block_hashes):
            if (i + 1) * self.block_size > limit:
                break
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _new_blocks_needed(self, seq: Sequence, num_new_tokens: int, computed_blocks) -> int:
        held = len(seq.block_table) + len(computed_blocks)
        start = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        return max(0, self.blocks_needed(start + num_new_tokens) - held)

    def _free_after_touch(self, computed_blocks) -> int:
        # a cached block that nobody uses sits in the free queue; touching it takes it out
        return self.num_free_blocks - sum(1 for b in computed_blocks if b.ref_count == 0)

    def allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[Block] = ()) -> bool:
        """Gives seq the computed blocks (ref count + 1) and enough new blocks for num_new_tokens. Chapter 06.

        Returns False, changing nothing, if the pool has too few free blocks. New blocks come from the
        head of the free queue; a block taken there that still has a hash is evicted from the cache.
        Full blocks are hashed and cached as soon as they are scheduled, so that another request in
        the same step can already share them (the K/V are written before any attention reads them).
        """
        needed = self._new_blocks_needed(seq, num_new_tokens, computed_blocks)
        if needed > self._free_after_touch(computed_blocks):
            return False
        for block in computed_blocks:                      # touch: shared, and out of the eviction queue
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        seq.num_computed_tokens += len(computed_blocks) * self.block_size
        for _ in range(needed):
            _, block = self.free_queue.popitem(last=False)  # least recently freed
            self._evict(block)
            block.ref_count = 1
            seq.block_table.append(block.block_id)
        self._cache_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            self.evictions += 1

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Hashes the blocks of seq that num_tokens fill and registers them in the cache."""
        if not self.enable_prefix_caching:
            return
        self._extend_hashes(seq, min(num_tokens, seq.num_tokens))
        for i in range(min(len(seq.block_hashes), num_tokens // self.block_size, len(seq.block_table))):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash = seq.block_hashes[i]
                # a duplicate (same prefix computed twice, e.g. in one step) keeps the first block as the
                # cache entry; the copy stays valid for its owner and is reclaimed when freed
                self.cached.setdefault(block.block_hash, block)

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Counts one prefix-cache lookup for the hit rate."""
        self.queried_tokens += num_prompt_tokens
        self.hit_tokens += num_hit_tokens

    def discard(self, seq: Sequence) -> None:
        """seq's step failed: the blocks only it holds may hold half-written K/V, so their prefixes leave the
        cache and are never reused; the blocks themselves come back with free(seq)."""
        for block_id in seq.block_table:
            if self.blocks[block_id].ref_count == 1:
                self._evict(self.blocks[block_id])

    def free(self, seq: Sequence) -> None:
        """Returns seq's blocks: each loses one reference; blocks nobody uses join the free queue's tail,
        last block first, keeping their hashes until they are taken again. Chapter 06."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:   # pragma: no cover - a bookkeeping bug, never a user error
                raise RuntimeError(f"block {block_id} freed more often than it was allocated")
            if block.ref_count == 0:
                if not self.enable_prefix_caching:
                    block.block_hash = None
                self.free_queue[block_id] = block
        seq.block_table = []
        seq.num_computed_tokens = 0

    # --- copy-on-write ---------------------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Gives child the same blocks as parent (shared: ref count + 1 each), e.g. for parallel sampling. Chapter 06."""
        if child.block_table:
            raise ValueError(f"request {child.request_id} already holds blocks {child.block_table}; fork into a "
                             "fresh sequence")
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def copy_on_write(self, seq: Sequence) -> tuple[int, int] | None:
        """Before seq writes its next position: if that block is shared, give seq a private copy. Chapter 06.

        Returns (source, destination) block ids for the caller to copy the K/V, or None when the
        block is seq's alone (or the write starts a new block). Raises MemoryError if no block is free.
        """
        index = seq.num_computed_tokens // self.block_size
        if index >= len(seq.block_table):
            return None
        block = self.blocks[seq.block_table[index]]
        if block.ref_count == 1:
            return None
        if not self.free_queue:
            raise MemoryError("copy-on-write needs a free block but the pool is full; free a sequence first")
        _, fresh = self.free_queue.popitem(last=False)
        self._evict(fresh)
        fresh.ref_count = 1
        block.ref_count -= 1
        seq.block_table[index] = fresh.block_id
        return block.block_id, fresh.block_id

    # --- inspection ------------------------------------------------------------------------------

    def check_consistency(self, sequences) -> None:
        """Raises AssertionError unless ref counts, the free queue and the cache agree with the block
        tables of `sequences` (every sequence that holds blocks). Chapter 06."""
        counts = [0] * self.num_blocks
        for seq in sequences:
            for block_id in seq.block_table:
                counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], \
                f"block {block.block_id}: ref_count {block.ref_count} but {counts[block.block_id]} block tables hold it"
            in_queue = block.block_id in self.free_queue
            assert in_queue == (block.ref_count == 0), \
                f"block {block.block_id}: ref_count {block.ref_count} but {'in' if in_queue else 'not in'} the free queue"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"cache entry {block_hash:x} points at block {block.block_id} " \
                                                   f"whose hash is {block.block_hash}"
        assert len(self.free_queue) + sum(1 for c in counts if c) == self.num_blocks

    def snapshot(self, sequences, step: int = 0, label: str = "") -> PoolSnapshot:
        """The pool as the chapter 06 widget draws it: owners, ref counts, hashes, free queue order."""
        owners: dict[int, list[int]] = {}
        filled: dict[int, int] = {}
        tables = {}
        for seq in sequences:
            tables[seq.request_id] = tuple(seq.block_table)
            for i, block_id in enumerate(seq.block_table):
                owners.setdefault(block_id, []).append(seq.request_id)
                filled.setdefault(block_id, max(0, min(self.block_size, seq.num_computed_tokens - i * self.block_size)))
        views = tuple(BlockView(b.block_id, tuple(owners.get(b.block_id, ())), b.ref_count, b.block_hash,
                                filled.get(b.block_id, self.block_size if b.block_hash is not None else 0))
                      for b in self.blocks)
        return PoolSnapshot(views, tuple(self.free_queue), self.block_size, step, label, tables)
