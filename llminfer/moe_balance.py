"""How a router spreads a batch over its experts: counts, distinct experts, capacity and dropping, and the
auxiliary balance loss. Chapter 14.

    tokens_per_expert(ids, n_experts)               how many token-expert assignments each expert got
    distinct_experts(ids)                           how many experts a batch touched (the experts a step reads)
    mean_distinct_experts(ids, batch_size)          the same, averaged over consecutive batches of batch_size tokens
    expert_capacity(n_tokens, n_experts, top_k, C)  ceil(C · T · k / E): the slots each expert has
    apply_capacity(weights, ids, n_experts, C)      which assignments overflow their expert and are dropped
    balance_loss(router_logits, top_k)              Switch Transformer's E · Σ f_i · P_i (1 at perfect balance)
    record_routing(model, *inputs)                  the (weights, ids) every MoE layer chose in one forward

Every function takes the router's choices as `llminfer.moe.route` returns them: ids (T, k) of the chosen experts
and weights (T, k) of their gates, one row per token, in the order the tokens arrived. Nothing here trains.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llminfer.moe import MoEFeedForward, route

__all__ = ["record_routing", "tokens_per_expert", "distinct_experts", "mean_distinct_experts", "expert_capacity", "CapacityResult",
           "apply_capacity", "BalanceLoss", "balance_loss"]


def _check_ids(ids: torch.Tensor, n_experts: int | None = None) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point:
        raise ValueError(f"ids must be an integer tensor of shape (tokens, top_k), got "
                         f"{getattr(ids, 'shape', type(ids).__name__)} {getattr(ids, 'dtype', '')}")
    if n_experts is not None:
        if not isinstance(n_experts, int) or isinstance(n_experts, bool) or n_experts < 1:
            raise ValueError(f"n_experts must be an integer >= 1, got {n_experts!r}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_experts):
            raise ValueError(f"expert id {int(ids.min()) if int(ids.min()) < 0 else int(ids.max())} is outside "
                             f"0..{n_experts - 1} (n_experts={n_experts})")
    return ids


def tokens_per_expert(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(n_experts,) int64: how many of the T · k token-expert assignments in ids went to each expert. Chapter 14.

    Perfect balance is T · k / E each; a collapsed router sends most of them to a few experts."""
    ids = _check_ids(ids, n_experts)
    return torch.bincount(ids.reshape(-1), minlength=n_experts)


def distinct_experts(ids: torch.Tensor) -> int:
    """The number of different experts the tokens of ids chose: the routed experts a decode step of this batch
    reads from memory. Chapter 14."""
    return int(torch.unique(_check_ids(ids)).numel())


