"""A small serving engine: continuous batching, a paged KV cache and prefix caching. Chapters 05 and 06.

    from llminfer.engine import LLMEngine, SamplingParams
    engine = LLMEngine(model, block_size=16, max_num_seqs=16, max_num_batched_tokens=512)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=64, eos_token_id=tokenizer.eos_token_id))

The parts, each in its own module (the way nano-vllm separates them):

    sequence.py            a request's tokens, progress, blocks and timestamps; RequestOutput
    sampling_params.py     SamplingParams
    block_manager.py       blocks, block tables, ref counts, the free queue and the prefix cache
    radix_cache.py         the radix tree of cached prefixes (prefix_cache="radix"), chapter 13
    scheduler.py           the batching policy: token budget, admission, chunked prefill, preemption
    attention_metadata.py  the one object the scheduler hands the runner for each step
    paged_cache.py         PagedKVCache: the cache protocol over a block pool
    paged_attention.py     the kernels that read K/V through block tables ('gather', 'flex', ...)
    model_runner.py        one step through the model's one forward, then sampling
    requests.py            the request table both engines keep: the one request check, ids, outputs; PromptIds
    llm_engine.py          LLMEngine: add_request / step / abort / has_unfinished / stats / generate
    protocol.py            Engine: the protocol LLMEngine and the disaggregated pair (chapter 12) both speak
    workload.py            request streams for measuring it (Poisson arrivals, heavy-tailed lengths; few-shot and
                           multi-turn chat for the prefix caches)
"""
from .attention_metadata import AttentionMetadata
from .block_manager import Block, BlockManager, PoolSnapshot, hash_block_tokens
from .llm_engine import EngineStats, LLMEngine, StepRecord
from .model_runner import ModelRunner
from .paged_attention import get_paged_kernel, paged_kernels, register_paged_kernel
from .paged_cache import PagedKVCache
from .radix_cache import PrefixMatch, RadixBlockManager, RadixCache, RadixNode
from .protocol import Engine
from .requests import PromptIds, RequestTable
from .sampling_params import SamplingParams
from .scheduler import POLICIES, Scheduler
from .sequence import RequestOutput, Sequence, SequenceStatus, StepOutput

__all__ = [
    "LLMEngine", "SamplingParams", "RequestOutput", "StepOutput", "EngineStats", "StepRecord",
    "Sequence", "SequenceStatus", "Scheduler", "POLICIES", "BlockManager", "Block", "PoolSnapshot",
    "hash_block_tokens", "AttentionMetadata", "PagedKVCache", "ModelRunner",
    "register_paged_kernel", "get_paged_kernel", "paged_kernels", "Engine", "RequestTable", "PromptIds",
    "RadixCache", "RadixNode", "PrefixMatch", "RadixBlockManager",
]
