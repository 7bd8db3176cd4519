"""The KV cache: preallocated K and V buffers, written in place at `start_pos`. Chapter 04."""
from __future__ import annotations

import torch

from .config import ModelConfig
from .device import dtype_bytes

__all__ = ["KVCache", "kv_cache_bytes", "dtype_bytes"]


def kv_cache_bytes(config: ModelConfig, seq_len: int, batch_size: int = 1, dtype: torch.dtype = torch.float16) -> int:
    """Bytes of K and V for every layer: 2 · layers · kv_heads · head_dim · seq_len · batch · bytes. Chapter 04."""
    if seq_len < 0 or batch_size < 1:
        raise ValueError(f"seq_len must be >= 0 and batch_size >= 1; got seq_len={seq_len}, batch_size={batch_size}")
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * seq_len * batch_size * dtype_bytes(dtype)


class KVCache:
    """Preallocated K/V storage, one (B, n_kv_heads, max_seq_len, head_dim) buffer each per layer. Chapter 04."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        for name, value in (("n_layers", n_layers), ("batch_size", batch_size), ("n_kv_heads", n_kv_heads),
                            ("max_seq_len", max_seq_len), ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCache {name} must be a positive integer, got {value!r}")
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.length = 0  # positions 0 .. length-1 hold valid K/V

    @classmethod
    def for_config(cls, config: ModelConfig, batch_size: int = 1, max_seq_len: int | None = None,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> "KVCache":
        """A cache sized for `config` (max_seq_len defaults to the model's)."""
        max_seq_len = config.max_seq_len if max_seq_len is None else max_seq_len
        if max_seq_len > config.max_seq_len:
            raise ValueError(
                f"a cache of {max_seq_len} positions is longer than the model's max_seq_len={config.max_seq_len}; "
                f"pass max_seq_len <= {config.max_seq_len}"
            )
        return cls(config.n_layers, batch_size, config.n_kv_heads, max_seq_len, config.head_dim, device, dtype)

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated for all K and V buffers."""
        return sum(t.untyped_storage().nbytes() for t in self.k + self.v)

    def check_write(self, start_pos: int, n_tokens: int, batch_size: int) -> None:
        """Raise ValueError, before any compute, if writing n_tokens at start_pos would not fit or leave a gap."""
        if batch_size != self.batch_size:
            raise ValueError(f"the cache holds batch_size={self.batch_size} sequences but the input has {batch_size}; "
                             "make a cache for this batch with model.new_cache(batch_size=...)")
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        if start_pos > self.length:
            raise ValueError(f"start_pos={start_pos} skips past the {self.length} positions the cache holds; "
                             f"positions must be written in order, so pass start_pos <= {self.length}")
        if start_pos + n_tokens > self.max_seq_len:
            raise ValueError(
                f"writing {n_tokens} token(s) at start_pos={start_pos} needs {start_pos + n_tokens} positions but the "
                f"cache holds max_seq_len={self.max_seq_len}; make a larger cache "
                f"(model.new_cache(max_seq_len={start_pos + n_tokens})) or shorten the sequence"
            )

    def update(self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv_heads, T, head_dim) at start_pos; return views of all K, V up to start_pos + T."""
        end = start_pos + k.shape[2]
        if end > self.max_seq_len:
            self.check_write(start_pos, k.shape[2], k.shape[0])
        self.k[layer][:, :, start_pos:end] = k
        self.v[layer][:, :, start_pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]  # (B, n_kv_heads, end, head_dim)

    def reset(self) -> None:
        """Forget every position (the buffers stay allocated)."""
        self.length = 0

    def __repr__(self) -> str:
        b, h, s, d = self.k[0].shape
        return (f"KVCache(layers={self.n_layers}, batch={b}, n_kv_heads={h}, max_seq_len={s}, head_dim={d}, "
                f"dtype={self.k[0].dtype}, length={self.length}, {self.nbytes / 2**20:.2f} MiB)")
