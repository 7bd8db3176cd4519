"""The paged KV cache: one pool of fixed-size blocks per layer, read through block tables. Chapter 06.

`PagedKVCache` speaks the same protocol as the contiguous `KVCache` of chapter 04
(`begin` / `attend` / `end`), so the model's one forward runs on it unchanged:

    cache.bind(metadata)                       # the engine's step: which tokens, which blocks
    logits = model(input_ids, positions, cache)
    cache.unbind()

Per layer, `attend` writes the step's new K/V into their slots (`slot_mapping`) and then runs a
paged-attention kernel (`paged_attention.py`) that reads each sequence's K/V through its block table.

Used on its own (no metadata bound), the cache manages block tables itself for a batch of equal-length
sequences, so `llminfer.prefill` and `llminfer.decode_step` work on it like on a `KVCache`:

    cache = PagedKVCache.for_model(model, num_blocks=32, block_size=16)
    logits = llminfer.prefill(model, ids, cache)
    cache.block_tables            # [[0, 1]] for a 20-token prompt
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from .. import costs
from ..attention import get_backend
from ..cpu.stack import CacheKind, NativeKV
from ..device import check_fits, dtype_bytes
from ..kv_cache import CacheBase, cache_shape
from .attention_metadata import AttentionMetadata
from .block_manager import BlockManager
from .paged_attention import FLEX_BLOCK, default_paged_kernel, gather_attention, get_paged_kernel
from .sampling_params import SamplingParams
from .sequence import Sequence

__all__ = ["PagedKVCache"]


class PagedKVCache(CacheBase, NativeKV):
    """K/V in num_blocks blocks of block_size positions per layer; the cache protocol over block tables. Chapter 06.

    It is also a `cpu.stack.NativeKV`: a native layer stack (chapter 08) writes and reads its pools in place through
    the block tables, one call an engine step."""

    kind = "PagedKVCache"

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, kernel: str | None = None):
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                            ("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PagedKVCache {name} must be a positive integer, got {value!r}")
        if block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}; try {1 << block_size.bit_length()}")
        self.device = torch.device(device)
        self.kernel_name = kernel or default_paged_kernel(self.device)
        self._kernel = get_paged_kernel(self.kernel_name)       # an unknown name is refused here
        self._auto_kernel = kernel is None
        self.kernel_fallbacks = 0                # automatic choices that failed and fell back to 'gather'
        self.kernel_fallback = ""                # the last such failure: which kernel, and why
        needed = costs.kv_cache_bytes(costs.KVShape(n_layers, n_kv_heads, head_dim), num_blocks * block_size,
                                      dtype_bytes(dtype))                 # a pool's bytes: its positions' K/V
        check_fits(needed, self.device, f"a paged KV cache of {num_blocks} blocks × {block_size} positions × "
                   f"{n_layers} layers", fix="pass a smaller num_blocks")
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(n_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self._metadata: AttentionMetadata | None = None
        # standalone use (no engine): this cache keeps its own block tables for a batch of sequences
        super().__init__(batch_size=0)           # set by the first forward of a batch
        self._blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self._rows: list[Sequence] = []

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16, kernel: str | None = None) -> "PagedKVCache":
        """A pool shaped for `model`, on its device and dtype."""
        shape = cache_shape(model)
        cache = cls(shape.n_layers, shape.n_kv_heads, shape.head_dim, num_blocks, block_size, model.device,
                    model.dtype, kernel)
        if cache.kernel_name == "flex" and cache.device.type == "cuda":     # compile now, not in a request
            cache.warm_up(shape.n_kv_heads * (model.config.n_heads // model.config.n_kv_heads))
        return cache

    @torch.inference_mode()
    def warm_up(self, n_heads: int) -> list[int]:
        """Runs the kernel on the pool (read only) once per shape class a compiled FlexAttention specialises on;
        returns the query count of each run. Chapter 06.

        The classes: fewer than 128 queries (its decoding kernel) and 128 or more (its prefill kernel), each with
        one sequence and with several, of one block and of several, their blocks in one key tile and in several
        (torch specialises a size of 1 apart from larger ones; `paged_attention.FLEX_RECOMPILE_LIMIT` says why a
        class met later still compiles). A compiled kernel compiles on the first call of each class, which would
        otherwise land inside a request's TTFT (the server's first request, a benchmark's first long prompt).
        A class the pool is too small for is skipped. A kernel that fails here falls back to 'gather' as in a
        step (counted in `kernel_fallbacks`).
        """
        size, blocks = self.block_size, self.num_blocks
        far = max(1, FLEX_BLOCK // size)                              # the first block of the second key tile

        def decode(table):                                            # one query after every block of table
            return 1, (len(table) - 1) * size, table

        def prefill(n, first=0):                                      # n queries from position 0
            return n, 0, list(range(first, first + -(-n // size)))
        plans = [[decode([0])], [decode([0, 1])], [decode([0, far])], [decode([0]), decode([1])],
                 [decode([0, 1]), decode([2, 3])], [decode([0, far]), decode([1, far + 1])],
                 [prefill(FLEX_BLOCK)], [prefill(FLEX_BLOCK + 1)], [prefill(65), prefill(64, first=-(-65 // size))]]
        run = []
        for plan in plans:
            if max(max(table) for _, _, table in plan) >= blocks:
                continue                                              # the pool cannot hold this shape
            seqs = [Sequence(-1, [0] * (c + n), SamplingParams(max_new_tokens=1), 0.0) for n, c, _ in plan]
            meta = AttentionMetadata(seqs=seqs, query_lens=[n for n, _, _ in plan],
                                     context_lens=[c for _, c, _ in plan], block_tables=[t for _, _, t in plan],
                                     block_size=size).prepare(self.device)
            q = torch.zeros(1, n_heads, meta.num_tokens, self.k[0].shape[-1], device=self.device, dtype=self.k[0].dtype)
            self._run_kernel(q, self.k[0], self.v[0], meta, get_backend("sdpa"))
            run.append(meta.num_tokens)
        return run

    def _run_kernel(self, q, k_pool, v_pool, meta, backend) -> torch.Tensor:
        """The kernel's output (1, H, N, D); an automatic choice that fails (e.g. no compiler for it) is counted
        and replaced by 'gather' for this cache from then on."""
        try:
            return self._kernel(q, k_pool, v_pool, meta, backend)                  # (1, H, N, D)
        except Exception as exc:
            if not self._auto_kernel or self._kernel is gather_attention:
                raise
            self.kernel_fallbacks += 1
            self.kernel_fallback = f"{self.kernel_name} -> gather: {exc!r}"[:500]
            warnings.warn(f"paged-attention kernel {self.kernel_name!r} failed ({exc!r}); using 'gather' (counted "
                          "in the engine's stats as kernel_fallbacks)")
            self.kernel_name, self._kernel = "gather", gather_attention
            return gather_attention(q, k_pool, v_pool, meta, backend)

    # --- what it holds -----------------------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for every layer's K and V pool."""
        return sum(t.untyped_storage().nbytes() for t in self.k + self.v)

    @property
    def capacity(self) -> int:
        """Positions the pool can hold in all (one sequence may use all of them)."""
        return self.num_blocks * self.block_size

    @property
    def length(self) -> int:
        """Positions held per sequence: standalone, the batch's shared length; bound to an engine step,
        the longest context before the step."""
        if self._metadata is not None:
            return max(self._metadata.context_lens)
        return self._length

    @property
    def block_tables(self) -> list[list[int]]:
        """Standalone use: each sequence's block table."""
        return [list(row.block_table) for row in self._rows]

    def gather(self, layer_idx: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's K and V of one layer, read through its block table: each (1, H_kv, length, D). Chapter 06."""
        if not 0 <= layer_idx < self.n_layers:
            raise ValueError(f"layer_idx={layer_idx} is outside 0..{self.n_layers - 1}")
        if length > len(block_table) * self.block_size:
            raise ValueError(f"{length} positions do not fit in {len(block_table)} blocks of {self.block_size}")
        pos = torch.arange(length)
        slots = (torch.tensor(block_table, dtype=torch.long)[pos // self.block_size] * self.block_size
                 + pos % self.block_size).to(self.device)
        flat_k = self.k[layer_idx].view(-1, *self.k[layer_idx].shape[2:])
        flat_v = self.v[layer_idx].view(-1, *self.v[layer_idx].shape[2:])
        return (flat_k[slots].transpose(0, 1)[None], flat_v[slots].transpose(0, 1)[None])

    def write(self, layer_idx: int, block_table: list[int], k: torch.Tensor, v: torch.Tensor,
              start_pos: int = 0) -> None:
        """Writes one sequence's K and V, each (1, H_kv, T, D), at positions start_pos.. of its blocks. Chapter 12.

        The inverse of `gather`: K/V computed elsewhere (a prefill worker) land in the pool through the
        sequence's block table, as if this cache's own forward had written them."""
        if not 0 <= layer_idx < self.n_layers:
            raise ValueError(f"layer_idx={layer_idx} is outside 0..{self.n_layers - 1}")
        n_kv_heads, head_dim = self.k[layer_idx].shape[2:]
        if k.dim() != 4 or k.shape[0] != 1 or k.shape[1] != n_kv_heads or k.shape[3] != head_dim \
                or v.shape != k.shape:
            raise ValueError(f"K/V of shapes {tuple(k.shape)} and {tuple(v.shape)}; expected both (1, n_kv_heads="
                             f"{n_kv_heads}, positions, head_dim={head_dim})")
        end = start_pos + k.shape[2]
        if start_pos < 0 or end > len(block_table) * self.block_size:
            raise ValueError(f"positions {start_pos}..{end - 1} do not fit in {len(block_table)} blocks of "
                             f"{self.block_size}; allocate the blocks first")
        pos = torch.arange(start_pos, end)
        slots = (torch.tensor(block_table, dtype=torch.long)[pos // self.block_size] * self.block_size
                 + pos % self.block_size).to(self.device)                                  # (T,)
        for pool, tensor in ((self.k[layer_idx], k), (self.v[layer_idx], v)):
            flat = pool.view(-1, *pool.shape[2:])                                           # (blocks · size, H_kv, D)
            flat.index_copy_(0, slots, tensor[0].transpose(0, 1).to(device=flat.device, dtype=flat.dtype))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies every layer's K/V of block src into block dst, for each (src, dst): copy-on-write. Chapter 06."""
        for src, dst in pairs:
            for pool in self.k + self.v:
                pool[dst].copy_(pool[src])

    def native_storage(self) -> tuple[CacheKind, list[torch.Tensor], list[torch.Tensor]]:
        """The pools `k`, `v` (num_blocks, block_size, H_kv, D), one a layer, which a native stack reads in place
        through the block tables (chapter 08)."""
        return CacheKind.PAGED, self.k, self.v

    def native_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a kernel that writes K/V and attends through the block tables in one call (chapter 08's native layer
        stack): the forward in flight's positions (N,), each token's sequence (N,) and the block tables (S,
        max_blocks). Token t is written to its sequence's slot for positions[t] and sees that sequence's positions
        0..positions[t]. None outside a forward. Chapter 06."""
        meta = self._metadata
        if meta is None or not meta.prepared:
            return None
        return meta.positions, meta.token_seq, meta.block_table_tensor

    # --- binding an engine step -------------------------------------------------------------------

    def bind(self, metadata: AttentionMetadata) -> None:
        """The next forward runs this engine step (metadata prepared on this cache's device)."""
        metadata.prepare(self.device)
        self._metadata = metadata

    def unbind(self) -> None:
        self._metadata = None

    # --- the protocol ------------------------------------------------------------------------------

    def begin(self, n_tokens: int, batch_size: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Checks the forward against the bound step (or books room for it when standalone); returns positions."""
        meta = self._metadata
        if meta is None or self._start is not None:        # standalone (a step of its own left unfinished too)
            return super().begin(n_tokens, batch_size, positions)
        if batch_size != 1 or n_tokens != meta.num_tokens:
            raise ValueError(f"the bound engine step runs {meta.num_tokens} tokens as input_ids of shape "
                             f"(1, {meta.num_tokens}), got ({batch_size}, {n_tokens})")
        if positions is None or positions is meta.positions:
            return meta.positions
        if positions.dim() == 2:
            positions = positions[0]
        if positions.shape != meta.positions.shape or not torch.equal(positions.to(meta.positions.device),
                                                                      meta.positions):
            raise ValueError("positions disagree with the bound engine step's metadata; pass metadata.positions")
        return meta.positions

    def check_write(self, start: int, n_tokens: int, batch_size: int) -> None:
        """Standalone: the first forward of a batch sets its size; every forward must fit the pool's blocks."""
        if not self._rows:
            self.batch_size = batch_size
        elif batch_size != len(self._rows):
            raise ValueError(f"the cache holds {len(self._rows)} sequences but the input has {batch_size}; "
                             "call cache.reset() to start a new batch")
        super().check_write(start, n_tokens, batch_size)
        per_row = self._blocks.blocks_needed(start + n_tokens)
        if per_row * batch_size - sum(len(r.block_table) for r in self._rows) > self._blocks.num_free_blocks:
            raise ValueError(f"{batch_size} sequence(s) of {start + n_tokens} positions need "
                             f"{per_row * batch_size} blocks of {self.block_size} but the pool has "
                             f"{self.num_blocks}; make a cache with more blocks")

    def _reserve(self, start: int, n_tokens: int, batch_size: int) -> None:
        """Standalone: allocates each sequence the blocks its new positions need, and the step's metadata."""
        if not self._rows:
            params = SamplingParams(max_new_tokens=1)
            self._rows = [Sequence(i, [], params, 0.0) for i in range(batch_size)]
        for row in self._rows:
            row.token_ids.extend([0] * (start + n_tokens - len(row.token_ids)))   # the pool needs how many, not which
            self._blocks.allocate(row, start + n_tokens - row.num_computed_tokens)
        meta = AttentionMetadata(seqs=self._rows, query_lens=[n_tokens] * batch_size,
                                 context_lens=[start] * batch_size,
                                 block_tables=[list(r.block_table) for r in self._rows], block_size=self.block_size)
        self._metadata = meta.prepare(self.device)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend: Callable) -> torch.Tensor:
        """Writes this layer's new K/V into their slots, then attends through the block tables (B, H, T, D)."""
        meta = self._metadata
        batch, n_heads, seq_len, head_dim = q.shape
        if batch > 1:                                   # standalone batch: rows side by side, like an engine step
            q = q.transpose(0, 1).reshape(1, n_heads, batch * seq_len, head_dim)
            k = k.transpose(0, 1).reshape(1, k.shape[1], batch * seq_len, head_dim)
            v = v.transpose(0, 1).reshape(1, v.shape[1], batch * seq_len, head_dim)
        k_pool, v_pool = self.k[layer_idx], self.v[layer_idx]
        k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, meta.slot_mapping, k[0].transpose(0, 1))  # (N, H_kv, D)
        v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, meta.slot_mapping, v[0].transpose(0, 1))
        out = self._run_kernel(q, k_pool, v_pool, meta, backend)                   # (1, H, N, D)
        if batch > 1:
            out = out.reshape(n_heads, batch, seq_len, head_dim).transpose(0, 1)
        return out

    def end(self) -> None:
        """Standalone: the positions written become part of every sequence. Engine steps advance elsewhere."""
        if self._start is not None:
            for row in self._rows:
                row.num_computed_tokens = self._start + self._n_new
            self._metadata = None
        super().end()

    def _forget(self, length: int) -> None:
        """Standalone: each sequence keeps the blocks of its first `length` positions; the rest go back to the
        pool. (Bound to an engine step, the engine's block manager frees blocks, not the cache.)"""
        keep = self._blocks.blocks_needed(length)
        for row in self._rows:
            tail = Sequence(-1, [], row.params, 0.0)
            tail.block_table, row.block_table = row.block_table[keep:], row.block_table[:keep]
            self._blocks.free(tail)
            del row.token_ids[length:]
            row.num_computed_tokens = length

    def reset(self) -> None:
        """Standalone: frees every block (the pool stays allocated); a new batch may start."""
        super().reset()
        self._rows, self._metadata = [], None

    def __repr__(self) -> str:
        nb, bs, h, d = self.k[0].shape
        return (f"PagedKVCache(layers={self.n_layers}, blocks={nb} × {bs} positions, n_kv_heads={h}, head_dim={d}, "
                f"dtype={self.k[0].dtype}, kernel={self.kernel_name!r}, {self.nbytes / 2**20:.2f} MiB)")
