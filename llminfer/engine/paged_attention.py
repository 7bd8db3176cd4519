"""Attention that reads K/V through block tables: the kernels a PagedKVCache can call. Chapter 06.

Every kernel has one signature:

    kernel(q (1, H, N, D), k_pool, v_pool (num_blocks, block_size, H_kv, D), metadata, backend) -> (1, H, N, D)

where q holds the N new tokens of several sequences side by side (the flattened batch of one engine
step), the pools hold every sequence's K/V (this step's already written), and `metadata` is the step's
`AttentionMetadata` (block tables, sequence lengths, query start offsets, ...). Token i may attend
only to its own sequence's positions up to its own.

- "gather" (any device): copy each sequence's K/V out of its blocks into a contiguous tensor (an
  indexed read, `index_select`) and run the model's dense attention backend on it. Single-token
  queries (decode steps) go in one padded, masked call; each multi-token chunk in its own causal call.
- "flex" (CUDA): torch's FlexAttention over the pool itself, with a mask that lets a query see only the
  slots its block table names, so no K/V are copied. Chosen by default on CUDA.
- "native" (CPU): llminfer's C++ kernel (`llminfer.cpu.paged_attention`, chapter 08) reads each
  token's keys and values in place from the blocks its sequence's table names, every sequence at its own
  length, in one call. `LLMEngine(optimize=True)` chooses it on a CPU.

A new kernel (chapter 07's Triton paged attention) registers itself with `register_paged_kernel`.
"""
from __future__ import annotations

import bisect
import importlib.util
import types
from typing import Callable

import torch

from ..attention import Registry
from .attention_metadata import AttentionMetadata, to_device

__all__ = ["register_paged_kernel", "get_paged_kernel", "paged_kernels", "default_paged_kernel",
           "gather_attention", "flex_attention_paged", "native_paged_attention", "gather_kv", "flex_block_mask",
           "FLEX_BLOCK"]


def gather_kv(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """K or V at the given pool slots: pool (num_blocks, block_size, H_kv, D), slots (..., L) -> (..., H_kv, L, D)."""
    flat = pool.view(-1, pool.shape[-2], pool.shape[-1])                 # (num_slots, H_kv, D)
    rows = flat.index_select(0, slots.reshape(-1)).view(*slots.shape, pool.shape[-2], pool.shape[-1])
    return rows.transpose(-3, -2)                                        # (..., H_kv, L, D)


def gather_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, metadata: AttentionMetadata,
                     backend: Callable) -> torch.Tensor:
    """Paged attention by gathering each sequence's blocks, then the dense backend. Chapter 06."""
    if metadata.all_decode:                                              # decode only: token i is sequence i
        q_dec = q[0].transpose(0, 1)[:, :, None]                         # (S, H, 1, D)
        k_dec = gather_kv(k_pool, metadata.decode_slots)                 # (S, H_kv, L, D)
        v_dec = gather_kv(v_pool, metadata.decode_slots)
        o_dec = backend(q_dec, k_dec, v_dec, causal=False, mask=metadata.decode_mask)  # (S, H, 1, D)
        return o_dec[:, :, 0].transpose(0, 1)[None]                      # (1, H, S, D)
    out = torch.empty_like(q)                                            # (1, H, N, D)
    if metadata.decode_seq_index:
        index = metadata.decode_token_index                              # (S_dec,) token of each decode step
        q_dec = q[0].index_select(1, index).transpose(0, 1)[:, :, None]  # (S_dec, H, 1, D)
        k_dec = gather_kv(k_pool, metadata.decode_slots)                 # (S_dec, H_kv, L, D)
        v_dec = gather_kv(v_pool, metadata.decode_slots)
        o_dec = backend(q_dec, k_dec, v_dec, causal=False, mask=metadata.decode_mask)  # (S_dec, H, 1, D)
        out[0].index_copy_(1, index, o_dec[:, :, 0].transpose(0, 1))
    for start, end, slots in metadata.prefill_plan:
        k_seq = gather_kv(k_pool, slots)[None]                           # (1, H_kv, L, D)
        v_seq = gather_kv(v_pool, slots)[None]
        out[:, :, start:end] = backend(q[:, :, start:end], k_seq, v_seq, causal=True)  # last T of L positions
    return out


FLEX_BLOCK = 128   # FlexAttention's tile: 128 queries by 128 key slots (its default sparse block size)


