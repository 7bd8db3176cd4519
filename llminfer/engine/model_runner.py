"""Runs one scheduled step through the model's one forward and samples the next tokens. Chapter 05.

The runner lays the step's new tokens side by side, `input_ids` (1, N) with per-token `positions` (N,),
binds the step's `AttentionMetadata` to the `PagedKVCache`, and calls `model(input_ids, positions, cache)`:
the same forward as `llminfer.generate`. Only the last position of each sequence whose tokens are all
computed needs logits, so the output head runs on those rows alone.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..generate import sample_next
from .attention_metadata import AttentionMetadata
from .paged_cache import PagedKVCache

__all__ = ["ModelRunner", "head_rows"]


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
        tokens = logits.argmax(dim=-1).tolist() if sampled else []      # the step's one host sync
        for row, i in enumerate(sampled):
            params = metadata.seqs[i].params
            if not params.greedy:
                tokens[row] = int(sample_next(logits[row:row + 1], params.temperature, params.top_k, params.top_p,
                                              metadata.seqs[i].generator)[0])
        out: list[int | None] = [None] * metadata.num_seqs
        for row, i in enumerate(sampled):
            out[i] = tokens[row]
        return out
