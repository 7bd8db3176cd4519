"""Chapter 06's exercises: blocks for a set of sequences, block tables from the pool, paged decode attention for a
batch, prefix hits."""
from __future__ import annotations

import torch

from . import as_whole, as_wholes, exercise, not_a, run_code

LENGTHS, BLOCK = (5, 16, 17, 33), 16                       # 06.1
POOL_BLOCKS, POOL_BLOCK = 10, 4                             # 06.2: A of 6 tokens, B of 9, A freed, C of 7
DECODE_TABLES, DECODE_LENGTHS, DECODE_BLOCK = ((7, 2, 9), (4,), (0, 5)), (10, 3, 6), 4   # 06.3
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


def _decode_by_hand(q, k_pool, v_pool, tables, lengths, interleave=True, scale=True):
    """One decode query per sequence attended over its first lengths[i] positions, read through its block table:
    q (S, H, D) -> (S, H, D). 06.3 recognises three slips: lengths of whole blocks, interleave=False (GQA heads
    cycled) and scale=False (no 1/√d)."""
    size, n_kv_heads, head_dim = k_pool.shape[1:]
    group = q.shape[1] // n_kv_heads
    out = []
    for query, table, length in zip(q, tables, lengths):
        pos = torch.arange(length)
        slots = torch.tensor(table)[pos // size] * size + pos % size
        k, v = (pool.reshape(-1, n_kv_heads, head_dim)[slots].transpose(0, 1) for pool in (k_pool, v_pool))
        k, v = ((t.repeat_interleave(group, 0) if interleave else t.repeat(group, 1, 1)) for t in (k, v))
        scores = (query[:, None] @ k.transpose(1, 2))[:, 0] / (head_dim ** 0.5 if scale else 1.0)   # (H, L)
        out.append((torch.softmax(scores, -1)[:, None] @ v)[:, 0])                                  # (H, D)
    return torch.stack(out)


@exercise("06.3", "decode attention for several sequences, each through its own block table")
def paged_decode(answer):
    from ..attention import get_backend
    from ..engine import AttentionMetadata, SamplingParams, Sequence
    from ..engine.paged_attention import gather_attention
    if not callable(answer):
        return not_a("a function paged_decode(q, k_pool, v_pool, block_tables, lengths) -> (S, H, D)", answer)
    generator = torch.Generator().manual_seed(0)
    k_pool, v_pool = (torch.randn(10, DECODE_BLOCK, 2, 8, generator=generator) for _ in range(2))  # stale slots too
    q = torch.randn(len(DECODE_TABLES), 4, 8, generator=generator)                                # S=3, H=4, D=8
    seqs = [Sequence(i, [0] * n, SamplingParams(), 0.0) for i, n in enumerate(DECODE_LENGTHS)]
    step = AttentionMetadata(seqs, [1] * len(seqs), [n - 1 for n in DECODE_LENGTHS], [list(t) for t in DECODE_TABLES],
                             DECODE_BLOCK).prepare("cpu")
    want = gather_attention(q.transpose(0, 1)[None], k_pool, v_pool, step, get_backend("sdpa"))[0].transpose(0, 1)
    got, error = run_code(answer, q.clone(), k_pool.clone(), v_pool.clone(), [list(t) for t in DECODE_TABLES],
                          list(DECODE_LENGTHS))
    if error:
        return False, error
    if not isinstance(got, torch.Tensor):
        return not_a("a tensor of shape (sequences, heads, head_dim)", got)
    if got.shape != want.shape:
        return False, f"shape {tuple(got.shape)}, expected {tuple(want.shape)}: one (heads, head_dim) row per sequence"
    if torch.allclose(got, want, atol=1e-5):
        return True, (f"equal to llminfer's 'gather' kernel for sequences of {', '.join(map(str, DECODE_LENGTHS))} "
                      f"positions in blocks {', '.join(map(str, DECODE_TABLES))}")
    slips = {"every slot of the last block is attended, also those past the sequence's length (they hold another "
             "sequence's or stale K/V): keep positions 0 to lengths[i] − 1, as section 2's gather does":
             dict(lengths=[len(t) * DECODE_BLOCK for t in DECODE_TABLES]),
             "query head h reads K/V head h // (heads / kv_heads), as repeat_interleave gives (chapter 02's GQA); "
             "repeat cycles through the K/V heads instead": dict(interleave=False),
             "the scores are divided by √head_dim before the softmax (section 2's cell)": dict(scale=False)}
    for reason, slip in slips.items():
        lengths = slip.pop("lengths", DECODE_LENGTHS)
        if torch.allclose(got, _decode_by_hand(q, k_pool, v_pool, DECODE_TABLES, lengths, **slip), atol=1e-5):
            return False, reason
    return False, ("the outputs differ from llminfer's 'gather' kernel: per sequence, gather its K and V through its "
                   "table, repeat the K/V heads for GQA, softmax(q·Kᵀ/√d)·V (section 2)")


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
