"""Mixture of experts: a router picks k of E feed-forward experts for each token. Chapter 14.

A dense layer multiplies every token by one SwiGLU feed-forward. An MoE layer holds E of them (the experts) and
a small linear map, the router, that scores each token against each expert; the token goes through the k experts
with the highest scores only, and their outputs are added with weights from those scores:

    logits  = router(x)                              (T, E)   one score per token and expert
    weights, ids = route(logits, k, ...)             (T, k)   the k chosen experts and their weights
    y[t]    = Σ_j weights[t, j] · expert_{ids[t, j]}(x[t])

So a token costs k experts' FLOPs while the model holds E experts' weights: Mixtral-8x7B holds 47B parameters
and uses 13B per token. Families differ in where the softmax goes:

- **Mixtral** (and gpt-oss): softmax over the k chosen logits, so the k weights always sum to one. Transformers
  computes it as a softmax over all E, top-k, renormalised: the same numbers.
- **Qwen2-MoE, Qwen3-MoE, OLMoE**: softmax over all E logits, then top-k; the k weights sum to less than one
  unless `norm_topk_prob` renormalises them (Qwen3-MoE's published models do, OLMoE's do not).
- **DeepSeek-V3** scores experts with a sigmoid, picks them within the best groups and adds a balancing bias to
  the choice only; its weights are normalised and scaled (not implemented here; its preset gives its shape).

Some families add a *shared expert*, a dense SwiGLU every token goes through: Qwen2-MoE scales its output by
a sigmoid gate of its own (`shared_expert_gate`), DeepSeek's shared experts have no gate.

Two ways to run the experts, with the same numbers:

- `experts_loop`: for each expert, find the tokens routed to it, multiply, add back. E small products, each
  after a search of the routing table.
- `experts_grouped`: sort the (token, expert) pairs by expert once (an argsort), so each expert's tokens are a
  contiguous slice of one gathered matrix; one product per expert over its slice; scatter-add back. The
  grouped GEMM of vLLM's and SGLang's fused-MoE kernels, written with one matmul per expert.

The expert weights are stacked into 3-D tensors, `w_gate` and `w_up` (E, I, D) and `w_down` (E, D, I), so that
expert e's matrices are contiguous views `w_gate[e]`; the checkpoint reader stacks Hugging Face's per-expert
tensors into them.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["route", "experts_loop", "experts_grouped", "SwiGLU", "MoEFeedForward", "IMPLEMENTATIONS", "HF_EXPERT_NAMES",
           "HF_EXPERT_WIDTH", "STACKED"]

IMPLEMENTATIONS = ("loop", "grouped")

# Hugging Face's names inside layer i of each family: the MoE block, its router, and expert e's gate, up and down
# projections ('model.layers.{i}.{block}.experts.{e}.{name}.weight'), in the order of w_gate, w_up, w_down.
HF_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
}
# The config.json field that gives each family's expert width.
HF_EXPERT_WIDTH = {"qwen3_moe": "moe_intermediate_size", "olmoe": "intermediate_size", "mixtral": "intermediate_size"}
STACKED = ("w_gate", "w_up", "w_down")


def route(router_logits: torch.Tensor, top_k: int, *, softmax_before_topk: bool,
          normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The k experts each token goes to and their weights: (weights (T, k) float32, ids (T, k) int64). Chapter 14.

    softmax_before_topk=False (Mixtral): the k largest logits, then a softmax over those k, so each row sums to 1
    (normalize changes nothing). softmax_before_topk=True (Qwen2/3-MoE, OLMoE): a softmax over all E logits, then
    the k largest probabilities, divided by their sum if normalize (config.json: norm_topk_prob). The softmax is
    taken in float32 whatever the logits' dtype, as every family does. Ids come largest weight first.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be (tokens, experts), got shape {tuple(router_logits.shape)}")
    n_experts = router_logits.shape[-1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k!r} must be an integer in 1..{n_experts} (the number of experts the "
                         "router scores); pick at most as many experts as there are")
    logits = router_logits.float()
    if softmax_before_topk:
        weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)          # (T, k) of probabilities
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, ids = logits.topk(top_k, dim=-1)                                      # (T, k) of logits
        weights = torch.softmax(top, dim=-1)
    return weights, ids


def _expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
            product=F.linear) -> torch.Tensor:
    """One SwiGLU expert on rows x (n, D): down(silu(gate(x)) · up(x)), each product x @ W.T."""
    return product(F.silu(product(x, w_gate)) * product(x, w_up), w_down)


def experts_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate: torch.Tensor,
                 w_up: torch.Tensor, w_down: torch.Tensor, product=F.linear) -> torch.Tensor:
    """Σ_j weights[t, j] · expert_{ids[t, j]}(x[t]) for x (T, D), as a loop over the E experts: (T, D). Chapter 14.

    Each expert looks up its tokens in the routing table (one search of ids per expert, E in all, whether an
    expert has tokens or not), runs on them, and adds its weighted outputs back at their rows."""
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        token, slot = torch.where(ids == e)                       # the rows routed to e, and which of their k
        if token.numel() == 0:
            continue
        y = _expert(x[token], w_gate[e], w_up[e], w_down[e], product)              # (n_e, D)
        out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
    return out


def experts_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor, product=F.linear) -> torch.Tensor:
    """The same sum as `experts_loop`, with the tokens sorted by expert: (T, D). Chapter 14.

    The T·k (token, expert) pairs are sorted by expert once; the gathered rows x[token] then lie expert by
    expert, so expert e runs one product over the contiguous slice [start_e, start_e + count_e) and the
    weighted results go back to their tokens in one scatter-add. One sort and one host read of the counts
    replace the loop's E searches."""
    top_k = ids.shape[-1]
    flat = ids.reshape(-1)                                        # (T·k,) expert of each pair
    order = torch.argsort(flat, stable=True)                      # pairs grouped by expert, in token order
    token = order // top_k                                        # (T·k,) the token of each sorted pair
    counts = torch.bincount(flat, minlength=w_gate.shape[0]).tolist()   # tokens per expert (one host read)
    rows = x[token]                                               # (T·k, D) gathered, expert by expert
    out_rows = torch.empty_like(rows)
    start = 0
    for e, count in enumerate(counts):
        if count:
            out_rows[start:start + count] = _expert(rows[start:start + count], w_gate[e], w_up[e], w_down[e],
                                                    product)
            start += count
    out_rows *= weights.reshape(-1)[order, None].to(out_rows.dtype)
    return torch.zeros_like(x).index_add_(0, token, out_rows)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)): the dense feed-forward, and an MoE layer's shared expert. Chapters 01, 14."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEFeedForward(nn.Module):
    """A router, E SwiGLU experts stacked in 3-D weights, and an optional shared expert. Chapter 14.

    forward(x (..., D)) -> (..., D). `impl` ('loop' or 'grouped', see IMPLEMENTATIONS) picks how the experts run;
    both give the same numbers. A subclass may run the products differently by overriding `product`
    (x (n, K) times W.T for W (N, K)), as the native CPU kernels do (`llminfer.fast`).
    """

    def __init__(self, dim: int, n_experts: int, top_k: int, expert_dim: int, *, softmax_before_topk: bool,
                 normalize: bool, shared_expert_dim: int = 0, shared_expert_gate: bool = False,
                 impl: str = "grouped"):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must lie in 1..n_experts={n_experts}: a token is routed to top_k "
                             "different experts; lower top_k or add experts")
        self.n_experts, self.top_k = n_experts, top_k
        self.softmax_before_topk, self.normalize = softmax_before_topk, normalize
        self.impl = impl
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(n_experts, expert_dim, dim))
        self.w_up = nn.Parameter(torch.empty(n_experts, expert_dim, dim))
        self.w_down = nn.Parameter(torch.empty(n_experts, dim, expert_dim))
        self.shared_expert = SwiGLU(dim, shared_expert_dim) if shared_expert_dim else None
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_expert_dim and shared_expert_gate else None

    @classmethod
    def from_config(cls, config) -> "MoEFeedForward":
        """The MoE feed-forward of a ModelConfig with n_experts > 0."""
        return cls(config.dim, config.n_experts, config.n_experts_per_tok, config.moe_hidden_dim,
                   softmax_before_topk=config.softmax_before_topk, normalize=config.norm_topk_prob,
                   shared_expert_dim=config.shared_expert_dim, shared_expert_gate=config.shared_expert_gate)

    @property
    def expert_dim(self) -> int:
        return self.w_gate.shape[1]

    def product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (n, K) @ weight.T for one expert's matrix (N, K)."""
        return F.linear(x, weight)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) (T, k) for rows x (T, D): the router's scores through `route`."""
        return route(self.router(x), self.top_k, softmax_before_topk=self.softmax_before_topk,
                     normalize=self.normalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl not in IMPLEMENTATIONS:
            raise ValueError(f"MoEFeedForward.impl={self.impl!r} must be one of {', '.join(IMPLEMENTATIONS)}")
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                            # (T, D): every token alike
        weights, ids = self.route(x)
        run = experts_loop if self.impl == "loop" else experts_grouped
        y = run(x, weights, ids, self.w_gate, self.w_up, self.w_down, self.product)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            y = y + shared
        return y.reshape(shape)