def mean_distinct_experts(ids: torch.Tensor, batch_size: int) -> float:
    """The distinct experts touched by batch_size tokens, averaged over the consecutive batches of batch_size
    rows of ids (a leftover shorter batch is left out). Chapter 14.

    This is the measured counterpart of `llminfer.costs.expected_distinct_experts`, which assumes uniform random
    routing: feed it the ids a real router chose for T ≥ batch_size tokens of one layer.
    """
    ids = _check_ids(ids)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or not 1 <= batch_size <= len(ids):
        raise ValueError(f"batch_size must be an integer in 1..{len(ids)} (the tokens in ids), got {batch_size!r}")
    batches = ids[: len(ids) // batch_size * batch_size].reshape(-1, batch_size * ids.shape[1])
    touched = torch.zeros(len(batches), int(ids.max()) + 1, dtype=torch.bool)
    touched.scatter_(1, batches, True)                              # (batches, experts): which were chosen
    return touched.sum(1).double().mean().item()


def expert_capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """ceil(capacity_factor · T · k / E): the assignments each expert accepts in a batch of T tokens. Chapter 14.

    T · k / E is each expert's share under perfect balance; the capacity factor C is the slack (Switch
    Transformer trained with 1.0–1.25). Fixed slots give every expert the same shape of work, which is what a
    static graph or an all-to-all buffer needs; the price is that a popular expert's overflow is dropped.
    """
    for name, value, least in (("n_tokens", n_tokens, 0), ("n_experts", n_experts, 1), ("top_k", top_k, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} is more than n_experts={n_experts}")
    if not isinstance(capacity_factor, (int, float)) or isinstance(capacity_factor, bool) or not (
            math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"capacity_factor must be a finite number > 0 (1.0: exactly the balanced share), "
                         f"got {capacity_factor!r}")
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


@dataclass(frozen=True)
class CapacityResult:
    """Which token-expert assignments fit their expert's capacity. Chapter 14."""

    capacity: int                   # slots per expert
    kept: torch.Tensor              # (T, k) bool: False where the assignment was dropped
    tokens_per_expert: torch.Tensor  # (E,) assignments each expert was offered
    kept_per_expert: torch.Tensor   # (E,) assignments it took: min(offered, capacity)
    lost_weight_fraction: float     # the gate weight of the dropped assignments over all gate weight

    @property
    def dropped_fraction(self) -> float:
        """The fraction of the T · k assignments that were dropped."""
        return 1.0 - self.kept.float().mean().item() if self.kept.numel() else 0.0

    @property
    def tokens_fully_dropped(self) -> int:
        """Tokens none of whose experts took them: their MoE output is zero, only the residual carries them."""
        return int((~self.kept).all(dim=1).sum())


def apply_capacity(weights: torch.Tensor, ids: torch.Tensor, n_experts: int, capacity_factor: float) -> CapacityResult:
    """Drops the assignments that overflow their expert's capacity, in order of arrival. Chapter 14.

    Assignments queue at their expert in the order the tokens arrived (row 0 first) and, within a token, in the
    order of its choices (its first choice first); an expert takes the first `capacity` in its queue and drops
    the rest. A dropped assignment contributes nothing: the token's output loses that expert's weighted share
    (the weights are not renormalised), which lost_weight_fraction measures over the batch. Multiply the weights
    by `kept` to run the experts with the drops.
    """
    ids = _check_ids(ids, n_experts)
    if not isinstance(weights, torch.Tensor) or weights.shape != ids.shape:
        raise ValueError(f"weights must be a tensor of the shape of ids {tuple(ids.shape)}, got "
                         f"{getattr(weights, 'shape', type(weights).__name__)}")
    capacity = expert_capacity(ids.shape[0], n_experts, ids.shape[1], capacity_factor)
    flat = ids.reshape(-1)                                            # token-major: the order of arrival
    one_hot = torch.nn.functional.one_hot(flat, n_experts)            # (T·k, E)
    position = (one_hot.cumsum(0) * one_hot).sum(1) - 1               # place in its expert's queue, from 0
    kept = (position < capacity).reshape(ids.shape)
    offered = torch.bincount(flat, minlength=n_experts)
    total = weights.float().sum().item()
    lost = weights.float()[~kept].sum().item() / total if total else 0.0
    return CapacityResult(capacity, kept, offered, offered.clamp(max=capacity), lost)


@dataclass(frozen=True)
class BalanceLoss:
    """Switch Transformer's auxiliary loss and its two factors. Chapter 14."""

    loss: float
    token_fraction: torch.Tensor    # f_i: the fraction of assignments routed to expert i (sums to 1)
    mean_probability: torch.Tensor  # P_i: the router's softmax probability of expert i, averaged over tokens


def balance_loss(router_logits: torch.Tensor, top_k: int = 1) -> BalanceLoss:
    """E · Σ_i f_i · P_i on a batch's router logits (T, E), the auxiliary loss of Switch Transformer (top_k=1)
    and of Mixtral's and Qwen-MoE's training (f over the top_k choices). Chapter 14.

    f_i counts where the tokens went (not differentiable); P_i is how much probability the router gave expert i
    (differentiable). At perfect balance f_i = P_i = 1/E and the loss is E · E · (1/E²) = 1; a router that sends
    everything, with certainty, to one expert scores E. Added to the training loss with a small coefficient, its
    gradient through P pushes probability away from the experts that get too many tokens, which is the reason
    trained routers come out roughly balanced. It is computed here only to show that; nothing is trained. (1 is
    not a strict lower bound for every batch: f and P can disagree, e.g. a few confident tokens and many
    hesitant ones, and score below 1.)
    """
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2 or router_logits.shape[0] < 1:
        raise ValueError(f"router_logits must be a (tokens, n_experts) tensor with at least one token, got "
                         f"{getattr(router_logits, 'shape', type(router_logits).__name__)}")
    n_tokens, n_experts = router_logits.shape
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be an integer in 1..{n_experts} (the experts), got {top_k!r}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    ids = probs.topk(top_k, dim=-1).indices
    fraction = tokens_per_expert(ids, n_experts).float() / (n_tokens * top_k)
    mean_probability = probs.mean(0)
    return BalanceLoss(float(n_experts * (fraction * mean_probability).sum()), fraction, mean_probability)


@torch.inference_mode()
def record_routing(model: torch.nn.Module, *inputs, **kwargs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs model(*inputs, **kwargs) once and returns what each of its MoE layers chose, in layer order: a
    (weights (T, k), ids (T, k)) pair per layer, one row per token the layer saw (a batch's rows flattened).
    Chapter 14.

    The router's logits are caught on their way out of its linear map and routed again by `llminfer.moe.route`
    with the layer's own settings, so the choices are exactly those the layer used. `model` may be a decoder
    or a single MoEFeedForward."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoEFeedForward layer whose routing could be recorded; "
                         "pass a mixture-of-experts model")
    choices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def catch(index: int, layer: MoEFeedForward):
        def hook(_router, _args, logits):
            choices[index] = route(logits.reshape(-1, logits.shape[-1]), layer.top_k,
                                   softmax_before_topk=layer.softmax_before_topk, normalize=layer.normalize)
        return hook

    handles = [layer.router.register_forward_hook(catch(i, layer)) for i, layer in enumerate(layers)]
    try:
        model(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return [choices[i] for i in range(len(layers))]
