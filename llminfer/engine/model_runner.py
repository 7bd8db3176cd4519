"""Runs one scheduled step through the model's one forward and samples the next tokens. Chapter 05.

The runner lays the step's new tokens side by side, `input_ids` (1, N) with per-token `positions` (N,),
binds the step's `AttentionMetadata` to the `PagedKVCache`, and calls `model(input_ids, positions, cache)`:
the same forward as `llminfer.generate`. Only the last position of each sequence whose tokens are all
computed needs logits, so the output head runs on those rows alone.

`optimized_copy(model)` is the engine's fast path (chapter 08): a copy of the model, sharing the caller's
weights, with fused projections and the native CPU kernels, whose layer stack (`fast.NativeDecoderStack`) runs a
whole engine step in one native call over the paged cache's block tables: the runner prepares it for its cache once
(`prepare(cache)`: the stack's weights and the pools kept by the kernels), and each step hands over the new tokens,
their positions, their sequences and the block tables.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..fast import NativeDecoderStack, optimize_decode
from ..model import Transformer
from ..sampling import History, is_penalised, sample
from ..structured.constraint import batch_mask
from .attention_metadata import AttentionMetadata
from .paged_cache import PagedKVCache

__all__ = ["ModelRunner", "head_rows", "optimized_copy"]


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
    return optimize_decode(copy.deepcopy(model, memo))


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
        if isinstance(model, Transformer) and isinstance(model.layers, NativeDecoderStack):
            model.layers.prepare(cache)            # the stack's weights and the pools, kept once for every step

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
        if not sampled:                                                  # every prompt still unfinished
            return [None] * metadata.num_seqs
        seqs = [metadata.seqs[i] for i in sampled]
        params = [seq.params for seq in seqs]
        history = History.of([seq.prompt_token_ids for seq in seqs], [seq.output_token_ids for seq in seqs],
                             logits.shape[-1], logits.device) if any(is_penalised(p) for p in params) else None
        # the one pipeline, each row with its request's settings and its own generator (draws alone = in a batch)
        allowed = batch_mask([seq.constraint for seq in seqs], logits.shape[-1], logits.device)   # chapter 13
        chosen = sample(logits, params, [seq.generator for seq in seqs], history, allowed,
                        names=[f"request {seq.request_id}" for seq in seqs])   # (n_sampled,) on the device
        # the step's one host sync, inherent: the scheduler needs the tokens (EOS, lengths) to plan the next step
        tokens = chosen.tolist()
        out: list[int | None] = [None] * metadata.num_seqs
        for row, i in enumerate(sampled):
            out[i] = tokens[row]
        return out
