"""An int8 KV cache: keys quantized per channel, values per token (KIVI's observation). Chapter 08.

Keys have a few channels that are large for every token (outlier channels), so one scale per token is set
by those channels and crushes the rest; one scale per channel, shared by a block of tokens, fits each
channel's own range. Values have no such channels, and each output mixes the values of one token at a time
through the attention weights, so one scale per token suits them.

`Int8KVCache` stores both as int8 codes with their scales. A key channel's scale needs a block of tokens,
so the keys of the block still being filled stay in full precision (the residual) until the block is
complete, then are quantized together. It speaks the cache protocol (`begin`, `attend`, `end`), so the
model's forward uses it unchanged; `attend` dequantizes the prefix and calls the attention backend.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import costs
from ..device import check_fits, dtype_bytes
from ..kv_cache import CacheBase, cache_shape

__all__ = ["Int8KVCache", "int8_roundtrip"]


def int8_roundtrip(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x quantized to int8 with one absmax scale per slice along `dim` and dequantized again. Chapter 08.

    dim is the axis the scale is shared over: for K/V shaped (B, H, T, D), dim=-1 gives one scale per token
    (per head), dim=-2 one scale per channel (over the tokens given).
    """
    scale = (x.float().abs().amax(dim=dim, keepdim=True) / 127).clamp(min=1e-12)
    return (torch.round(x.float() / scale).clamp(-127, 127) * scale).to(x.dtype)


