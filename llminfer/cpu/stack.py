"""The native-call contract: a layer stack prepared once, then one op a step over contiguous or paged K/V. Chapter 08.

A stack's weights cross into C++ once, as named fields: a `LayerWeights` a layer, its products `NativeWeight`s with
their activations' format said outright. `layer_arguments` lays them out for the op `prepare_stack` in the one order
LAYER_TENSORS names (cpu_layers.cpp names it back through `torch.ops.llminfer.layer_fields()`), with the caches of an
explicit `CacheKind`. A `PreparedStack` then runs a step with a few tensors. A weight changed after preparing is not
picked up: the owner prepares again, and a step over tensors that have moved is refused.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

import torch

from . import _require

__all__ = ["Activations", "CacheKind", "NativeWeight", "LayerWeights", "PRODUCTS", "LAYER_TENSORS", "layer_arguments",
           "NativeKV", "PreparedStack"]


class Activations(IntEnum):
    """The format x takes into a product: float, or int8 per block of 32 inputs (int4 weights only: W4A8)."""

    FLOAT = 0
    INT8 = 1


class CacheKind(IntEnum):
    """A stack's K/V: contiguous (B, H_kv, slots, D) buffers, or a paged pool (num_blocks, block_size, H_kv, D) read
    through block tables, one a layer. Chapters 06 and 08."""

    CONTIGUOUS = 0
    PAGED = 1


@dataclass(frozen=True)
class NativeWeight:
    """One product's weight: float32 or bfloat16 (N, K); int8 codes (N, K) with a scale (N,) or (N, K/group); int4
    nibbles (uint8, (N, K/2) or `cpu.tile_int4`'s tiles) with a scale and an offset."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    activations: Activations = Activations.FLOAT


@dataclass(frozen=True)
class LayerWeights:
    """A decoder layer's weights by name, as a native stack holds them. Chapter 08."""

    input_norm: torch.Tensor            # (dim,) in the activations' dtype
    input_eps: float
    qkv: NativeWeight                   # ((H + 2·H_kv)·D, dim)
    qkv_bias: torch.Tensor | None       # ((H + 2·H_kv)·D,) or None
    o: NativeWeight                     # (dim, H·D)
    post_norm: torch.Tensor             # (dim,)
    post_eps: float
    gate_up: NativeWeight               # (2·hidden, dim)
    down: NativeWeight                  # (dim, hidden)

    def products(self) -> tuple[NativeWeight, NativeWeight, NativeWeight, NativeWeight]:
        """Returns the four products in PRODUCTS' order."""
        return self.qkv, self.o, self.gate_up, self.down


PRODUCTS = ("qkv", "o", "gate_up", "down")
# The one order of a layer's tensors in `prepare_stack` (cpu_layers.cpp's kLayerFields), None where absent
LAYER_TENSORS = ("input_norm", "post_norm", "qkv_bias",
                 *(f"{product}.{part}" for product in PRODUCTS for part in ("weight", "scale", "offset")))


def layer_arguments(layers: Sequence[LayerWeights]) -> tuple[list[torch.Tensor | None], list[float], list[int]]:
    """Returns the layers as `prepare_stack` takes them: their tensors in LAYER_TENSORS' order layer after layer,
    their epsilons (input, post) and their products' activation formats."""
    tensors: list[torch.Tensor | None] = []
    eps, activations = [], []
    for layer in layers:
        tensors += [layer.input_norm, layer.post_norm, layer.qkv_bias]
        for product in layer.products():
            tensors += [product.weight, product.scale, product.offset]
            activations.append(int(product.activations))
        eps += [float(layer.input_eps), float(layer.post_eps)]
    return tensors, eps, activations


class NativeKV(ABC):
    """A cache that hands a native stack its K/V storage and the forward in flight's positions (the engine's paged
    cache, chapter 06; the contiguous KVCache is read by its type)."""

    @abstractmethod
    def native_storage(self) -> tuple[CacheKind, list[torch.Tensor], list[torch.Tensor]]:
        """Returns the cache's kind and its K and V storage, one tensor a layer."""

    @abstractmethod
    def native_step(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """Returns the forward in flight's positions (N,), and for a pool each token's sequence (N,) and the block
        tables (S, W); None outside a forward."""


class PreparedStack:
    """Layers and their caches (`keys`, `values`, one a layer, of `kind`) kept by the kernels under a number, released
    when this object goes; `step` runs one step through them. Chapter 08."""

    def __init__(self, layers: Sequence[LayerWeights], n_heads: int, head_dim: int, kind: CacheKind,
                 keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
        if len(layers) != len(keys) or len(keys) != len(values):
            raise ValueError(f"{len(layers)} layers need as many K and V caches, got {len(keys)} and {len(values)}; "
                             "pass one K and one V cache a layer")
        _require()
        self.kind, self.keys, self.values = CacheKind(kind), tuple(keys), tuple(values)
        tensors, eps, activations = layer_arguments(layers)
        self.id = int(torch.ops.llminfer.prepare_stack(tensors, eps, activations, n_heads, head_dim ** -0.5,
                                                       int(self.kind), list(self.keys), list(self.values)))
        self._release = torch.ops.llminfer.release_stack

    def holds(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> bool:
        """Whether these are the caches the stack was prepared with (the same tensors)."""
        return (len(keys) == len(self.keys) and all(a is b for a, b in zip(keys, self.keys))
                and all(a is b for a, b in zip(values, self.values)))

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
             token_seq: torch.Tensor | None = None, block_tables: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim) through every layer at positions (T,), writing K/V into the caches; over a pool, x (1, N, dim)
        with each token's sequence token_seq (N,) and the block tables (S, W). Returns x's new value."""
        return torch.ops.llminfer.run_stack(self.id, x, cos, sin, positions, token_seq, block_tables)

    def __del__(self):
        try:
            self._release(self.id)
        except (RuntimeError, AttributeError, TypeError):   # interpreter shutdown: the table goes with the process
            pass
