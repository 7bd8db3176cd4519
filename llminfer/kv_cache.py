"""The KV cache: the protocol every cache speaks, and the contiguous `KVCache` that owns its length. Chapter 04.

A forward with a cache goes through three calls, made by `Transformer.forward`:

    positions = cache.begin(n_tokens, positions)   # where the new tokens go; checks, before any compute
    out = cache.attend(layer, q, k, v, backend)    # per layer: write k, v at those positions, attend over the prefix
    cache.end()                                    # the new positions now count: length advances

`KVCache` keeps one (B, n_kv_heads, max_seq_len, head_dim) buffer for K and one for V per layer and
writes in place, so a decode step copies one position per layer instead of the whole prefix. The paged
cache of chapter 06, the int8 cache of chapter 08 and the prefill worker's cache of chapter 12 implement the
same protocol; the bookkeeping they share (the length, what `begin`, `end`, `truncate` and `reset` check and
record) lives once, in `CacheBase`. `KVCache.slots(layer)` is optional in the protocol: it hands a kernel
that writes and attends in one call (chapter 08) the buffers and positions. The static mode that CUDA graphs
replay is `llminfer.static_cache.StaticKVCache`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Protocol, runtime_checkable

import torch

from . import costs
from .config import ModelConfig
from .device import check_fits, dtype_bytes

__all__ = ["Cache", "CacheBase", "KVCache", "cache_shape"]


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

    def truncate(self, length: int) -> None: ...     # forget positions length.. (speculative decoding, chapter 09)

    def reset(self) -> None: ...


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def cache_shape(model) -> costs.KVShape:
    """Returns the K/V shape a model's own layers write per position: layers, K/V heads, head_dim. Chapter 04.

    Read from the modules, so a tensor-parallel rank (its K/V heads) or a pipeline stage (its layers) gets
    the shape of the part it holds (chapter 10)."""
    return costs.KVShape(len(model.layers), model.layers[0].self_attn.n_kv_heads, model.config.head_dim)


class CacheBase(ABC):
    """The length a cache owns and the bookkeeping of one forward: begin, end, truncate, reset. Chapter 04.

    A subclass stores the K/V: it gives `capacity` and `device`, writes in `attend`, and may extend
    `check_write` (refuse a write before any compute), `_reserve` (make room for the positions begun) and
    `_forget` (drop the positions from a length on). Positions 0 .. length-1 hold valid K/V, the same for every
    sequence of the batch; a forward writes one run of positions from `length` on.
    """

    kind = "cache"                       # how messages name it

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self._length = 0                 # positions 0 .. length-1 hold valid K/V
        self._start: int | None = None   # where the forward in flight writes (None: no forward in flight)
        self._n_new = 0

    @staticmethod
    def max_seq_len_for(model, max_seq_len: int | None) -> int:
        """Returns the positions a cache for `model` holds: max_seq_len, by default the model's; refused if
        it is not a positive integer or exceeds the model's."""
        limit = model.config.max_seq_len
        max_seq_len = limit if max_seq_len is None else max_seq_len
        if not _is_positive_int(max_seq_len):
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        if max_seq_len > limit:
            raise ValueError(f"a cache of {max_seq_len} positions is longer than the model's max_seq_len={limit}; "
                             f"pass max_seq_len <= {limit}")
        return max_seq_len

    @property
    def length(self) -> int:
        """Positions 0 .. length-1 hold valid K/V; the next token goes at position `length`."""
        return self._length

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Positions each sequence can hold: every cache says, from its own storage."""

    def check_write(self, start: int, n_tokens: int, batch_size: int) -> None:
        """Raise ValueError, before any compute, if writing n_tokens at `start` would not fit or leave a gap."""
        if batch_size != self.batch_size:
            raise ValueError(f"the cache holds batch_size={self.batch_size} sequences but the input has "
                             f"{batch_size}; make a cache for this batch (e.g. model.new_cache(batch_size=...))")
        if start != self._length:
            raise ValueError(f"the new tokens would start at position {start} but the cache holds "
                             f"{self._length} positions; positions continue from the cache's length (pass "
                             f"positions=None), or call cache.truncate({start}) first to overwrite from there")
        if start + n_tokens > self.capacity:
            raise ValueError(
                f"writing {n_tokens} token(s) after the {start} cached positions needs {start + n_tokens} positions "
                f"but the cache holds max_seq_len={self.capacity}; make a larger cache "
                f"(e.g. model.new_cache(max_seq_len={start + n_tokens})) or shorten the sequence")

    def _first_position(self, positions: torch.Tensor, n_tokens: int) -> int:
        """The first of an explicit (T,) or (B, T) positions tensor, checked to be one run shared by the batch."""
        rows = positions.reshape(-1, positions.shape[-1]).tolist() if positions.dim() in (1, 2) else None
        if rows is None or any(row != rows[0] for row in rows):
            raise ValueError(f"a {self.kind} shares positions across the batch: pass a (T,) tensor, got shape "
                             f"{tuple(positions.shape)}")
        values = rows[0]
        start = values[0]
        if values != list(range(start, start + n_tokens)):
            raise ValueError(f"positions {values[:8]}{'…' if len(values) > 8 else ''} are not consecutive; a "
                             f"{self.kind} writes one run of positions per forward")
        return start

    def begin(self, n_tokens: int, batch_size: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Checks and records a forward of n_tokens new positions; returns their positions (T,). Chapter 04.

        positions=None continues from `length` with no host sync. An explicit positions tensor must
        continue from `length` too (checked here, one host read).
        """
        start = self._length if positions is None else self._first_position(positions, n_tokens)
        self.check_write(start, n_tokens, batch_size)
        self._reserve(start, n_tokens, batch_size)
        self._start, self._n_new = start, n_tokens
        return torch.arange(start, start + n_tokens, device=self.device)

    def _reserve(self, start: int, n_tokens: int, batch_size: int) -> None:
        """Makes room for positions start .. start + n_tokens - 1 (nothing to do for preallocated buffers)."""

    def end(self) -> None:
        """The positions written by this forward become part of the cache."""
        if self._start is not None:
            self._length = self._start + self._n_new
        self._start, self._n_new = None, 0

    def truncate(self, length: int) -> None:
        """Forgets every position from `length` on (speculative decoding rolls back this way). Chapter 09."""
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= self._length:
            raise ValueError(f"truncate takes a length in 0..{self._length} (the positions held), got {length!r}")
        self._forget(length)
        self._length = length

    def _forget(self, length: int) -> None:
        """Drops what the storage keeps for positions length.. (nothing to do when it is simply overwritten)."""

    def reset(self) -> None:
        """Forget every position (the buffers stay allocated): what a new request starts from."""
        self.truncate(0)
        self._start, self._n_new = None, 0


