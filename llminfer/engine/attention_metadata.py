"""What one engine step runs, as the scheduler hands it to the model runner. Chapter 05.

A step runs a *flattened* batch: the new tokens of every scheduled sequence side by side in one row,
`input_ids` (1, N), each token with its own position. The metadata says which tokens belong to which
sequence, where each token's K/V go in the pool (`slot_mapping`), and which blocks hold each sequence's
earlier K/V (`block_tables`): everything attention needs to keep the sequences apart. The names follow
the varlen convention of FlashAttention and vLLM (`query_start_loc`, `seq_lens`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sequence import Sequence

__all__ = ["AttentionMetadata"]


@dataclass
class AttentionMetadata:
    """One step: per scheduled sequence, its new tokens and cached context, and where the K/V live. Chapter 05.

    Host-side lists come from the scheduler; `prepare(device)` turns them into the index tensors the
    paged cache uses, once per step, shared by every layer.
    """

    seqs: list[Sequence]
    query_lens: list[int]          # new tokens each sequence runs this step
    context_lens: list[int]        # positions each already holds in the pool (skipped, read from blocks)
    block_tables: list[list[int]]  # physical block ids per sequence, in logical order
    block_size: int
    sample: list[bool] = field(default_factory=list)   # does this step reach the end of the sequence's tokens?
    kinds: list[str] = field(default_factory=list)     # "decode" or "prefill" (a chunk, or a recomputation)
    prepared: bool = False

    # --- sizes -----------------------------------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        """N: the new tokens of every sequence, side by side."""
        return sum(self.query_lens)

    @property
    def seq_lens(self) -> list[int]:
        """Positions each sequence holds after this step: context + new tokens."""
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    def check(self) -> None:
        """Raises ValueError if the lists disagree or a block table is too short for its positions."""
        n = len(self.query_lens)
        if not (len(self.context_lens) == len(self.block_tables) == n) or (self.sample and len(self.sample) != n):
            raise ValueError(f"metadata lists disagree: {n} query lengths, {len(self.context_lens)} context "
                             f"lengths, {len(self.block_tables)} block tables, {len(self.sample)} sample flags")
        for i, (c, q, table) in enumerate(zip(self.context_lens, self.query_lens, self.block_tables)):
            if q < 1 or c < 0:
                raise ValueError(f"sequence {i}: query_len={q} and context_len={c}; need query_len >= 1, context >= 0")
            if len(table) * self.block_size < c + q:
                raise ValueError(f"sequence {i} holds {c + q} positions but its block table {table} has room for "
                                 f"{len(table) * self.block_size}")

    # --- tensors ---------------------------------------------------------------------------------

    def prepare(self, device: torch.device | str) -> "AttentionMetadata":
        """Builds the per-step index tensors on device (once); returns self."""
        if self.prepared:
            return self
        self.check()
        size = self.block_size
        positions, slots, token_seq = [], [], []
        starts = [0]
        for i, (c, q, table) in enumerate(zip(self.context_lens, self.query_lens, self.block_tables)):
            for p in range(c, c + q):
                positions.append(p)
                slots.append(table[p // size] * size + p % size)
            token_seq.extend([i] * q)
            starts.append(starts[-1] + q)
        max_blocks = max(len(t) for t in self.block_tables)
        tables = torch.zeros(self.num_seqs, max_blocks, dtype=torch.long)          # padded with block 0
        for i, table in enumerate(self.block_tables):
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.long)
        seq_lens = self.seq_lens
        self.query_start_loc_list = starts
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)        # (N,)
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)          # (N,)
        self.token_seq = torch.tensor(token_seq, dtype=torch.long, device=device)         # (N,) sequence of each token
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)     # (S + 1,)
        self.seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32, device=device)   # (S,)
        self.block_table_tensor = tables.to(device)                                       # (S, max_blocks)
        sample = self.sample or [True] * self.num_seqs
        self.logits_indices = torch.tensor([starts[i + 1] - 1 for i in range(self.num_seqs) if sample[i]],
                                           dtype=torch.long, device=device)               # (n_sampled,)

        # The gather plan: single-token queries (decode steps) are attended together over padded K/V
        # with a mask; each multi-token chunk (a prefill) on its own with the causal rule.
        decode = [i for i, q in enumerate(self.query_lens) if q == 1]
        self.decode_seq_index = decode
        self.all_decode = len(decode) == self.num_seqs
        if decode:
            longest = max(seq_lens[i] for i in decode)
            pos = torch.arange(longest)                                                    # (L,)
            rows = tables[decode]                                                          # (D, max_blocks)
            block_of = rows.gather(1, (pos // size).clamp(max=max_blocks - 1).expand(len(decode), -1))
            decode_slots = block_of * size + pos % size                                    # (D, L)
            lens = torch.tensor([seq_lens[i] for i in decode])
            self.decode_token_index = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device)
            self.decode_slots = decode_slots.to(device)
            self.decode_mask = (pos[None, :] < lens[:, None])[:, None, None, :].to(device)  # (D, 1, 1, L)
        self.prefill_plan = []
        for i, q in enumerate(self.query_lens):
            if q > 1:
                pos = torch.arange(seq_lens[i])
                table = tables[i]
                chunk_slots = table[pos // size] * size + pos % size                       # (L,)
                self.prefill_plan.append((starts[i], starts[i + 1], chunk_slots.to(device)))
        self.prepared = True
        return self
