"""The KV cache: the protocol every cache speaks, and the contiguous `KVCache` that owns its length. Chapter 04.

A forward with a cache goes through three calls, made by `Transformer.forward`:

    positions = cache.begin(n_tokens, positions)   # where the new tokens go; checks, before any compute
    out = cache.attend(layer, q, k, v, backend)    # per layer: write k, v at those positions, attend over the prefix
    cache.end()                                    # the new positions now count: length advances

`KVCache` keeps one (B, n_kv_heads, max_seq_len, head_dim) buffer for K and one for V per layer and
writes in place, so a decode step copies one position per layer instead of the whole prefix. The paged
cache of chapter 06 implements the same protocol over blocks. `KVCache.slots(layer)` is optional in the
protocol: it hands a kernel that writes and attends in one call (chapter 08) the buffers and positions.
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

from . import costs
from .config import ModelConfig
from .device import check_fits, dtype_bytes

__all__ = ["Cache", "KVCache", "kv_cache_bytes"]


def kv_cache_bytes(config: ModelConfig, seq_len: int, batch_size: int = 1, dtype: torch.dtype = torch.float16) -> int:
    """Bytes of K and V for every layer: 2 · layers · kv_heads · head_dim · seq_len · batch · bytes. Chapter 04."""
    if seq_len < 0 or batch_size < 1:
        raise ValueError(f"seq_len must be >= 0 and batch_size >= 1; got seq_len={seq_len}, batch_size={batch_size}")
    return costs.kv_cache_bytes(config, seq_len, dtype_bytes(dtype), batch_size)


@runtime_checkable
class Cache(Protocol):
    """What `Transformer.forward` needs of a KV cache (contiguous or paged). Chapter 04."""

    @property
    def length(self) -> int: ...            # positions that hold valid K/V (per sequence)

    @property
    def capacity(self) -> int: ...          # positions it can hold (per sequence)

    @property
    def nbytes(self) -> int: ...            # bytes it has allocated

    def begin(self, n_tokens: int, batch_size: int, positions: torch.Tensor | None = None) -> torch.Tensor: ...

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend: Callable) -> torch.Tensor: ...

    def end(self) -> None: ...

    def reset(self) -> None: ...


class KVCache:
    """Preallocated K/V storage, one (B, n_kv_heads, max_seq_len, head_dim) buffer each per layer. Chapter 04."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        for name, value in (("n_layers", n_layers), ("batch_size", batch_size), ("n_kv_heads", n_kv_heads),
                            ("max_seq_len", max_seq_len), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVCache {name} must be a positive integer, got {value!r}")
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        needed = 2 * n_layers * batch_size * n_kv_heads * max_seq_len * head_dim * dtype_bytes(dtype)
        check_fits(needed, device, f"a KV cache of {n_layers} layers × batch {batch_size} × {max_seq_len} positions "
                   f"× {n_kv_heads} K/V heads × head_dim {head_dim} in {str(dtype).replace('torch.', '')}",
                   fix="pass a smaller max_seq_len or batch_size")
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self._length = 0            # positions 0 .. length-1 hold valid K/V
        self._start: int | None = None    # where the forward in flight writes (None: static, see below)
        self._n_new = 0
        self._positions: torch.Tensor | None = None
        self.static = False         # True: write at a positions tensor and attend over the whole buffer (CUDA graphs)

    @classmethod
    def for_config(cls, config: ModelConfig, batch_size: int = 1, max_seq_len: int | None = None,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> "KVCache":
        """A cache sized for `config` (max_seq_len defaults to the model's)."""
        max_seq_len = config.max_seq_len if max_seq_len is None else max_seq_len
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        if max_seq_len > config.max_seq_len:
            raise ValueError(
                f"a cache of {max_seq_len} positions is longer than the model's max_seq_len={config.max_seq_len}; "
                f"pass max_seq_len <= {config.max_seq_len}"
            )
        return cls(config.n_layers, batch_size, config.n_kv_heads, max_seq_len, config.head_dim, device, dtype)

    # --- what it holds -----------------------------------------------------------------------------

    @property
    def length(self) -> int:
        """Positions 0 .. length-1 hold valid K/V; the next token goes at position `length`."""
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        self.truncate(value) if value <= self._length else self._set_length(value)

    def _set_length(self, value: int) -> None:
        if not 0 <= value <= self.max_seq_len:
            raise ValueError(f"a cache length must lie in 0..{self.max_seq_len}, got {value}")
        self._length = value

    @property
    def capacity(self) -> int:
        """Positions each sequence can hold."""
        return self.max_seq_len

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated for all K and V buffers."""
        return sum(t.untyped_storage().nbytes() for t in self.k + self.v)

    def get(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns views of the valid K and V of one layer, each (B, n_kv_heads, length, head_dim). Chapter 04."""
        if not 0 <= layer_idx < self.n_layers:
            raise ValueError(f"layer_idx={layer_idx} is outside 0..{self.n_layers - 1}")
        return self.k[layer_idx][:, :, :self._length], self.v[layer_idx][:, :, :self._length]

    # --- the protocol ------------------------------------------------------------------------------

    def check_write(self, start: int, n_tokens: int, batch_size: int) -> None:
        """Raise ValueError, before any compute, if writing n_tokens at `start` would not fit or leave a gap."""
        if batch_size != self.batch_size:
            raise ValueError(f"the cache holds batch_size={self.batch_size} sequences but the input has {batch_size}; "
                             "make a cache for this batch with model.new_cache(batch_size=...)")
        if start != self._length:
            raise ValueError(f"the new tokens would start at position {start} but the cache holds {self._length} "
                             f"positions; positions continue from the cache's length (pass positions=None), or "
                             f"call cache.truncate({start}) first to overwrite from there")
        if start + n_tokens > self.max_seq_len:
            raise ValueError(
                f"writing {n_tokens} token(s) after the {start} cached positions needs {start + n_tokens} positions "
                f"but the cache holds max_seq_len={self.max_seq_len}; make a larger cache "
                f"(model.new_cache(max_seq_len={start + n_tokens})) or shorten the sequence"
            )

    def begin(self, n_tokens: int, batch_size: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Checks and records a forward of n_tokens new positions; returns their positions (T,). Chapter 04.

        positions=None continues from `length` with no host sync. An explicit positions tensor must
        continue from `length` too (checked here, one host read); in static mode it is used as given.
        """
        device = self.k[0].device
        if self.static:
            if positions is None:
                raise ValueError("a static cache needs an explicit positions tensor (it is replayed by a CUDA graph)")
            self._start, self._n_new, self._positions = None, n_tokens, positions
            return positions
        if positions is None:
            start = self._length
            self.check_write(start, n_tokens, batch_size)
            positions = torch.arange(start, start + n_tokens, device=device)
        else:
            if positions.dim() != 1:
                raise ValueError(f"a contiguous KVCache shares positions across the batch: pass a (T,) tensor, got "
                                 f"shape {tuple(positions.shape)}")
            values = positions.tolist()
            start = values[0]
            if values != list(range(start, start + n_tokens)):
                raise ValueError(f"positions {values[:8]}{'…' if len(values) > 8 else ''} are not consecutive; a "
                                 "contiguous KVCache writes one run of positions per forward")
            self.check_write(start, n_tokens, batch_size)
        self._start, self._n_new, self._positions = start, n_tokens, positions
        return positions

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, v (B, n_kv_heads, T, head_dim) at the positions begun; returns the K, V to attend over."""
        keys, values = self.k[layer_idx], self.v[layer_idx]
        if self._start is None:                                 # static: fixed addresses and shapes
            keys.index_copy_(2, self._positions, k)
            values.index_copy_(2, self._positions, v)
            return keys, values                                 # (B, n_kv_heads, max_seq_len, head_dim)
        end = self._start + self._n_new
        keys[:, :, self._start:end] = k
        values[:, :, self._start:end] = v
        return keys[:, :, :end], values[:, :, :end]             # (B, n_kv_heads, end, head_dim)

    def slots(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a kernel that writes K/V and attends in one call (chapter 08's native decode layer): this
        layer's K and V buffers (B, n_kv_heads, max_seq_len, head_dim) and the positions (T,) the forward
        in flight writes; the token at positions[t] is written to that slot and sees slots 0..positions[t].
        None outside a forward. Optional in the protocol: a cache without it is written through `attend`."""
        if self._positions is None:
            return None
        return self.k[layer_idx], self.v[layer_idx], self._positions

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend: Callable) -> torch.Tensor:
        """Writes this layer's new k, v and returns backend attention of q over the cached prefix (B, H, T, D)."""
        keys, values = self.update(layer_idx, k, v)
        if self._start is None:                                 # static: hide the positions not yet written
            slots = torch.arange(self.max_seq_len, device=q.device)
            visible = slots[None, :] <= self._positions[:, None]                 # (T, max_seq_len)
            return backend(q, keys, values, causal=False, mask=visible[None, None])
        return backend(q, keys, values, causal=True)

    def end(self) -> None:
        """The positions written by this forward become part of the cache."""
        if self._start is not None:
            self._length = self._start + self._n_new
        self._start, self._n_new, self._positions = None, 0, None

    def truncate(self, length: int) -> None:
        """Forgets every position from `length` on (speculative decoding rolls back this way). Chapter 09."""
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= self._length:
            raise ValueError(f"truncate takes a length in 0..{self._length} (the positions held), got {length!r}")
        self._length = length

    def reset(self) -> None:
        """Forget every position (the buffers stay allocated): what a new request starts from."""
        self._length = 0

    def __repr__(self) -> str:
        b, h, s, d = self.k[0].shape
        return (f"KVCache(layers={self.n_layers}, batch={b}, n_kv_heads={h}, max_seq_len={s}, head_dim={d}, "
                f"dtype={self.k[0].dtype}, length={self.length}, {self.nbytes / 2**20:.2f} MiB)")
