"""Runs one scheduled step through the model's one forward and samples the next tokens. Chapter 05.

The runner lays the step's new tokens side by side, `input_ids` (1, N) with per-token `positions` (N,),
binds the step's `AttentionMetadata` to the `PagedKVCache`, and calls `model(input_ids, positions, cache)`:
the same forward as `llminfer.generate`. Only the last position of each sequence whose tokens are all
computed needs logits, so the output head runs on those rows alone.

`optimized_copy(model)` is the engine's fast path (chapter 08): a copy of the model, sharing the caller's
weights, with fused projections and the native CPU kernels, whose layer stack (`PagedNativeStack`) runs a
whole engine step in one native call over the paged cache's block tables.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..fast import NativeDecoderStack, optimize_decode
from ..generate import sample_next
from .. import cpu as native_cpu
from .attention_metadata import AttentionMetadata
from .paged_cache import PagedKVCache

__all__ = ["ModelRunner", "head_rows", "optimized_copy", "PagedNativeStack", "module_changes"]

# Every module, parameter or buffer registered anywhere in the process (an attribute set, a layer replaced by a
# transform such as quantize or fuse_projections) moves this count on; a cached argument list older than the
# count is rebuilt. (Rebinding a tensor's .data registers nothing: the cached lists check storage instead.)
# The hooks are set by the first step that keeps arguments, so a process without an optimised engine has none.
_module_changes = [0]
_watching: list = []


def _count_registration(*_) -> None:
    _module_changes[0] += 1


def module_changes() -> int:
    """Returns how many module, parameter and buffer registrations the process has made since the first
    optimised engine step (a version stamp)."""
    if not _watching:
        _watching.extend(hook(_count_registration) for hook in (
            torch.nn.modules.module.register_module_module_registration_hook,
            torch.nn.modules.module.register_module_parameter_registration_hook,
            torch.nn.modules.module.register_module_buffer_registration_hook))
    return _module_changes[0]


class _PoolSlots:
    """What NativeDecoderLayer reads a cache through (`slots`), for a paged cache: its pools and positions."""

    def __init__(self, cache: PagedKVCache, positions: torch.Tensor):
        self.cache, self.positions = cache, positions

    def slots(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.cache.k[layer_idx], self.cache.v[layer_idx], self.positions


class PagedNativeStack(NativeDecoderStack):
    """A NativeDecoderStack that runs an engine step over a PagedKVCache in one native call. Chapters 06 and 08.

    With a paged cache bound to a step, `torch.ops.llminfer.decode_layers_paged` runs every layer for the
    step's N tokens (x (1, N, dim)): the products (the matrix-vector loops for up to `cpu.MAX_TOKENS`
    rows, the blocked matrix multiply beyond), RoPE, each token's K/V written into its block, and attention
    of each token over its own sequence's positions, read in place from the pool through the block tables.
    Any other cache, or a step the one call cannot take, runs as NativeDecoderStack does.

    The per-layer part of the arguments (weights, norms, epsilons, pools: a few hundred tensors) is the same
    every step, so it is built once per kind of step (dtype, the path its row count takes, the cache) and kept
    (`native_args_builds` counts the builds). It is rebuilt when the pools are other tensors, when any module,
    parameter or buffer has been registered since (a layer replaced, a weight reassigned), or when a kept
    tensor's storage moved (its .data rebound); `forget_native_args()` drops it by hand.
    """

    def forward(self, x, cos, sin, cache, backend):
        call = self._paged_args(x, cos, sin, cache, backend) if isinstance(cache, PagedKVCache) else None
        if call is not None:
            return torch.ops.llminfer.decode_layers_paged(*call)                  # (1, N, dim)
        return super().forward(x, cos, sin, cache, backend)

    def forget_native_args(self) -> None:
        """Drops the kept per-layer arguments: the next step builds them again."""
        self.__dict__.pop("_kept_args", None)

    def _stack_key(self, x, cos, cache: PagedKVCache, backend) -> tuple | None:
        """What kept arguments are built for: None where the step cannot take the one call at all."""
        path = self._step_fits(x, cos, backend)
        if path is None:
            return None
        rows = x.shape[0] * x.shape[1]
        return (path, native_cpu.rows_bucket(rows) if rows > native_cpu.MAX_TOKENS else 0, x.dtype, id(cache))

    def _paged_args(self, x, cos, sin, cache: PagedKVCache, backend) -> tuple | None:
        """The arguments of decode_layers_paged for this step, or None where the one call cannot take it."""
        view = cache.block_slots()
        if view is None or x.dim() != 3 or x.shape[0] != 1 or cache.device.type != "cpu":
            return None
        positions, token_seq, tables = view
        key = None if torch.is_grad_enabled() else self._stack_key(x, cos, cache, backend)   # autograd: no keeping
        kept = self.__dict__.get("_kept_args")
        if kept is None or kept[0] != module_changes():    # a module, parameter or buffer registered since
            kept = self.__dict__["_kept_args"] = (module_changes(), {})
        entry = kept[1].get(key) if key is not None else None
        if entry is not None and entry[0] == self._storage_stamp(entry[1], cache):
            layers = entry[1]
        else:
            call = NativeDecoderStack._native_args(self, x, cos, sin, _PoolSlots(cache, positions), backend)
            if call is None:
                kept[1].pop(key, None)
                return None
            self.native_args_builds = self.__dict__.get("native_args_builds", 0) + 1
            layers = (call[1], call[2], call[3], call[6], call[7], call[9], call[10])
            if key is not None:
                kept[1][key] = (self._storage_stamp(layers, cache), layers)
        tensors, layout, eps, keys, values, n_heads, scale = layers
        return (x, tensors, layout, eps, cos, sin, keys, values, positions, token_seq, tables, n_heads, scale)

    @staticmethod
    def _storage_stamp(layers: tuple, cache: PagedKVCache) -> tuple:
        """Where the kept tensors' memory lies, and whether the pools are still the cache's own."""
        tensors, keys, values = layers[0], layers[3], layers[4]
        same_pools = all(a is b for a, b in zip(keys, cache.k)) and all(a is b for a, b in zip(values, cache.v))
        return same_pools, tuple(t.data_ptr() for t in tensors)


@torch.no_grad()
def optimized_copy(model: nn.Module) -> nn.Module:
    """A copy of model on chapter 08's decode path (`llminfer.fast.optimize_decode`: fused projections, the
    native CPU kernels) whose layer stack runs an engine step in one native call; model is not changed.
    Chapters 05 and 08.

    The copy's parameters and buffers are new tensor objects over the caller's storage, so the transforms
    (which rebind `.data`, fuse matrices into new ones, move weights onto 2 MiB pages) leave the caller's
    model as it was; weights no transform touches stay shared.
    """
    memo: dict[int, object] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in memo:
            alias = tensor.detach()
            memo[id(tensor)] = nn.Parameter(alias, requires_grad=tensor.requires_grad) \
                if isinstance(tensor, nn.Parameter) else alias
    attached = getattr(model, "compiled_decoder", None)
    if attached is not None:
        memo[id(attached)] = None          # a decoder attached to the caller's model is not the copy's
    fast = optimize_decode(copy.deepcopy(model, memo))
    if type(getattr(fast, "layers", None)) is NativeDecoderStack:
        fast.layers.__class__ = PagedNativeStack
    return fast


@contextmanager
def head_rows(model, rows: torch.Tensor):
    """Within the block, the model's output head sees only positions `rows` of its input (B, T, dim)."""
    def select(module, args):
        return (args[0].index_select(1, rows),) + tuple(args[1:])
    handle = model.lm_head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


