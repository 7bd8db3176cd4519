"""Activation-aware scaling: AWQ's salient channels and SmoothQuant's migration, on one layer. Chapter 08.

A layer computes y = x · Wᵀ. Multiplying input channel j of W by s_j and dividing x_j by s_j changes nothing
in exact arithmetic, but it changes what rounding does:

* AWQ (weight-only): the channels where |x| is largest carry most of the output. Scaling those columns of W
  up before quantizing gives them finer steps relative to their size (the block's scale barely moves), and
  dividing x by s afterwards shrinks their rounding error by about s.
* SmoothQuant (weights and activations in int8): activations have outlier channels that ruin a per-tensor
  int8 scale; s_j = max|x_j|^α / max|W_j|^(1-α) moves that range from x into W, where per-channel scales
  absorb it.
"""
from __future__ import annotations

import torch

from .weights import dequantize, quantize_tensor

__all__ = ["collect_inputs", "salient_channels", "weight_only_error", "awq_search", "smoothquant_error"]


@torch.inference_mode()
def collect_inputs(model, module_name: str, batches: list[torch.Tensor]) -> torch.Tensor:
    """The inputs (N, in_features) that module `module_name` sees on the batches of token ids. Chapter 08."""
    module = model.get_submodule(module_name)
    seen: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda mod, args, out: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    try:
        for ids in batches:
            model(ids)
    finally:
        handle.remove()
    return torch.cat(seen).float()


def salient_channels(inputs: torch.Tensor, fraction: float = 0.01) -> torch.Tensor:
    """Indices of the input channels with the largest mean |x|: the top `fraction`, at least one."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must lie in (0, 1]")
    count = max(1, round(fraction * inputs.shape[1]))
    return inputs.abs().mean(0).topk(count).indices


def weight_only_error(inputs: torch.Tensor, weight: torch.Tensor, bits: int, group_size: int | None,
                      input_scale: torch.Tensor | None = None) -> float:
    """Relative error ‖x·Wᵀ − (x/s)·Q(W·s)ᵀ‖ / ‖x·Wᵀ‖ of a weight-only quantized layer. Chapter 08."""
    w = weight.detach().float()
    s = torch.ones(w.shape[1], device=w.device) if input_scale is None else input_scale.float().to(w.device)
    granularity = "channel" if group_size is None else "group"
    q = dequantize(quantize_tensor(w * s, bits, granularity, group_size))
    exact = inputs @ w.T
    return float((exact - (inputs / s) @ q.T).norm() / exact.norm())


def awq_search(inputs: torch.Tensor, weight: torch.Tensor, bits: int, group_size: int | None,
               grid: int = 11) -> list[tuple[float, float]]:
    """(α, error) for AWQ's per-channel scales s = mean|x|^α, α on a grid from 0 (no scaling) to 1."""
    mean_abs = inputs.abs().mean(0).clamp(min=1e-6)
    rows = []
    for i in range(grid):
        alpha = i / (grid - 1)
        s = mean_abs.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()                  # centre the scales around 1
        rows.append((alpha, weight_only_error(inputs, weight, bits, group_size, s)))
    return rows


def _int8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax().clamp(min=1e-12) / 127
    return torch.round(x / scale).clamp(-127, 127) * scale


def smoothquant_error(inputs: torch.Tensor, weight: torch.Tensor, alpha: float | None) -> float:
    """Relative output error of int8 activations (one scale per tensor) times int8 weights (one per channel),
    after SmoothQuant's migration with strength alpha (None: no migration). Chapter 08."""
    w = weight.detach().float()
    if alpha is None:
        s = torch.ones(w.shape[1], device=w.device)
    else:
        s = (inputs.abs().amax(0).clamp(min=1e-6).pow(alpha) / w.abs().amax(0).clamp(min=1e-6).pow(1 - alpha))
    q_w = dequantize(quantize_tensor(w * s, 8, "channel"))
    q_x = _int8_per_tensor(inputs / s)
    exact = inputs @ w.T
    return float((exact - q_x @ q_w.T).norm() / exact.norm())