def flex_block_mask(metadata: AttentionMetadata, num_blocks: int, device):
    """The FlexAttention block mask of one step, built from its block tables (once, shared by every layer). Chapter 06.

    The keys are the pool's num_blocks · block_size slots. Which 128-slot key tiles each 128-query tile needs is
    read off the block tables of the sequences its tokens belong to, so the mask's index tensors grow with
    those sequences' blocks, not with the pool. Inside a tile, `mask_mod` lets a token see a slot only if its own
    sequence's table names the slot's block and the slot's position is not after its own. For that it needs the
    column of each pool block in the table that holds it (one int64 per block, -1 if no sequence of the step
    holds it): a block shared by several sequences (a cached prefix, a fork) sits at the same column in each,
    since a block holds positions block_size · column onward wherever it is shared.
    """
    from torch.nn.attention.flex_attention import BlockMask

    cached = getattr(metadata, "_flex_mask", None)
    if cached is not None:
        return cached
    device = torch.device(device)
    size, n_tokens = metadata.block_size, metadata.num_tokens
    starts = metadata.query_start_loc_list                           # (S + 1,) host offsets of each sequence
    used = [-(-seq_len // size) for seq_len in metadata.seq_lens]    # blocks each sequence holds after the step
    tiles_of_seq = []
    for table, n_used in zip(metadata.block_tables, used):
        tiles = set()
        for block in table[:n_used]:
            tiles.update(range(block * size // FLEX_BLOCK, ((block + 1) * size - 1) // FLEX_BLOCK + 1))
        tiles_of_seq.append(tiles)
    rows = []
    for first in range(0, n_tokens, FLEX_BLOCK):                     # each query tile: its tokens' sequences
        last = min(n_tokens, first + FLEX_BLOCK) - 1
        seq_first, seq_last = bisect.bisect_right(starts, first) - 1, bisect.bisect_right(starts, last) - 1
        rows.append(sorted(set().union(*tiles_of_seq[seq_first:seq_last + 1])))
    width = max(len(row) for row in rows)
    moved = to_device({"kv_num_blocks": [len(row) for row in rows],
                       "kv_indices": [row + [0] * (width - len(row)) for row in rows],
                       "used": used}, device)
    kv_num_blocks = moved["kv_num_blocks"].to(torch.int32)[None, None]    # (1, 1, q_tiles)
    kv_indices = moved["kv_indices"].to(torch.int32)[None, None]          # (1, 1, q_tiles, width)

    tables = metadata.block_table_tensor                                   # (S, max_blocks)
    columns = torch.arange(tables.shape[1], device=device).expand_as(tables)
    held = torch.where(columns < moved["used"][:, None], tables, num_blocks)   # padding goes to a spare entry
    column_of_block = torch.full((num_blocks + 1,), -1, dtype=torch.long, device=device)
    column_of_block.scatter_(0, held.reshape(-1), columns.reshape(-1))   # (num_blocks + 1,)
    token_seq, positions = metadata.token_seq, metadata.positions

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // size
        column = column_of_block[block]
        seq = token_seq[q_idx]
        owned = (column >= 0) & (tables[seq, column.clamp(min=0)] == block)
        # (a padded table entry names block 0 at a column past the sequence's length: the position rule hides it)
        return owned & (column * size + kv_idx % size <= positions[q_idx])

    mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(n_tokens, num_blocks * size), compute_q_blocks=False)
    metadata._flex_mask = mask
    return mask


# The torch.compile backend FlexAttention is compiled with, per device type; elsewhere it runs eagerly (torch's
# unfused reference). Inductor's CPU template refuses a mask over the pool's slots, so CPUs have none; a test names
# "eager" for the CPU to count dynamo's compiles and guards without a GPU.
FLEX_COMPILE_BACKENDS = {"cuda": "inductor"}
# Dynamo compiles once per guard class: each size that is 1 in one step and more in another (tokens, sequences,
# block-table width, query tiles, key tiles per query tile) is specialised apart, so one pool shape can meet up to
# about 20 classes (the warm-up compiles 9 of them). Dynamo's default limit, 8 per function, would run the 9th
# class eagerly: the unfused reference that materialises the scores of every token against the whole pool
# (gigabytes), and warns in the middle of a notebook's output. So each pool shape (device, dtype, query and K/V
# heads, head_dim) gets a compiled function of its own, and this limit while it compiles.
FLEX_RECOMPILE_LIMIT = 64
_compiled_flex: dict[tuple, Callable] = {}


def _flex_call(q, keys, values, block_mask, enable_gqa):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, keys, values, block_mask=block_mask, enable_gqa=enable_gqa)


def _flex_function(q: torch.Tensor, keys: torch.Tensor) -> Callable:
    """flex_attention, compiled once per pool shape where FLEX_COMPILE_BACKENDS names a backend for the device;
    torch's eager reference elsewhere. Chapter 06.

    Dynamo keeps a function's compiled versions (one per guard class) on its code object and stops compiling when
    they reach the recompile limit, so each key gets a copy of _flex_call with a code object of its own: a second
    dtype or head size starts its own count instead of pushing the first past the limit.
    """
    backend = FLEX_COMPILE_BACKENDS.get(q.device.type)
    if backend is None:
        return _flex_call
    key = (q.device, q.dtype, q.shape[1], keys.shape[1], keys.shape[-1], backend)
    if key not in _compiled_flex:
        name = f"flex_attention_{str(q.dtype).replace('torch.', '')}_{q.shape[1]}x{keys.shape[-1]}"
        code = _flex_call.__code__.replace(co_name=name, co_qualname=name)
        compiled = torch.compile(types.FunctionType(code, _flex_call.__globals__, name), dynamic=True,
                                 backend=backend)

        def run(*args, _compiled=compiled):
            with torch._dynamo.config.patch(recompile_limit=max(FLEX_RECOMPILE_LIMIT,
                                                                torch._dynamo.config.recompile_limit)):
                return _compiled(*args)
        run.code = code                          # where dynamo keeps this key's compiled versions
        _compiled_flex[key] = run
    return _compiled_flex[key]


def flex_attention_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, metadata: AttentionMetadata,
                         backend: Callable | None = None) -> torch.Tensor:
    """Paged attention with FlexAttention over the whole pool, masked by the block tables. Chapter 06.

    The pool's slots are the key axis; a query sees a slot only if its own sequence's block table names
    that slot's block and the slot's position is not after the query's. Compiled on CUDA; elsewhere torch
    runs its unfused reference version (correct, slow: for tests).
    """
    num_blocks, block_size, n_kv_heads, head_dim = k_pool.shape
    keys = k_pool.view(1, num_blocks * block_size, n_kv_heads, head_dim).transpose(1, 2)    # (1, H_kv, slots, D)
    values = v_pool.view(1, num_blocks * block_size, n_kv_heads, head_dim).transpose(1, 2)
    mask = flex_block_mask(metadata, num_blocks, q.device)
    return _flex_function(q, keys)(q, keys, values, mask, q.shape[1] != n_kv_heads)


_KERNELS = Registry("paged-attention kernel", {"gather": gather_attention, "flex": flex_attention_paged})


def register_paged_kernel(name: str, fn: Callable, replace: bool = False) -> None:
    """Makes fn selectable as PagedKVCache(kernel=name). Chapter 07 registers its Triton kernel here."""
    _KERNELS.register(name, fn, replace)


def get_paged_kernel(name: str) -> Callable:
    """Returns the paged-attention kernel registered as name ('gather', 'flex', ...)."""
    return _KERNELS.get(name)


def paged_kernels() -> list[str]:
    """Names of the registered paged-attention kernels."""
    return _KERNELS.names()


def default_paged_kernel(device: torch.device | str) -> str:
    """'flex' on CUDA (FlexAttention reads the blocks in place), 'gather' elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return "flex" if importlib.util.find_spec("torch.nn.attention.flex_attention") else "gather"
    return "gather"


def native_paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, metadata: AttentionMetadata,
                           backend: Callable | None = None) -> torch.Tensor:
    """Paged attention by the native CPU kernel, K/V read in place through the block tables (1, H, N, D).
    Chapters 06 and 08."""
    from .. import cpu

    if q.device.type != "cpu":
        raise ValueError(f"the 'native' paged-attention kernel runs on the CPU, got q on {q.device}; use 'flex' or "
                         "'gather' there")
    return cpu.paged_attention(q, k_pool, v_pool, metadata.block_table_tensor, metadata.token_seq, metadata.positions)


register_paged_kernel("native", native_paged_attention)
