"""Which sequences run in the next step, and how many tokens each: the batching policy. Chapter 05.

Every step has a token budget, `max_num_batched_tokens`, and a cap on sequences, `max_num_seqs`.

- "continuous" (iteration-level scheduling, as in Orca and vLLM): every step, first one token for each
  running sequence that is decoding, then prefill work from partly prefilled and newly admitted
  sequences fills what is left of the budget, split into chunks when `chunked_prefill` is on. A
  sequence that finishes frees its place at once, and a waiting one takes it in the next step.
- `max_prefill_tokens` (continuous, chunked): the most prompt tokens a step runs beside other work. A step that
  has decodes, or already one prefill chunk, gives prompts no more than this; only a step with nothing else
  may give its first chunk the whole budget. Prompts that arrive together then start one after another
  instead of all in one long step: the first ones reach their first token sooner, and the decodes running
  beside them are not held up by a long step. None: prompts may take the whole budget in every step.
- "static": a batch of up to max_num_seqs waiting requests is admitted together and runs until its
  last member finishes; nothing joins it meanwhile (a finished member's place stays empty).
- "sequential": one request at a time (a static batch of one).

When the KV pool has no block for a running sequence's next token, the most recently admitted running
sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed from its prompt and the tokens it had already made (the prefix cache may spare part of that).
"""
from __future__ import annotations

from collections import deque

from .attention_metadata import AttentionMetadata
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

__all__ = ["Scheduler", "POLICIES"]

POLICIES = ("continuous", "static", "sequential")


class Scheduler:
    """Picks each step's batch under a token budget, admits waiting requests, preempts when the pool is full. Chapter 05."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                 policy: str = "continuous", chunked_prefill: bool = True, max_prefill_tokens: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if max_prefill_tokens is not None and (not isinstance(max_prefill_tokens, int)
                                               or isinstance(max_prefill_tokens, bool) or max_prefill_tokens < 1):
            raise ValueError(f"max_prefill_tokens must be a positive integer or None (no cap beside the budget), "
                             f"got {max_prefill_tokens!r}")
        self.max_prefill_tokens = max_prefill_tokens
        self.block_manager = block_manager
        self.max_num_seqs = 1 if policy == "sequential" else max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # in admission order: the last is preempted first
        self.preemptions = 0
        self.last_preempted: list[int] = []

    # --- queue -----------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Takes seq out of the queue or the running batch and frees its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    # --- one step --------------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)               # num_computed_tokens back to 0: recomputed later
        seq.status = SequenceStatus.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.last_preempted.append(seq.request_id)
        self.waiting.appendleft(seq)

    def _chunk(self, seq: Sequence, remaining: int, budget: int) -> int:
        """Tokens to run for seq this step: all that remain, a chunk of them, or 0 if they must wait."""
        if remaining <= budget:
            return remaining
        return budget if self.chunked_prefill else 0

    def _book(self, seq: Sequence, budget: int, scheduled: dict, may_preempt: bool) -> int:
        """Books pool room for seq's next tokens (preempting later running sequences if allowed and the
        pool is full); returns how many tokens seq runs this step (0: it waits)."""
        n = self._chunk(seq, seq.num_remaining, budget)
        if n == 0:
            return 0
        computed = []
        if not seq.block_table and seq.num_computed_tokens == 0:      # first chunk: look up the prefix cache
            computed = self.block_manager.get_computed_blocks(seq)
            n = self._chunk(seq, seq.num_remaining - len(computed) * self.block_manager.block_size, budget)
            if n == 0:
                return 0
        while not self.block_manager.allocate(seq, n, computed):
            victims = [s for s in self.running if s is not seq and s.request_id not in scheduled and s.block_table]
            if not may_preempt or not victims:
                return 0                                             # wait for blocks to come back
            self._preempt(victims[-1])                               # the most recently admitted goes first
        self._note_admission(seq, len(computed))
        return n

    def _note_admission(self, seq: Sequence, n_hit_blocks: int) -> None:
        if seq.num_cached_tokens < 0:                                 # first admission: record the hit
            hit = n_hit_blocks * self.block_manager.block_size
            seq.num_cached_tokens = hit
            if self.block_manager.enable_prefix_caching:
                self.block_manager.record_lookup(seq.num_prompt_tokens, hit)

    def _prefill_room(self, budget: int, prefill_tokens: int, scheduled: dict) -> int:
        """Tokens a prefill chunk may take now: what is left of the budget, within max_prefill_tokens once the
        step holds anything else (the cap applies to chunked prefill only: an unchunked prompt could wait forever)."""
        if self.max_prefill_tokens is None or not self.chunked_prefill or not scheduled:
            return budget
        return min(budget, self.max_prefill_tokens - prefill_tokens)

    def schedule(self, now: float = 0.0) -> AttentionMetadata | None:
        """The next step's batch as AttentionMetadata (None when there is nothing to run). Chapter 05."""
        budget = self.max_num_batched_tokens
        scheduled: dict[int, int] = {}                               # request id -> new tokens
        prefill_tokens = 0                                           # of them, prompt tokens (chunks)
        self.last_preempted = []

        if self.policy != "continuous" and not self.running:         # static: admit the next batch whole
            while self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)

        # 1. running sequences: decodes first, then prefill chunks, in admission order
        order = [s for s in self.running if s.is_decoding] + [s for s in self.running if not s.is_decoding]
        for seq in order:
            if budget <= 0:
                break
            if seq not in self.running:                               # preempted while booking an earlier one
                continue
            room = budget if seq.is_decoding else self._prefill_room(budget, prefill_tokens, scheduled)
            if room <= 0:
                continue
            n = self._book(seq, room, scheduled, may_preempt=True)
            if n:
                scheduled[seq.request_id] = n
                budget -= n
                prefill_tokens += 0 if seq.is_decoding else n

        # 2. continuous: admit waiting requests into what is left (not in a step that had to preempt)
        if self.policy == "continuous" and not self.last_preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                room = self._prefill_room(budget, prefill_tokens, scheduled)
                n = self._book(seq, room, scheduled, may_preempt=False) if room > 0 else 0
                if n == 0:
                    break                                             # first come, first served: no overtaking
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                scheduled[seq.request_id] = n
                budget -= n
                prefill_tokens += n

        if not scheduled:
            return None
        seqs = [s for s in self.running if s.request_id in scheduled]
        for seq in seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        query_lens = [scheduled[s.request_id] for s in seqs]
        context_lens = [s.num_computed_tokens for s in seqs]
        return AttentionMetadata(
            seqs=seqs, query_lens=query_lens, context_lens=context_lens,
            block_tables=[list(s.block_table) for s in seqs], block_size=self.block_manager.block_size,
            sample=[c + q == s.num_tokens for s, c, q in zip(seqs, context_lens, query_lens)],
            kinds=["decode" if s.is_decoding else "prefill" for s in seqs])

    def finish_step(self, metadata: AttentionMetadata) -> None:
        """The step ran: each scheduled sequence's computed positions advance by its new tokens."""
        for seq, n in zip(metadata.seqs, metadata.query_lens):
            seq.num_computed_tokens += n
