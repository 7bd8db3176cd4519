"""Chapter 07's exercises: causal tiles counted, the online-softmax update of one tile, the tiled loop's traffic."""
from __future__ import annotations

import torch

from . import as_whole, as_wholes, exercise, not_a, run_code

TILE_T, TILE_BLOCK = 256, 32                    # 07.1
IO_N, IO_D, IO_BLOCK = 1024, 64, 64             # 07.3


@exercise("07.1", "tiles computed and skipped by a causal pass over 256 positions in blocks of 32")
def causal_tiles(answer):
    from ..flash.tiled import tile_grid
    numbers = as_wholes(answer, 2)
    if numbers is None:
        return not_a("two whole numbers (computed, skipped)", answer)
    computed, skipped = numbers
    kinds = [kind for row in tile_grid(TILE_T, TILE_T, TILE_BLOCK, TILE_BLOCK) for kind in row]
    want_skipped = kinds.count("skipped")
    want = len(kinds) - want_skipped
    if (computed, skipped) == (want_skipped, want):
        return False, "the two are swapped: the tiles on and below the diagonal are computed"
    if computed == kinds.count("full"):
        return False, ("the diagonal tiles are computed too, with the mask applied inside them (section 3's "
                       "picture: full, diagonal, skipped)")
    if computed + skipped != len(kinds):
        return False, f"the grid has ({TILE_T} / {TILE_BLOCK})² = {len(kinds)} tiles; computed + skipped is that"
    if (computed, skipped) != (want, want_skipped):
        return False, f"({computed}, {skipped}): query block i needs key blocks 0..i, so n(n + 1)/2 of n² tiles"
    n = TILE_T // TILE_BLOCK
    return True, f"n = {n} blocks: n(n + 1)/2 = {want} computed ({n} of them on the diagonal), {want_skipped} skipped"


def _reference_state(scores: torch.Tensor, v: torch.Tensor):
    m = scores.amax(-1)                                        # (rows,)
    l = torch.exp(scores - m[:, None]).sum(-1)                 # (rows,)
    return m, l, torch.exp(scores - m[:, None]) @ v            # acc: (rows, d), not yet divided by l


@exercise("07.2", "the online-softmax update for one tile")
def tile_update(answer):
    if not callable(answer):
        return not_a("a function update(m, l, acc, scores, v) -> (m, l, acc)", answer)
    generator = torch.Generator().manual_seed(0)
    rows, d, block, tiles = 4, 8, 16, 5
    scores = torch.randn(rows, block * tiles, generator=generator, dtype=torch.float64) * 4
    scores[:, block * 3:block * 4] += 20                       # a later tile raises the max: the rescale matters
    v = torch.randn(block * tiles, d, generator=generator, dtype=torch.float64)
    m = torch.full((rows,), float("-inf"), dtype=torch.float64)
    l = torch.zeros(rows, dtype=torch.float64)
    acc = torch.zeros(rows, d, dtype=torch.float64)
    for t in range(tiles):
        state, error = run_code(answer, m, l, acc, scores[:, t * block:(t + 1) * block], v[t * block:(t + 1) * block])
        if error:
            return False, error
        if not (isinstance(state, tuple) and len(state) == 3 and all(isinstance(x, torch.Tensor) for x in state)):
            return not_a("three tensors (m, l, acc)", state)
        m, l, acc = state
    want_m, want_l, want_acc = _reference_state(scores, v)
    if m.shape != want_m.shape or l.shape != want_l.shape or acc.shape != want_acc.shape:
        return False, (f"shapes m {tuple(m.shape)}, l {tuple(l.shape)}, acc {tuple(acc.shape)}; expected "
                       f"{tuple(want_m.shape)}, {tuple(want_l.shape)}, {tuple(want_acc.shape)}")
    if not torch.allclose(m, want_m):
        return False, "the running max m must become max(m, the tile's row max)"
    if not torch.allclose(l, want_l):
        return False, ("the running sum is wrong: before adding the tile's sum of exp(s − m_new), multiply the old "
                       "l by exp(m_old − m_new) (section 2's rescale column)")
    if torch.allclose(acc, torch.softmax(scores, -1) @ v):
        return False, ("acc is already divided by l: keep it unnormalised, and divide once after the last tile "
                       "(section 3)")
    if not torch.allclose(acc, want_acc):
        return False, ("m and l are right but acc is not: the old acc must be rescaled by exp(m_old − m_new) too, "
                       "then the tile's exp(s − m_new) @ V added (section 3)")
    return True, "after 5 tiles, acc / l equals softmax(scores) @ V, with a later tile raising the max"


@exercise("07.3", "elements the tiled loop moves for N = 1024, d = 64, tiles of 64")
def tiled_traffic(answer):
    from ..flash.tiled import tiled_attention
    elements = as_whole(answer)
    if elements is None:
        return not_a("a whole number of elements", answer)
    q, k, v = (torch.randn(1, 1, IO_N, IO_D) for _ in range(3))
    want = tiled_attention(q, k, v, causal=False, block_m=IO_BLOCK, block_n=IO_BLOCK).traffic.total_bytes // 4
    n, d, blocks = IO_N, IO_D, IO_N // IO_BLOCK
    if elements == 4 * n * d + 4 * n * n:
        return False, "that is standard attention's traffic (S and P out and back); the tiled loop never writes them"
    if elements in (4 * n * d, 4 * n * d + n):
        return False, (f"K and V are read once per query block, {blocks} times, not once: 2(N/B)·N·d for them "
                       "(section 5)")
    if elements == 2 * n * d + 2 * blocks * n * d:
        return False, "almost: the loop also writes one log-sum-exp per query row (N more elements)"
    if elements != want:
        return False, (f"{elements:,}: Q read and O written once, K and V once per query block, one log-sum-exp "
                       "per row (section 5)")
    return True, f"2Nd + 2(N/B)Nd + N = {want:,} elements, as tiled_attention's HBMTraffic counts them"