class Int8KVCache(CacheBase):
    """int8 K (per-channel scales per block of tokens) and V (per-token scales); the cache protocol. Chapter 08."""

    kind = "Int8KVCache"

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, block_size: int = 32):
        for name, value in (("n_layers", n_layers), ("batch_size", batch_size), ("n_kv_heads", n_kv_heads),
                            ("max_seq_len", max_seq_len), ("head_dim", head_dim), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Int8KVCache {name} must be a positive integer, got {value!r}")
        super().__init__(batch_size)
        n_blocks = -(-max_seq_len // block_size)
        shape = (batch_size, n_kv_heads, n_blocks * block_size, head_dim)
        element, kv_shape = dtype_bytes(dtype), costs.KVShape(n_layers, n_kv_heads, head_dim)
        residual = costs.kv_cache_bytes(kv_shape, block_size, element, batch_size) // 2      # K only
        needed = round(costs.kv_cache_bytes(kv_shape, n_blocks * block_size, 1, batch_size, scale_bytes=element,
                                            scale_block=block_size)) + residual    # codes, scales, residual
        check_fits(needed, device, f"an int8 KV cache of {n_layers} layers × batch {batch_size} × {max_seq_len} "
                   f"positions × {n_kv_heads} K/V heads × head_dim {head_dim}",
                   fix="pass a smaller max_seq_len or batch_size")
        self.k_codes = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(n_layers)]
        self.k_scales = [torch.zeros(batch_size, n_kv_heads, n_blocks, 1, head_dim, dtype=dtype, device=device)
                         for _ in range(n_layers)]                       # one scale per channel per block
        self.k_residual = [torch.zeros(batch_size, n_kv_heads, block_size, head_dim, dtype=dtype, device=device)
                           for _ in range(n_layers)]                     # the block being filled, unquantized
        self.v_codes = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(n_layers)]
        self.v_scales = [torch.zeros(batch_size, n_kv_heads, n_blocks * block_size, 1, dtype=dtype, device=device)
                         for _ in range(n_layers)]                       # one scale per token per head
        self.max_seq_len, self.block_size = max_seq_len, block_size
        self.dtype = dtype

    @classmethod
    def for_model(cls, model, batch_size: int = 1, max_seq_len: int | None = None,
                  block_size: int = 32) -> "Int8KVCache":
        """A cache for the layers and K/V heads `model` holds, on its device, with scales in its dtype. Chapter 08."""
        max_seq_len = cls.max_seq_len_for(model, max_seq_len)
        shape = cache_shape(model)
        return cls(shape.n_layers, batch_size, shape.n_kv_heads, max_seq_len, shape.head_dim, model.device,
                   model.dtype, block_size)

    # --- what it holds -------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.max_seq_len

    @property
    def device(self) -> torch.device:
        return self.k_codes[0].device

    @property
    def n_layers(self) -> int:
        return len(self.k_codes)

    @property
    def nbytes(self) -> int:
        """Bytes allocated: codes, scales and the residual block."""
        tensors = self.k_codes + self.k_scales + self.k_residual + self.v_codes + self.v_scales
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def _keys(self, layer_idx: int, end: int) -> torch.Tensor:
        """Dequantized keys of positions 0 .. end-1 (B, H_kv, end, D)."""
        full = end // self.block_size
        batch, heads, _, dim = self.k_codes[layer_idx].shape
        codes = self.k_codes[layer_idx][:, :, :full * self.block_size].view(batch, heads, full, self.block_size, dim)
        quantized = (codes.to(self.dtype) * self.k_scales[layer_idx][:, :, :full]).view(batch, heads, -1, dim)
        return torch.cat((quantized, self.k_residual[layer_idx][:, :, :end - full * self.block_size]), dim=2)

    def _values(self, layer_idx: int, end: int) -> torch.Tensor:
        """Dequantized values of positions 0 .. end-1 (B, H_kv, end, D)."""
        return self.v_codes[layer_idx][:, :, :end].to(self.dtype) * self.v_scales[layer_idx][:, :, :end]

    def get(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of one layer, each (B, n_kv_heads, length, head_dim). Chapter 08."""
        if not 0 <= layer_idx < self.n_layers:
            raise ValueError(f"layer_idx={layer_idx} is outside 0..{self.n_layers - 1}")
        return self._keys(layer_idx, self._length), self._values(layer_idx, self._length)

    # --- the protocol --------------------------------------------------------------------------------

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantizes and writes k, v (B, H_kv, T, D) at the positions begun; returns the K, V to attend over."""
        start, end, block = self._start, self._start + self._n_new, self.block_size
        # values: one scale per token and head
        scale = (v.float().abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)              # (B, H_kv, T, 1)
        self.v_codes[layer_idx][:, :, start:end] = torch.round(v.float() / scale).clamp(-127, 127).to(torch.int8)
        self.v_scales[layer_idx][:, :, start:end] = scale.to(self.dtype)
        # keys: append to the residual block; each block that fills is quantized per channel
        first_block = start // block
        held = start - first_block * block                                    # keys already in the residual
        pending = torch.cat((self.k_residual[layer_idx][:, :, :held], k.to(self.dtype)), dim=2)
        n_full = pending.shape[2] // block
        if n_full:
            batch, heads, _, dim = pending.shape
            blocks = pending[:, :, :n_full * block].float().view(batch, heads, n_full, block, dim)
            scales = (blocks.abs().amax(3, keepdim=True) / 127).clamp(min=1e-12)              # (B, H, n, 1, D)
            codes = torch.round(blocks / scales).clamp(-127, 127).to(torch.int8)
            lo, hi = first_block * block, (first_block + n_full) * block
            self.k_codes[layer_idx][:, :, lo:hi] = codes.view(batch, heads, -1, dim)
            self.k_scales[layer_idx][:, :, first_block:first_block + n_full] = scales.to(self.dtype)
        rest = pending[:, :, n_full * block:]
        self.k_residual[layer_idx][:, :, :rest.shape[2]] = rest
        return self._keys(layer_idx, end), self._values(layer_idx, end)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend: Callable) -> torch.Tensor:
        """Writes this layer's k, v (quantized) and returns backend attention over the dequantized prefix."""
        keys, values = self.update(layer_idx, k, v)
        return backend(q, keys, values, causal=True)

    def _forget(self, length: int) -> None:
        """Truncating into a block already quantized reopens it: its kept keys go back to the residual, from
        their int8 codes (the full-precision keys are gone), to be quantized again when the block refills.
        Within the block still being filled, nothing changes: truncating there is exact."""
        block = self.block_size
        reopened, held = divmod(length, block)
        if not held or reopened == self._length // block:
            return                              # a block boundary, or the residual still holds these keys
        lo = reopened * block
        for layer in range(self.n_layers):
            codes = self.k_codes[layer][:, :, lo:lo + held].to(self.dtype)                  # (B, H_kv, held, D)
            self.k_residual[layer][:, :, :held] = codes * self.k_scales[layer][:, :, reopened]
    def __repr__(self) -> str:
        b, h, _, d = self.k_codes[0].shape
        return (f"Int8KVCache(layers={self.n_layers}, batch={b}, n_kv_heads={h}, max_seq_len={self.max_seq_len}, "
                f"head_dim={d}, block_size={self.block_size}, length={self.length}, {self.nbytes / 2**20:.2f} MiB)")