class ModelRunner:
    """Turns AttentionMetadata into one forward and a sampled token per finished sequence. Chapter 05."""

    def __init__(self, model, cache: PagedKVCache):
        self.model = model
        self.cache = cache
        self.device = model.device

    def input_ids(self, metadata: AttentionMetadata) -> torch.Tensor:
        """The step's new tokens side by side: (1, N)."""
        ids = []
        for seq, start, n in zip(metadata.seqs, metadata.context_lens, metadata.query_lens):
            ids.extend(seq.token_ids[start:start + n])
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def logits(self, metadata: AttentionMetadata) -> torch.Tensor:
        """Next-token logits (n_sampled, vocab) of the sequences whose step reaches their newest token."""
        self.cache.bind(metadata)
        try:
            with head_rows(self.model, metadata.logits_indices):
                logits = self.model(self.input_ids(metadata), metadata.positions, self.cache)   # (1, n_sampled, vocab)
        finally:
            self.cache.unbind()
        return logits[0]

    @torch.inference_mode()
    def execute(self, metadata: AttentionMetadata) -> list[int | None]:
        """Runs the step; returns one sampled token per scheduled sequence (None where its prompt is unfinished)."""
        metadata.prepare(self.device)
        logits = self.logits(metadata)                                   # (n_sampled, vocab)
        sampled = [i for i, flag in enumerate(metadata.sample or [True] * metadata.num_seqs) if flag]
        chosen = logits.argmax(dim=-1)                                   # (n_sampled,) on the device
        for row, i in enumerate(sampled):
            params = metadata.seqs[i].params
            if not params.greedy:                                        # each request has its own generator
                chosen[row:row + 1] = sample_next(logits[row:row + 1], params.temperature, params.top_k,
                                                  params.top_p, metadata.seqs[i].generator)
        # the step's one host sync, inherent: the scheduler needs the tokens (EOS, lengths) to plan the next step
        tokens = chosen.tolist() if sampled else []
        out: list[int | None] = [None] * metadata.num_seqs
        for row, i in enumerate(sampled):
            out[i] = tokens[row]
        return out
