"""LLMEngine: requests in, tokens out, one scheduled step at a time. Chapters 05 and 06.

    engine = LLMEngine(model, block_size=16, max_num_seqs=16, max_num_batched_tokens=512)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=64))      # one RequestOutput per prompt

or driven step by step, as a server does:

    request_id = engine.add_request(prompt_ids, params)
    while engine.has_unfinished():
        for request_id, token_id, finished in engine.step():
            ...
    engine.pop_output(request_id)                                             # tokens and timings

These calls, with `add_prefilled` (a request whose K/V were computed elsewhere), `abort`, `stats` and
`clock`, are the engine protocol (`llminfer.engine.protocol.Engine`) that the server of chapter 11 and the
disaggregated pair of chapter 12 also speak.

Each step: the scheduler picks the batch (`AttentionMetadata`), the model runner runs it through the
model's one forward over the `PagedKVCache`, the sampled tokens are appended, finished requests free
their blocks. `engine.trace` keeps what every step ran, for the scheduling chart of chapter 05.
"""
from __future__ import annotations

import logging
import numbers
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..checks import check_flag, check_int
from ..checks import is_int as _is_int
from ..costs import kv_cache_bytes
from ..device import check_fits, dtype_bytes, free_memory_bytes, synchronize
from ..structured.constraint import check_constraints
from .attention_metadata import AttentionMetadata
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .paged_cache import PagedKVCache
from .radix_cache import RadixBlockManager
from .requests import PromptIds, RequestTable, check_pool_fits
from .sampling_params import SamplingParams
from .scheduler import POLICIES, Scheduler
from .sequence import RequestOutput, Sequence, SequenceStatus, StepOutput

__all__ = ["LLMEngine", "EngineStats", "StepRecord"]

KV_MEMORY_FRACTION = 0.5    # with num_blocks=None the pool takes at most this share of free memory
PREFIX_CACHES = ("hash", "radix")   # chapter 06's chained block hashes; chapter 13's radix tree
BLOCK_BOOKKEEPING_BYTES = 512   # host memory per block: a Block object and its free-queue entry, in two managers

log = logging.getLogger("llminfer.engine")


@dataclass(frozen=True)
class StepRecord:
    """What one engine step ran, and when: the raw material of the scheduling chart. Chapter 05."""
    step: int
    start_s: float
    end_s: float
    entries: tuple[tuple[int, str, int], ...]    # (request id, "prefill" or "decode", tokens run)
    preempted: tuple[int, ...] = ()
    finished: tuple[int, ...] = ()
    blocks_used: int = 0           # after the step
    num_running: int = 0           # sequences admitted (holding or waiting for blocks) after the step
    tokens_held: int = 0           # K/V positions the running sequences hold after the step
    schedule_s: float = 0.0        # time spent choosing the batch
    model_s: float = 0.0           # time in the model runner (forward and sampling)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.entries)


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters at one moment. Chapters 05 and 06."""
    steps: int
    num_blocks: int
    block_size: int
    blocks_used: int
    blocks_free: int
    blocks_cached_free: int        # free blocks that still hold a reusable prefix
    kv_pool_bytes: int
    num_waiting: int
    num_running: int
    num_finished: int
    preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    tokens_computed: int           # positions run through the model, all steps
    evictions: int
    paged_kernel: str = ""         # the paged-attention kernel the cache runs now ('flex', 'gather', ...)
    kernel_fallbacks: int = 0      # times an automatic kernel failed and 'gather' took over (visible, not silent)
    kernel_fallback: str = ""      # the last such failure: which kernel, and why

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def usage(self) -> float:
        return self.blocks_used / self.num_blocks


def sampling_seqs(metadata: AttentionMetadata) -> list[Sequence]:
    """The step's sequences that sample a token from a random generator this step (not greedy). Chapter 05."""
    sample = metadata.sample or [True] * metadata.num_seqs
    return [seq for seq, flag in zip(metadata.seqs, sample) if flag and seq.generator is not None]


