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
- "native" (CPU): llminfer's C++ kernel (`llminfer.kernels.cpu.paged_attention`, chapter 08) reads each
  token's keys and values in place from the blocks its sequence's table names, every sequence at its own
  length, in one call. `LLMEngine(optimize=True)` chooses it on a CPU.

A new kernel (chapter 07's Triton paged attention) registers itself with `register_paged_kernel`.
"""
from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from ..attention import Registry
from .attention_metadata import AttentionMetadata

__all__ = ["register_paged_kernel", "get_paged_kernel", "paged_kernels", "default_paged_kernel",
           "gather_attention", "flex_attention_paged", "native_paged_attention", "gather_kv"]


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


def _flex_block_mask(metadata: AttentionMetadata, num_blocks: int, device):
    """The FlexAttention block mask of one step (built once, shared by every layer)."""
    from torch.nn.attention.flex_attention import create_block_mask

    cached = getattr(metadata, "_flex_mask", None)
    if cached is not None:
        return cached
    size = metadata.block_size
    # logical[s, b]: the logical index of physical block b in sequence s's table, or -1 if s does not own b
    logical = torch.full((metadata.num_seqs, num_blocks), -1, dtype=torch.long)
    for s, table in enumerate(metadata.block_tables):
        logical[s, torch.tensor(table, dtype=torch.long)] = torch.arange(len(table))
    logical = logical.to(device)
    token_seq, positions = metadata.token_seq, metadata.positions

    def mask_mod(b, h, q_idx, kv_idx):
        slot_logical = logical[token_seq[q_idx], kv_idx // size]
        return (slot_logical >= 0) & (slot_logical * size + kv_idx % size <= positions[q_idx])

    n_tokens = metadata.num_tokens
    mask = create_block_mask(mask_mod, 1, None, n_tokens, num_blocks * size, device=device)
    metadata._flex_mask = mask
    return mask


_compiled_flex = None


def flex_attention_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, metadata: AttentionMetadata,
                         backend: Callable | None = None) -> torch.Tensor:
    """Paged attention with FlexAttention over the whole pool, masked by the block tables. Chapter 06.

    The pool's slots are the key axis; a query sees a slot only if its own sequence's block table names
    that slot's block and the slot's position is not after the query's. Compiled on CUDA; elsewhere torch
    runs its unfused reference version (correct, slow: for tests).
    """
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    num_blocks, block_size, n_kv_heads, head_dim = k_pool.shape
    keys = k_pool.view(1, num_blocks * block_size, n_kv_heads, head_dim).transpose(1, 2)    # (1, H_kv, slots, D)
    values = v_pool.view(1, num_blocks * block_size, n_kv_heads, head_dim).transpose(1, 2)
    mask = _flex_block_mask(metadata, num_blocks, q.device)
    fn = flex_attention
    if q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    return fn(q, keys, values, block_mask=mask, enable_gqa=q.shape[1] != n_kv_heads)


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
    from ..kernels import cpu

    if q.device.type != "cpu":
        raise ValueError(f"the 'native' paged-attention kernel runs on the CPU, got q on {q.device}; use 'flex' or "
                         "'gather' there")
    return cpu.paged_attention(q, k_pool, v_pool, metadata.block_table_tensor, metadata.token_seq, metadata.positions)


register_paged_kernel("native", native_paged_attention)
