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

__all__ = ["AttentionMetadata", "to_device"]


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
        device = torch.device(device)
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
        sample = self.sample or [True] * self.num_seqs
        host = {"positions": positions,                                   # (N,)
                "slot_mapping": slots,                                    # (N,)
                "token_seq": token_seq,                                   # (N,) sequence of each token
                "query_start_loc": starts,                                # (S + 1,)
                "seq_lens": seq_lens,                                     # (S,)
                "block_tables": tables,                                   # (S, max_blocks)
                "logits_indices": [starts[i + 1] - 1 for i in range(self.num_seqs) if sample[i]]}  # (n_sampled,)

        # The gather plan: single-token queries (decode steps) are attended together over padded K/V
        # with a mask; each multi-token chunk (a prefill) on its own with the causal rule.
        decode = [i for i, q in enumerate(self.query_lens) if q == 1]
        self.decode_seq_index = decode
        self.all_decode = len(decode) == self.num_seqs
        longest = max((seq_lens[i] for i in decode), default=0)
        if decode:
            pos = torch.arange(longest)                                                    # (L,)
            rows = tables[decode]                                                          # (D, max_blocks)
            block_of = rows.gather(1, (pos // size).clamp(max=max_blocks - 1).expand(len(decode), -1))
            host["decode_slots"] = block_of * size + pos % size                            # (D, L)
            host["decode_lens"] = [seq_lens[i] for i in decode]                            # (D,)
            host["decode_token_index"] = [starts[i] for i in decode]                       # (D,)
        chunks = [i for i, q in enumerate(self.query_lens) if q > 1]
        for i in chunks:
            pos = torch.arange(seq_lens[i])
            host[f"chunk_slots_{i}"] = tables[i][pos // size] * size + pos % size          # (L,)

        moved = to_device(host, device)                      # one host-to-device copy for the whole step
        self.positions, self.slot_mapping = moved["positions"], moved["slot_mapping"]
        self.token_seq = moved["token_seq"]
        self.query_start_loc = moved["query_start_loc"].to(torch.int32)
        self.seq_lens_tensor = moved["seq_lens"].to(torch.int32)
        self.block_table_tensor = moved["block_tables"]
        self.logits_indices = moved["logits_indices"]
        if decode:
            self.decode_token_index = moved["decode_token_index"]
            self.decode_slots = moved["decode_slots"]
            lens = moved["decode_lens"]
            self.decode_mask = (torch.arange(longest, device=device)[None, :] < lens[:, None])[:, None, None, :]
        self.prefill_plan = [(starts[i], starts[i + 1], moved[f"chunk_slots_{i}"]) for i in chunks]
        self.prepared = True
        return self


# --- one copy per step ------------------------------------------------------------------------------------------

_STAGING: dict[torch.device, list] = {}      # device -> [pinned host buffer, event of the last copy out of it]


def _staging_buffer(device: torch.device, numel: int) -> torch.Tensor:
    """A pinned host buffer of at least numel int64 for copies to device, once the last copy out of it is done."""
    entry = _STAGING.get(device)
    if entry is not None and entry[1] is not None:
        entry[1].synchronize()                      # (done already, in practice: each step reads its tokens back)
    if entry is None or entry[0].numel() < numel:
        capacity = max(numel, 2 * entry[0].numel() if entry else 4096)
        entry = _STAGING[device] = [torch.empty(capacity, dtype=torch.long, pin_memory=True), None]
    return entry[0]


def to_device(host: dict, device: torch.device | str, pack: bool | None = None) -> dict[str, torch.Tensor]:
    """The host index lists and int64 tensors of `host`, as int64 tensors of the same shapes on device, moved in
    one copy (pack=None: packed for any device but the CPU). Chapter 05.

    A step needs about ten small index tensors; moving each with its own `.to(device)` is ten blocking copies
    from pageable memory. Packed, they go into one buffer (pinned, on CUDA) and cross in one asynchronous
    copy; each result is a view of the one device tensor.
    """
    device = torch.device(device)
    tensors = {name: value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.long)
               for name, value in host.items()}
    if pack is None:
        pack = device.type != "cpu"
    if not pack:
        return {name: t.to(device) for name, t in tensors.items()}
    total = sum(t.numel() for t in tensors.values())
    if device.type == "cuda":
        staging = _staging_buffer(device, total)[:total]
        torch.cat([t.reshape(-1) for t in tensors.values()], out=staging)
        flat = staging.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        _STAGING[device][1] = event
    else:
        flat = torch.cat([t.reshape(-1) for t in tensors.values()]).to(device)
    out, offset = {}, 0
    for name, t in tensors.items():
        out[name] = flat[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()
    return out