class LLMEngine:
    """Continuous batching over a paged KV cache with prefix caching, driven one step at a time. Chapter 05.

    The KV pool: num_blocks blocks, or as many as kv_cache_memory bytes hold, or by default what max_num_seqs
    requests of max_model_len positions use, capped at kv_memory_fraction of the free memory (`pool_sizing`
    says which and why). Every size is checked by arithmetic before anything is allocated.

    optimize=True runs a copy of the model on chapter 08's decode path (`model_runner.optimized_copy`; the
    caller's model is not changed): fused projections and, on a CPU, the native kernels, an engine step over
    every scheduled sequence in one native call that reads K/V in place through the block tables.

    max_prefill_tokens caps the prompt tokens of a step that runs anything else (`Scheduler`; None: no cap
    beside max_num_batched_tokens), so prompts that arrive together start one after another.

    prefix_cache picks how cached prefixes are found when enable_prefix_caching is on: "hash" (chapter 06's
    chained block hashes) or "radix" (chapter 13's radix tree, `radix_cache.RadixBlockManager`), over the
    same pool."""

    def __init__(self, model, block_size: int = 16, num_blocks: int | None = None, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, policy: str = "continuous", enable_prefix_caching: bool = True,
                 chunked_prefill: bool = True, max_model_len: int | None = None,
                 kv_memory_fraction: float = KV_MEMORY_FRACTION, kernel: str | None = None,
                 clock=time.perf_counter, trace_limit: int = 100_000, optimize: bool = False,
                 kv_cache_memory: int | None = None, max_prefill_tokens: int | None = None,
                 prefix_cache: str = "hash"):
        cfg = model.config
        if not _is_int(block_size) or block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a positive power of two (1, 2, 4, 8, 16, ...), got {block_size!r}; "
                             "16 is the usual choice")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if max_prefill_tokens is not None and (not _is_int(max_prefill_tokens) or max_prefill_tokens < 1):
            raise ValueError(f"max_prefill_tokens must be a positive integer or None (no cap beside "
                             f"max_num_batched_tokens), got {max_prefill_tokens!r}")
        if prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be one of {', '.join(PREFIX_CACHES)} (chapter 06's block hashes or "
                             f"chapter 13's radix tree; enable_prefix_caching=False for none), got {prefix_cache!r}")
        if max_model_len is None:
            max_model_len = cfg.max_seq_len
        if not _is_int(max_model_len) or not 1 <= max_model_len <= cfg.max_seq_len:
            raise ValueError(f"max_model_len must lie in 1..{cfg.max_seq_len} (the model's max_seq_len), "
                             f"got {max_model_len!r}")
        if isinstance(kv_memory_fraction, bool) or not isinstance(kv_memory_fraction, numbers.Real) \
                or not 0 < kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must lie in (0, 1], got {kv_memory_fraction}")
        largest_block = max(16, 1 << (max_model_len - 1).bit_length())        # max_model_len, up to a power of two
        if block_size > largest_block:
            raise ValueError(f"block_size={block_size} is larger than a request can fill (max_model_len="
                             f"{max_model_len}); pass block_size <= {largest_block} (16 is the usual choice)")
        per_block = kv_cache_bytes(cfg, block_size, dtype_bytes(model.dtype))     # one block's K/V, all layers
        one_request = -(-max_model_len // block_size)
        if kv_cache_memory is not None:
            if num_blocks is not None:
                raise ValueError(f"pass num_blocks or kv_cache_memory, not both (got num_blocks={num_blocks!r}, "
                                 f"kv_cache_memory={kv_cache_memory!r})")
            check_int("kv_cache_memory", kv_cache_memory, 1)
            num_blocks = kv_cache_memory // per_block
            if num_blocks < one_request:
                raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes hold {num_blocks} blocks of {per_block} "
                                 f"bytes, too few for one request of max_model_len={max_model_len} ({one_request} "
                                 f"blocks); pass kv_cache_memory >= {one_request * per_block}, or a smaller "
                                 "max_model_len")
            self.pool_sizing = (f"{num_blocks} blocks: the {kv_cache_memory / 2**20:.1f} MiB of kv_cache_memory "
                                f"at {per_block} bytes a block")
        elif num_blocks is None:
            # what max_num_seqs full-length requests use, but no more than kv_memory_fraction of the free memory
            # (and at least one full-length request where the free memory holds it)
            free = free_memory_bytes(model.device)
            affordable = int(kv_memory_fraction * free) // per_block
            if affordable < one_request and one_request * per_block <= 0.8 * free:
                affordable = one_request
            useful = max_num_seqs * one_request
            num_blocks = min(affordable, useful)
            self.pool_sizing = (f"{num_blocks} blocks: min({affordable} that {kv_memory_fraction:.0%} of the "
                                f"{free / 2**30:.1f} GiB free hold, {useful} for {max_num_seqs} requests of "
                                f"{max_model_len} positions)")
            if num_blocks < one_request:
                raise MemoryError(f"the KV pool fits only {num_blocks} blocks of {block_size} positions in "
                                  f"{kv_memory_fraction:.0%} of the {free / 2**30:.2f} GiB free, too few for one "
                                  f"request of max_model_len={max_model_len} ({one_request} blocks); free memory, "
                                  "pass a smaller max_model_len, or a larger kv_memory_fraction")
        else:
            if not _is_int(num_blocks) or num_blocks < 1:
                raise ValueError(f"num_blocks must be a positive integer or None (size from free memory), "
                                 f"got {num_blocks!r}")
            if num_blocks < one_request:
                raise ValueError(f"num_blocks={num_blocks} × block_size={block_size} = {num_blocks * block_size} "
                                 f"positions is too small for one request of max_model_len={max_model_len}; pass "
                                 f"num_blocks >= {one_request}, or max_model_len <= {num_blocks * block_size}")
            self.pool_sizing = f"{num_blocks} blocks (given)"
        # the arithmetic before any allocation: the pool on the device, the block bookkeeping in host memory
        check_fits(num_blocks * per_block, model.device,
                   f"num_blocks={num_blocks} blocks × block_size={block_size} positions ({per_block} bytes of K/V a "
                   f"block, {cfg.n_layers} layers)", fix="pass a smaller num_blocks or kv_cache_memory (or leave both "
                   "unset to size the pool from free memory)")
        check_fits(num_blocks * BLOCK_BOOKKEEPING_BYTES, "cpu",
                   f"the bookkeeping of num_blocks={num_blocks} blocks ({BLOCK_BOOKKEEPING_BYTES} bytes each)",
                   fix="pass a smaller num_blocks")
        for name, flag in (("optimize", optimize), ("enable_prefix_caching", enable_prefix_caching),
                           ("chunked_prefill", chunked_prefill)):
            check_flag(name, flag)
        if optimize:
            # chapter 08's decode path on a copy: fused q/k/v and gate/up, the native CPU kernels, and the
            # layer stack in one native call over the block tables (attention too, where layers run alone)
            from .model_runner import optimized_copy
            model = optimized_copy(model)
            if kernel is None and model.device.type == "cpu" and model.attn_backend == "native":
                kernel = "native"
        self.model = model
        self.config = cfg
        self.max_model_len = max_model_len
        self.chunked_prefill = chunked_prefill
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache = prefix_cache if enable_prefix_caching else None
        self.block_manager = RadixBlockManager(num_blocks, block_size) if self.prefix_cache == "radix" \
            else BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size, kernel=kernel)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, policy, chunked_prefill,
                                   max_prefill_tokens)
        self.runner = ModelRunner(model, self.cache)
        self.clock = clock
        self.trace: deque[StepRecord] = deque(maxlen=trace_limit)
        self.requests = RequestTable(cfg, max_model_len, clock, device=model.device)
        self._steps = 0
        self._tokens_computed = 0

    # --- settings ----------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def policy(self) -> str:
        return self.scheduler.policy

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens

    def __repr__(self) -> str:
        return (f"LLMEngine(policy={self.policy!r}, max_num_seqs={self.max_num_seqs}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens}, chunked_prefill={self.chunked_prefill}, "
                f"prefix_cache={self.prefix_cache!r}, pool={self.num_blocks} blocks × {self.block_size} "
                f"= {self.cache.nbytes / 2**20:.1f} MiB, kernel={self.cache.kernel_name!r})")

    # --- requests ----------------------------------------------------------------------------------

    def _check_limits(self, prompt: PromptIds, params: SamplingParams) -> None:
        """ValueError unless the request fits this engine's KV pool and, without chunked prefill, one step."""
        check_pool_fits(prompt, params, self.num_blocks, self.block_size)
        positions = len(prompt) + params.max_new_tokens - 1   # the last token is sampled, never run through the model
        if not self.chunked_prefill and positions > self.max_num_batched_tokens:
            raise ValueError(f"without chunked prefill a request's {positions} positions must fit in one step's "
                             f"budget, max_num_batched_tokens={self.max_num_batched_tokens} (it may have to be "
                             "recomputed whole after a preemption); enable chunked_prefill or raise the budget")

    def add_request(self, prompt_ids, params: SamplingParams | None = None, arrival_time: float | None = None,
                    constraint=None) -> int:
        """Queues one request; returns its id. Everything is checked here, before it can be scheduled (ids that
        are already a PromptIds of this model, as the server passes them, are not checked again). constraint: a
        fresh `structured.Constraint` the request's output must follow (chapter 13), batched with free requests."""
        prompt, params = self.requests.check(prompt_ids, params, arrival_time, self._check_limits)
        if constraint is not None:
            check_constraints([constraint], 1, self.model.config.vocab_size, params.eos_token_id)
            constraint.finish_within(params.max_new_tokens)
        seq = self.requests.track(prompt, params, arrival_time)
        seq.constraint = constraint
        self.scheduler.add(seq)
        return seq.request_id

    def add_prefilled(self, prompt_ids, params: SamplingParams | None, first_token: int,
                      kv: list[tuple[torch.Tensor, torch.Tensor]], arrival_time: float | None = None,
                      first_token_time: float | None = None, generator_state: torch.Tensor | None = None) -> int | None:
        """Installs a request whose prompt K/V were computed elsewhere, already decoding; returns its id. Chapter 12.

        kv: per layer (k, v), each (1, n_kv_heads, P, head_dim) for the P prompt positions, keys after RoPE.
        The block manager allocates blocks for the P positions, the pool takes the K/V through the block
        table, first_token (sampled where the prompt ran, at first_token_time) becomes the first output,
        and the request joins the running batch: its next step is a decode. generator_state carries a
        sampled request's generator on. Returns None, changing nothing, when the running batch is full or
        the pool lacks the blocks for P + 1 positions now (offer it again after a step).
        """
        prompt, params = self.requests.check(prompt_ids, params, arrival_time, self._check_limits)
        self.requests.check_prefilled(prompt, params, first_token, kv, first_token_time)
        bm, scheduler, num_tokens = self.block_manager, self.scheduler, len(prompt)
        if len(scheduler.running) >= scheduler.max_num_seqs or bm.blocks_needed(num_tokens + 1) > bm.num_free_blocks:
            return None
        now = self.clock()
        seq = self.requests.track(prompt, params, now if arrival_time is None else arrival_time)
        if not bm.allocate(seq, num_tokens):                               # pragma: no cover - checked above
            raise RuntimeError("the pool refused an allocation it had room for")
        for layer, (k, v) in enumerate(kv):
            self.cache.write(layer, seq.block_table, k, v)
        seq.num_computed_tokens = num_tokens
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.RUNNING
        if seq.generator is not None and generator_state is not None:
            seq.generator.set_state(generator_state)
        self.requests.start_decoding(seq, first_token, now if first_token_time is None else first_token_time)
        scheduler.running.append(seq)
        return seq.request_id

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return self.requests.has_unfinished()

    def abort(self, request_id: int) -> bool:
        """Stops a request and frees its blocks; True if it was unfinished, False if it had already finished."""
        seq = self.requests.abort(request_id)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        return True

    def pop_output(self, request_id: int) -> RequestOutput:
        """The finished request's RequestOutput, handed over once (the engine then forgets it)."""
        return self.requests.pop_output(request_id)

    def output(self, request_id: int) -> RequestOutput:
        """A snapshot of a request's RequestOutput, running or finished (not yet popped)."""
        return self.requests.output(request_id)

    @property
    def unfinished_sequences(self) -> list[Sequence]:
        return list(self.scheduler.running) + list(self.scheduler.waiting)

    # --- stepping ----------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Runs one scheduled batch; returns the tokens it made as (request_id, token_id, finished)."""
        start = self.clock()
        metadata = self.scheduler.schedule(now=start)
        preempted = tuple(self.scheduler.last_preempted)
        if metadata is None:
            return []
        scheduled = self.clock()
        tokens = self._execute(metadata)
        self.scheduler.finish_step(metadata)
        if all(token is None for token in tokens):   # reading tokens back waited for the step; with none, wait here
            synchronize(self.model.device)           # so the step's end time includes its kernels
        now = self.clock()
        events, finished = [], []
        for seq, token in zip(metadata.seqs, tokens):
            if token is None:
                continue
            if isinstance(token, Exception):
                self._fail(seq, token)
                events.append(StepOutput(seq.request_id, None, True))
                finished.append(seq.request_id)
                continue
            done = seq.append_token(token, now)
            events.append(StepOutput(seq.request_id, token, done))
            if done:
                self.scheduler.remove(seq)
                self.requests.finish(seq)
                finished.append(seq.request_id)
        entries = tuple((s.request_id, kind, q) for s, kind, q in zip(metadata.seqs, metadata.kinds, metadata.query_lens))
        self._steps += 1
        self._tokens_computed += metadata.num_tokens
        running = self.scheduler.running
        self.trace.append(StepRecord(self._steps, start, now, entries, preempted, tuple(finished),
                                     self.block_manager.num_used_blocks, len(running),
                                     sum(s.num_computed_tokens for s in running), scheduled - start, now - scheduled))
        return events

    def _execute(self, metadata: AttentionMetadata) -> list:
        """The step's token per scheduled sequence (None: prompt unfinished; an exception: that request failed).

        When the batch raises, each sequence runs again alone, so that only the requests whose own forward or
        sampling raises fail; rewriting a position's K/V writes the same values, and each sampled request's
        generator is set back to its state before the step (rows sampled before the failure had drawn from it),
        so the rerun draws the tokens the request draws alone."""
        states = [(seq.generator, seq.generator.get_state()) for seq in sampling_seqs(metadata)]
        try:
            return self.runner.execute(metadata)
        except Exception as exc:            # a bug, or one request's values; KeyboardInterrupt still stops
            if metadata.num_seqs == 1:
                return [exc]
        for generator, state in states:
            generator.set_state(state)
        out: list = []
        for i, seq in enumerate(metadata.seqs):
            alone = AttentionMetadata(seqs=[seq], query_lens=[metadata.query_lens[i]],
                                      context_lens=[metadata.context_lens[i]], block_tables=[metadata.block_tables[i]],
                                      block_size=metadata.block_size,
                                      sample=[metadata.sample[i]] if metadata.sample else [],
                                      kinds=[metadata.kinds[i]] if metadata.kinds else [])
            try:
                out.extend(self.runner.execute(alone))
            except Exception as exc:
                out.append(exc)
        return out

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        """Finishes seq with finish_reason "error" and frees its blocks; the other requests go on."""
        log.warning("request %d failed in step %d: %s: %s", seq.request_id, self._steps + 1, type(exc).__name__,
                    exc, exc_info=exc)
        self.block_manager.discard(seq)     # K/V its failed step may have half-written: never reused from the cache
        self.scheduler.remove(seq)
        self.requests.fail(seq, f"{type(exc).__name__}: {exc}")

    @property
    def stats(self) -> EngineStats:
        """Blocks used and free, prefix hit rate, preemptions, steps, queue sizes."""
        bm = self.block_manager
        return EngineStats(
            steps=self._steps, num_blocks=bm.num_blocks, block_size=bm.block_size, blocks_used=bm.num_used_blocks,
            blocks_free=bm.num_free_blocks, blocks_cached_free=bm.num_cached_free_blocks,
            kv_pool_bytes=self.cache.nbytes, **self.requests.counts(),
            preemptions=self.scheduler.preemptions, prefix_hit_tokens=bm.hit_tokens,
            prefix_query_tokens=bm.queried_tokens, tokens_computed=self._tokens_computed, evictions=bm.evictions,
            paged_kernel=self.cache.kernel_name, kernel_fallbacks=self.cache.kernel_fallbacks,
            kernel_fallback=self.cache.kernel_fallback)

    # --- offline use -------------------------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; returns one RequestOutput per prompt, in order. Chapter 05."""
        return self.requests.run(prompts, params, self.add_request, self.step, self._check_limits)
