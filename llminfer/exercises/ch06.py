"""Chapter 06's exercises: blocks for a set of sequences, block tables from the pool, the paged gather, prefix hits."""
from __future__ import annotations

import torch

from . import as_whole, as_wholes, exercise, not_a, run_code

LENGTHS, BLOCK = (5, 16, 17, 33), 16                       # 06.1
POOL_BLOCKS, POOL_BLOCK = 10, 4                             # 06.2: A of 6 tokens, B of 9, A freed, C of 7
SYSTEM_LEN, USER_LEN, PREFIX_BLOCK = 35, 5, 16              # 06.4


@exercise("06.1", "blocks and wasted slots for sequences of 5, 16, 17 and 33 positions in blocks of 16")
def blocks_and_waste(answer):
    from ..engine import BlockManager
    numbers = as_wholes(answer, 2)
    if numbers is None:
        return not_a("two whole numbers (blocks, wasted_slots)", answer)
    blocks, wasted = numbers
    manager = BlockManager(64, BLOCK)
    want = sum(manager.blocks_needed(n) for n in LENGTHS)
    want_wasted = want * BLOCK - sum(LENGTHS)
    if blocks == -(-sum(LENGTHS) // BLOCK):
        return False, ("a block belongs to one sequence: round up per sequence, ceil(length / 16) each, then add "
                       "(section 1's 'paged' line)")
    if blocks != want:
        return False, f"{blocks} blocks: each sequence needs ceil(length / {BLOCK}) blocks"
    if wasted != want_wasted:
        return False, (f"{wasted} wasted slots: the {want} blocks hold {want * BLOCK} positions, the sequences "
                       f"use {sum(LENGTHS)}")
    return True, (f"{' + '.join(str(manager.blocks_needed(n)) for n in LENGTHS)} = {want} blocks; {want_wasted} "
                  f"empty slots, under one block per sequence")


def _pool_tables() -> tuple[list[int], list[int]]:
    from ..engine import BlockManager, SamplingParams, Sequence
    manager = BlockManager(POOL_BLOCKS, POOL_BLOCK, enable_prefix_caching=False)
    a, b, c = (Sequence(i, list(range(n)), SamplingParams(), 0.0) for i, n in enumerate((6, 9, 7)))
    manager.allocate(a, 6)
    manager.allocate(b, 9)
    manager.free(a)
    manager.allocate(c, 7)
    return list(b.block_table), list(c.block_table)


@exercise("06.2", "the block tables BlockManager gives B and C after A is freed")
def block_tables(answer):
    if not (isinstance(answer, (list, tuple)) and len(answer) == 2
            and all(isinstance(t, (list, tuple)) and all(isinstance(i, int) for i in t) for t in answer)):
        return not_a("two block tables, lists of block ids: (table_b, table_c)", answer)
    table_b, table_c = (list(t) for t in answer)
    want_b, want_c = _pool_tables()
    if table_b != want_b:
        if table_b[:1] == [0]:
            return False, ("B comes after A, which took blocks 0 and 1: blocks come from the head of one shared "
                           "free queue")
        return False, f"B's table {table_b}: A's 6 tokens take 2 blocks of 4, B's 9 take the next 3"
    if table_c != want_c:
        if table_c == [1, 0] or table_c == [0, 1]:
            return False, ("freed blocks go to the *back* of the free queue, so blocks never used are taken first "
                           "(and a freed block keeps its cached contents longest): the free_queue of section 2")
        return False, f"C's table {table_c}: C takes ceil(7 / 4) blocks from the head of the free queue"
    return True, f"B {want_b}, C {want_c}: A's freed blocks wait at the back of the free queue"


@exercise("06.3", "the paged gather: one sequence's K read through its block table")
def paged_gather(answer):
    from ..engine import PagedKVCache
    if not callable(answer):
        return not_a("a function gather(k_pool, block_table, length) -> (n_kv_heads, length, head_dim)", answer)
    cache = PagedKVCache(n_layers=1, n_kv_heads=2, head_dim=4, num_blocks=8, block_size=4)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=torch.Generator().manual_seed(0)))
    for table, length in (([5, 2, 7], 10), ([3], 4), ([0, 6], 5)):
        want = cache.gather(0, table, length)[0][0]                         # (H_kv, length, D)
        got, error = run_code(answer, cache.k[0].clone(), list(table), length)
        if error:
            return False, error
        if not isinstance(got, torch.Tensor):
            return not_a("a tensor", got)
        if got.shape != want.shape:
            return False, (f"table {table}, length {length}: shape {tuple(got.shape)}, expected "
                           f"{tuple(want.shape)} (n_kv_heads, length, head_dim)")
        if not torch.equal(got, want):
            in_order = cache.k[0].reshape(-1, 2, 4)[:length].transpose(0, 1)
            if torch.equal(got, in_order):
                return False, ("that reads the pool's first slots in order; position p lives in block "
                               "block_table[p // block_size] at offset p % block_size (section 2)")
            return False, f"table {table}, length {length}: the keys differ from PagedKVCache.gather's"
    return True, "equal to PagedKVCache.gather for three tables, full and part-filled last blocks"


@exercise("06.4", "blocks of a second request served from the prefix cache")
def prefix_hits(answer):
    from ..engine import BlockManager, SamplingParams, Sequence
    hits = as_whole(answer)
    if hits is None:
        return not_a("a whole number of blocks", answer)
    manager = BlockManager(32, PREFIX_BLOCK)
    system = list(range(100, 100 + SYSTEM_LEN))
    first = Sequence(0, system + [1] * USER_LEN, SamplingParams(), 0.0)
    manager.allocate(first, len(first.token_ids))
    second = Sequence(1, system + [2] * USER_LEN, SamplingParams(), 0.0)
    want = len(manager.get_computed_blocks(second))
    if hits == -(-SYSTEM_LEN // PREFIX_BLOCK):
        return False, ("only *full* blocks are hashed and shared: the third block mixes system-prompt tokens with "
                       "each user's own, so its hash differs (section 3, block hashes)")
    if hits != want:
        return False, f"{hits}: a block is shared when its tokens and every token before it are the same"
    return True, f"{want} full blocks ({want * PREFIX_BLOCK} positions) of the {SYSTEM_LEN}-token system prompt"
