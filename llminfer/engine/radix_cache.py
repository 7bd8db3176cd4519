"""RadixAttention's prefix tree: cached K/V found by walking token ids, evicted leaf first. Chapter 13.

SGLang keeps the K/V of every prefix it has computed in a radix tree keyed by token ids. A new prompt walks
the tree from the root; the longest path that spells its first tokens is its cached prefix, and the K/V of
those positions are reused instead of recomputed. Chapter 06's cache names each full block by a chained hash
and finds the same prefixes with a dictionary; the tree holds them as one structure, which makes three things
explicit:

- **sharing is visible**: requests with a common prefix walk the same edges, and a node's `lock_ref` counts
  the running requests whose path passes through it (`lock` / `unlock`, up to the root);
- **eviction is by leaf, least recently used first**: only a leaf nobody locks can go, its last blocks first,
  and a leaf that empties is removed, so its parent may become the next leaf. A prefix is never evicted
  while a longer prefix built on it stays;
- **the cache owns what it holds**: blocks in the tree are neither free nor any request's; they go back to
  the pool only when evicted (chapter 06 instead leaves cached blocks in the free queue and forgets their
  hash when the block is taken).

**Edges are whole blocks.** The tree sits on chapter 06's paged pool: a request's K/V live in blocks of
`block_size` positions, and a block table can only point at whole blocks. So every edge here holds a whole
number of blocks (`len(tokens) == len(blocks) * block_size`), nodes split only at block boundaries, and a
match is the longest prefix made of whole blocks. SGLang does the same when its page size is above 1 (it
rounds a match down to whole pages). Token-granular edges (SGLang with page size 1) would let a match end
inside a block, but a request could not extend that block in place: it would have to copy its first
positions into a block of its own before writing the rest.

    tree = RadixCache(block_size=4)
    node, cached = tree.insert([1, 2, 3, 4, 5, 6, 7, 8], blocks=[10, 11])   # cached == 0: both new
    tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 9, 9])    # PrefixMatch(num_tokens=4, blocks=[10], node=...)
    tree.lock(node); ...; tree.unlock(node)            # while a request uses the path
    tree.evict(1)                                      # [11]: the leaf's last block goes back to the pool

`RadixBlockManager` puts the tree in front of the engine's pool: the scheduler and the engine call it exactly
as they call chapter 06's `BlockManager` (`LLMEngine(..., prefix_cache="radix")`).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

from .block_manager import Block, BlockManager
from .sequence import Sequence

__all__ = ["RadixNode", "RadixCache", "PrefixMatch", "RadixBlockManager"]


@dataclass(eq=False)
class RadixNode:
    """One node: the edge from its parent (tokens and the blocks holding their K/V), its children, its locks."""
    tokens: tuple[int, ...]              # a whole number of blocks' tokens
    blocks: list[int]                    # physical block ids, one per block_size tokens
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)   # first block's tokens -> child
    lock_ref: int = 0                    # running requests whose path passes through this node
    last_access: int = 0                 # the tree's clock at the last match or insert that walked here

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (f"RadixNode({len(self.tokens)} tokens, blocks={self.blocks}, lock_ref={self.lock_ref}, "
                f"children={len(self.children)})")


class PrefixMatch(NamedTuple):
    """What match_prefix found: how many leading tokens are cached, their blocks, the node where the path ends."""
    num_tokens: int
    blocks: list[int]
    node: RadixNode


class RadixCache:
    """A radix tree over token ids whose edges hold whole blocks of K/V. Chapter 13."""

    def __init__(self, block_size: int):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.root = RadixNode((), [])
        self.clock = 0                   # a logical clock: deterministic LRU order, no timer involved
        self.num_blocks = 0              # blocks the tree holds

    def _block(self, tokens: tuple[int, ...], i: int) -> tuple[int, ...]:
        return tokens[i * self.block_size:(i + 1) * self.block_size]

    def _shared_blocks(self, node: RadixNode, tokens: tuple[int, ...], start: int) -> int:
        """How many of node's blocks equal tokens' blocks start, start + 1, ... (0 up to all of node's)."""
        n = 0
        while n < len(node.blocks) and (start + n + 1) * self.block_size <= len(tokens) \
                and self._block(node.tokens, n) == self._block(tokens, start + n):
            n += 1
        return n

    # --- lookup and insertion --------------------------------------------------------------------

    def match_prefix(self, tokens) -> PrefixMatch:
        """The longest cached prefix of tokens in whole blocks: its length, its blocks, and the node holding
        its last block (the root if nothing matched). Every node on the path counts as used now (LRU)."""
        tokens = tuple(tokens)
        self.clock += 1
        node, blocks = self.root, []
        while True:
            child = node.children.get(self._block(tokens, len(blocks)))
            if child is None:
                break
            child.last_access = self.clock
            shared = self._shared_blocks(child, tokens, len(blocks))
            blocks.extend(child.blocks[:shared])
            node = child
            if shared < len(child.blocks):           # the path goes on but the tokens part ways (or end) here
                break
        return PrefixMatch(len(blocks) * self.block_size, blocks, node)

    def insert(self, tokens, blocks) -> tuple[RadixNode, int]:
        """Adds the path tokens whose K/V are in blocks; returns (the node where it ends, cached) where the tree
        already held the first `cached` blocks' worth of tokens. The tree takes blocks[cached:]; the caller's
        blocks[:cached] stay the caller's (the same ids where they came from a match, or duplicates).

        Where the new tokens part ways with an edge inside it, the edge is split at that block boundary; where
        they go on past a leaf, the leaf's edge grows (a request decoding adds its blocks to its own leaf).
        """
        tokens = tuple(tokens)
        blocks = list(blocks)
        if len(tokens) != len(blocks) * self.block_size:
            raise ValueError(f"insert takes whole blocks: {len(tokens)} tokens for {len(blocks)} blocks of "
                             f"{self.block_size}; pass {len(blocks) * self.block_size} tokens")
        self.clock += 1
        node, done = self.root, 0
        while done < len(blocks):
            child = node.children.get(self._block(tokens, done))
            if child is None:
                self.num_blocks += len(blocks) - done
                if node.is_leaf and node is not self.root:   # the path ends in a leaf: its edge grows
                    node.tokens += tokens[done * self.block_size:]
                    node.blocks += blocks[done:]
                    return node, done
                leaf = RadixNode(tokens[done * self.block_size:], blocks[done:], node, last_access=self.clock)
                node.children[self._block(tokens, done)] = leaf   # nothing here yet: the rest is a new leaf
                return leaf, done
            shared = self._shared_blocks(child, tokens, done)
            if shared < len(child.blocks):
                child = self._split(child, shared)   # the lower part is not on this path: it keeps its time
            child.last_access = self.clock
            node, done = child, done + shared
        return node, done

    def _split(self, node: RadixNode, n_blocks: int) -> RadixNode:
        """Cuts node's edge after n_blocks blocks; returns the new upper node (node keeps the lower part)."""
        cut = n_blocks * self.block_size
        upper = RadixNode(node.tokens[:cut], node.blocks[:n_blocks], node.parent,
                          lock_ref=node.lock_ref, last_access=node.last_access)   # every lock below passes here
        node.parent.children[self._block(node.tokens, 0)] = upper
        node.tokens, node.blocks, node.parent = node.tokens[cut:], node.blocks[n_blocks:], upper
        upper.children[self._block(node.tokens, 0)] = node
        return upper

    # --- reference counts ------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """A request uses the path root → node: none of its nodes may be evicted until unlock(node)."""
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """The request that locked node is done with the path."""
        while node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of {node} that nobody locks")   # a bookkeeping bug, not a user error
            node.lock_ref -= 1
            node = node.parent

    # --- eviction --------------------------------------------------------------------------------

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks in nodes nobody locks: a lock covers the whole path to the root, so all of them can go."""
        return sum(len(node.blocks) for node in self.nodes() if node.lock_ref == 0)

    def evict(self, num_blocks: int) -> list[int]:
        """Frees up to num_blocks blocks from unlocked leaves, least recently used first; returns their ids.

        A leaf gives up its last (most specific) blocks first; a leaf left empty is removed, and its parent,
        if now a leaf and unlocked, joins the candidates in its own LRU place.
        """
        order = itertools.count()                # ties (none in practice) in a fixed order
        heap = [(n.last_access, next(order), n) for n in self.nodes() if n.is_leaf and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            take = min(len(leaf.blocks), num_blocks - len(freed))
            freed.extend(reversed(leaf.blocks[len(leaf.blocks) - take:]))
            del leaf.blocks[len(leaf.blocks) - take:]
            leaf.tokens = leaf.tokens[:len(leaf.blocks) * self.block_size]
            if not leaf.blocks:
                parent = self._detach(leaf)
                if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, next(order), parent))
        self.num_blocks -= len(freed)
        return freed

    def _detach(self, node: RadixNode) -> RadixNode:
        parent = node.parent
        del parent.children[next(k for k, c in parent.children.items() if c is node)]
        node.parent = None
        return parent

    def drop(self, node: RadixNode) -> list[int]:
        """Removes node and everything below it (nobody may lock them); returns their blocks."""
        if node is self.root or node.lock_ref:
            raise ValueError(f"drop takes an unlocked node other than the root, got {node}")
        freed, stack = [], [node]
        while stack:
            n = stack.pop()
            freed.extend(n.blocks)
            stack.extend(n.children.values())
        self._detach(node)
        self.num_blocks -= len(freed)
        return freed

    def __repr__(self) -> str:
        return (f"RadixCache(block_size={self.block_size}, {sum(1 for _ in self.nodes())} nodes, "
                f"{self.num_blocks} blocks, {self.num_evictable_blocks} evictable)")


class RadixBlockManager(BlockManager):
    """Chapter 06's block pool with the radix tree as its prefix cache. Chapter 13.

    A block's ref_count counts the block tables that hold it plus one while the tree holds it; the free queue
    holds exactly the blocks with ref_count 0. Cached blocks nobody uses are not in the free queue: when the
    queue is short, `allocate` evicts LRU leaves and their blocks join it (`num_free_blocks` counts both).

    Like the hash cache, a request's full blocks enter the tree as soon as they are scheduled (their K/V are
    written in the step before any attention reads them), so requests admitted in the same step already share
    them. Each request locks the deepest node its blocks reach, and moves the lock down as it inserts more.
    """

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching=True)
        self.tree = RadixCache(block_size)
        self.locked: dict[int, tuple[RadixNode, int]] = {}   # request id -> (its locked node, its blocks in the tree)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request uses: free, or cached in an unlocked part of the tree (evicted when taken)."""
        return len(self.free_queue) + self.tree.num_evictable_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self.tree.num_evictable_blocks

    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        """The cached blocks of seq's longest cached prefix, found in the tree (whole blocks, at most
        num_tokens - 1 positions: the last token must run to give the next token's logits)."""
        if seq.block_table:
            return []
        match = self.tree.match_prefix(seq.token_ids[:seq.num_tokens - 1])
        return [self.blocks[b] for b in match.blocks]

    def allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[Block] = ()) -> bool:
        """Gives seq the computed blocks (locking their path) and enough new blocks for num_new_tokens, evicting
        LRU leaves when the free queue is short; returns False, changing nothing, if even eviction cannot."""
        node = None
        if computed_blocks:
            match = self.tree.match_prefix(seq.token_ids[:len(computed_blocks) * self.block_size])
            if match.blocks != [b.block_id for b in computed_blocks]:     # pragma: no cover - a bookkeeping bug
                raise RuntimeError("the tree changed between the lookup and the allocation")
            node = match.node
            self.tree.lock(node)                     # before evicting: the hit itself must stay
        needed = self._new_blocks_needed(seq, num_new_tokens, computed_blocks)
        short = needed - len(self.free_queue)
        if short > 0 and short > self.tree.num_evictable_blocks:
            if node is not None:
                self.tree.unlock(node)
            return False
        if short > 0:
            self._evict_blocks(short)
        for block in computed_blocks:
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        seq.num_computed_tokens += len(computed_blocks) * self.block_size
        if node is not None:
            self.locked[seq.request_id] = (node, len(computed_blocks))
        for _ in range(needed):
            _, block = self.free_queue.popitem(last=False)
            block.ref_count = 1
            seq.block_table.append(block.block_id)
        self._insert_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)
        return True

    def _evict_blocks(self, num_blocks: int) -> None:
        """Evicts num_blocks blocks from the tree into the free queue."""
        for block_id in self.tree.evict(num_blocks):
            self._release(block_id)
            self.evictions += 1

    def _release(self, block_id: int) -> None:
        """Drops one reference to a block; at zero it joins the free queue's tail."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:       # pragma: no cover - a bookkeeping bug, never a user error
            raise RuntimeError(f"block {block_id} released more often than it was taken")
        if block.ref_count == 0:
            self.free_queue[block_id] = block

    def _insert_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Puts seq's full blocks among its first num_tokens positions into the tree; moves its lock to the end."""
        full = min(num_tokens, seq.num_tokens) // self.block_size
        node, inserted = self.locked.get(seq.request_id, (None, 0))
        if full <= inserted:
            return
        end, cached = self.tree.insert(seq.token_ids[:full * self.block_size], seq.block_table[:full])
        for block_id in seq.block_table[cached:full]:    # the tree's own reference
            self.blocks[block_id].ref_count += 1
        self.tree.lock(end)
        if node is not None:
            self.tree.unlock(node)
        self.locked[seq.request_id] = (end, full)

    def free(self, seq: Sequence) -> None:
        """Unlocks seq's path and drops its references; its blocks in the tree stay cached there. Chapter 13."""
        node, _ = self.locked.pop(seq.request_id, (None, 0))
        if node is not None:
            self.tree.unlock(node)
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def discard(self, seq: Sequence) -> None:
        """seq's step failed: its K/V may be half-written. Removes from the tree the part of its path that no
        other request uses (with what hangs below it); the blocks come back when seq is freed."""
        node, _ = self.locked.pop(seq.request_id, (None, 0))
        if node is None:
            return
        self.tree.unlock(node)
        top = None
        while node is not self.tree.root and node.lock_ref == 0:
            top, node = node, node.parent
        if top is not None:
            for block_id in self.tree.drop(top):
                self._release(block_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """As chapter 06's fork; the child also locks the parent's path in the tree."""
        super().fork(parent, child)
        if parent.request_id in self.locked:
            node, n = self.locked[parent.request_id]
            self.tree.lock(node)
            self.locked[child.request_id] = (node, n)

    def copy_on_write(self, seq: Sequence) -> tuple[int, int] | None:
        """As chapter 06's, evicting a leaf's block first when the free queue is empty."""
        if not self.free_queue and self.tree.num_evictable_blocks:
            self._evict_blocks(1)
        return super().copy_on_write(seq)

    def check_consistency(self, sequences) -> None:
        """Raises AssertionError unless ref counts = block tables + the tree, the free queue holds exactly the
        blocks with none, and every node's lock_ref counts the requests locked at or below it."""
        sequences = list(sequences)
        counts = [0] * self.num_blocks
        for seq in sequences:
            for block_id in seq.block_table:
                counts[block_id] += 1
        in_tree = [b for node in self.tree.nodes() for b in node.blocks]
        assert len(in_tree) == len(set(in_tree)) == self.tree.num_blocks, "a block sits in the tree twice"
        for block_id in in_tree:
            counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], \
                f"block {block.block_id}: ref_count {block.ref_count} but {counts[block.block_id]} holders"
            assert (block.block_id in self.free_queue) == (block.ref_count == 0), f"block {block.block_id}"
        locks: dict[int, int] = {}
        for node, _ in self.locked.values():
            while node is not None:
                locks[id(node)] = locks.get(id(node), 0) + 1
                node = node.parent
        for node in self.tree.nodes():
            assert node.lock_ref == locks.get(id(node), 0), f"{node}: {locks.get(id(node), 0)} requests lock it"
            assert len(node.tokens) == len(node.blocks) * self.block_size and node.blocks, f"{node}"
