"""The static mode of the KV cache: what a CUDA graph or a compiled step replays. Chapter 04.

Replaying a recorded step needs every tensor at a fixed address and shape, and no host sync. So a
`StaticKVCache` takes the position as a device tensor (not a Python int), writes K/V with `index_copy_` into
its preallocated buffers, and attends over the whole buffer with a mask that hides the positions not yet
written. It does not read the positions back, so it cannot advance its own length: the decoder that replays
the step sets `cache.length`, which it knows on the host. A forward with positions=None (a prefill) runs as
on any `KVCache`. Used by `llminfer.cuda_graphs` and `llminfer.fast`.
"""
from __future__ import annotations

from typing import Callable

import torch

from .kv_cache import KVCache

__all__ = ["StaticKVCache"]


class StaticKVCache(KVCache):
    """A KVCache written at an explicit positions tensor, attended over in full: fixed shapes. Chapter 04."""

    kind = "StaticKVCache"

    def begin(self, n_tokens: int, batch_size: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Records a forward at `positions` (T,), used as given (no checks: no host sync); returns them.
        positions=None: an ordinary forward from `length`, checked like a KVCache's."""
        if positions is None:
            return super().begin(n_tokens, batch_size)
        self._start, self._n_new, self._positions = None, n_tokens, positions
        return positions

    def _static(self) -> bool:
        return self._start is None and self._positions is not None

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, v (B, n_kv_heads, T, head_dim) at the positions begun; returns every slot's K and V."""
        if not self._static():
            return super().update(layer_idx, k, v)
        keys, values = self.k[layer_idx], self.v[layer_idx]
        keys.index_copy_(2, self._positions, k)
        values.index_copy_(2, self._positions, v)
        return keys, values                                     # (B, n_kv_heads, max_seq_len, head_dim)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend: Callable) -> torch.Tensor:
        """Writes this layer's k, v; returns attention of q over every slot, those past each query masked."""
        if not self._static():
            return super().attend(layer_idx, q, k, v, backend)
        keys, values = self.update(layer_idx, k, v)
        slots = torch.arange(self.max_seq_len, device=q.device)
        visible = slots[None, :] <= self._positions[:, None]                    # (T, max_seq_len)
        return backend(q, keys, values, causal=False, mask=visible[None, None])

    def __repr__(self) -> str:
        return "Static" + super().__repr__()
