"""Counting what a model computes: K/V rows per layer per forward call. Chapter 03."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .model import Transformer

__all__ = ["KVCounts", "count_kv"]


@dataclass
class KVCounts:
    """Token positions whose K and V were computed, per forward call and per layer. Chapter 03."""

    per_layer: list[list[int]] = field(default_factory=list)   # [forward call][layer] -> positions

    @property
    def per_forward(self) -> list[int]:
        """Positions computed in each forward call (every layer computes the same number)."""
        return [row[0] if row else 0 for row in self.per_layer]

    @property
    def cumulative(self) -> list[int]:
        """Running total of positions computed after each forward call."""
        totals, running = [], 0
        for n in self.per_forward:
            running += n
            totals.append(running)
        return totals

    @property
    def total(self) -> int:
        """Positions computed over all calls (per layer)."""
        return sum(self.per_forward)

    @property
    def total_all_layers(self) -> int:
        return sum(sum(row) for row in self.per_layer)


@contextmanager
def count_kv(model: Transformer) -> Iterator[KVCounts]:
    """Within the block, record how many positions each layer's k_proj and v_proj projected. Chapter 03."""
    counts = KVCounts()
    n_layers = len(model.layers)

    def counter(layer_idx: int, which: str):
        def hook(module, args, output: torch.Tensor):
            rows = output.shape[0] * output.shape[1]  # batch × positions
            if which == "k":
                if layer_idx == 0:                        # layer 0 runs first: a new forward call begins
                    counts.per_layer.append([0] * n_layers)
                counts.per_layer[-1][layer_idx] += rows
            elif counts.per_layer[-1][layer_idx] != rows:  # pragma: no cover - K and V always travel together
                raise RuntimeError(f"layer {layer_idx} projected {rows} V rows but a different number of K rows")
        return hook

    handles = []
    for i, layer in enumerate(model.layers):
        handles.append(layer.self_attn.k_proj.register_forward_hook(counter(i, "k")))
        handles.append(layer.self_attn.v_proj.register_forward_hook(counter(i, "v")))
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()