class KVCache(CacheBase):
    """Preallocated K/V storage, one (B, n_kv_heads, max_seq_len, head_dim) buffer each per layer. Chapter 04."""

    kind = "KVCache"

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        for name, value in (("n_layers", n_layers), ("batch_size", batch_size), ("n_kv_heads", n_kv_heads),
                            ("max_seq_len", max_seq_len), ("head_dim", head_dim)):
            if not _is_positive_int(value):
                raise ValueError(f"{self.kind} {name} must be a positive integer, got {value!r}")
        super().__init__(batch_size)
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        needed = costs.kv_cache_bytes(costs.KVShape(n_layers, n_kv_heads, head_dim), max_seq_len, dtype_bytes(dtype),
                                      batch_size)
        check_fits(needed, device, f"a KV cache of {n_layers} layers × batch {batch_size} × {max_seq_len} positions "
                   f"× {n_kv_heads} K/V heads × head_dim {head_dim} in {str(dtype).replace('torch.', '')}",
                   fix="pass a smaller max_seq_len or batch_size")
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.max_seq_len = max_seq_len
        self._positions: torch.Tensor | None = None     # the positions the forward in flight writes

    @classmethod
    def for_config(cls, config: ModelConfig, batch_size: int = 1, max_seq_len: int | None = None,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> "KVCache":
        """A cache sized for `config` (max_seq_len defaults to the model's)."""
        max_seq_len = config.max_seq_len if max_seq_len is None else max_seq_len
        if not _is_positive_int(max_seq_len):
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        if max_seq_len > config.max_seq_len:
            raise ValueError(
                f"a cache of {max_seq_len} positions is longer than the model's max_seq_len={config.max_seq_len}; "
                f"pass max_seq_len <= {config.max_seq_len}"
            )
        return cls(config.n_layers, batch_size, config.n_kv_heads, max_seq_len, config.head_dim, device, dtype)

    @classmethod
    def for_model(cls, model, batch_size: int = 1, max_seq_len: int | None = None) -> "KVCache":
        """A cache for the layers and K/V heads `model` holds (`cache_shape`), on its device and dtype. Chapter 04."""
        max_seq_len = cls.max_seq_len_for(model, max_seq_len)
        shape = cache_shape(model)
        return cls(shape.n_layers, batch_size, shape.n_kv_heads, max_seq_len, shape.head_dim, model.device,
                   model.dtype)

    # --- what it holds -----------------------------------------------------------------------------

    @property
    def length(self) -> int:
        """Positions 0 .. length-1 hold valid K/V; the next token goes at position `length`."""
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        """Shorter: `truncate`. Longer: the buffers' positions up to `value` count as written (a static step
        wrote them, chapter 04; or a timing that does not care what they hold, chapters 04 and 09)."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= self.max_seq_len:
            raise ValueError(f"a cache length must be an integer in 0..{self.max_seq_len}, got {value!r}")
        self.truncate(value) if value <= self._length else setattr(self, "_length", value)

    @property
    def capacity(self) -> int:
        """Positions each sequence can hold."""
        return self.max_seq_len

    @property
    def device(self) -> torch.device:
        return self.k[0].device

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

    def begin(self, n_tokens: int, batch_size: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        self._positions = super().begin(n_tokens, batch_size, positions)
        return self._positions

    begin.__doc__ = CacheBase.begin.__doc__

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, v (B, n_kv_heads, T, head_dim) at the positions begun; returns the K, V to attend over."""
        keys, values = self.k[layer_idx], self.v[layer_idx]
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
        return backend(q, keys, values, causal=True)

    def end(self) -> None:
        super().end()
        self._positions = None

    end.__doc__ = CacheBase.end.__doc__

    def __repr__(self) -> str:
        b, h, s, d = self.k[0].shape
        return (f"KVCache(layers={self.n_layers}, batch={b}, n_kv_heads={h}, max_seq_len={s}, head_dim={d}, "
                f"dtype={self.k[0].dtype}, length={self.length}, {self.nbytes / 2**20:.2f} MiB)")
