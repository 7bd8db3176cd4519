"""The engine on chapter 08's fast path: the paged decode-attention kernel against the gather path, a whole
engine step in one native call over the block tables, and an optimised engine that leaves the caller's model
alone."""
from __future__ import annotations

import random

import pytest
import torch

import llminfer
from llminfer import fast
from llminfer.engine import LLMEngine, SamplingParams
from llminfer.engine.attention_metadata import AttentionMetadata
from llminfer.engine.model_runner import optimized_copy
from llminfer.engine.paged_attention import gather_attention, get_paged_kernel
from llminfer.engine.paged_cache import PagedKVCache
from llminfer import cpu

from small_models import SMALL_CONFIGS, random_model


@pytest.fixture(autouse=True)
def _kernels():
    assert cpu.available(), f"the native CPU kernels did not build: {cpu.why_unavailable()}"


def _step(query_lens, context_lens, block_size, num_blocks, seed):
    """A prepared step whose sequences own shuffled, scattered blocks (the first two share their first)."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for q, c in zip(query_lens, context_lens):
        need = -(-(q + c) // block_size)
        tables.append([free.pop() for _ in range(need)])
    if len(tables) > 1 and context_lens[0] >= block_size and context_lens[1] >= block_size:
        tables[1][0] = tables[0][0]                     # a shared prefix block (read by both, written by neither)
    meta = AttentionMetadata(seqs=[None] * len(query_lens), query_lens=list(query_lens),
                             context_lens=list(context_lens), block_tables=tables, block_size=block_size)
    return meta.prepare("cpu")


def _reference(q, k, v, causal=True, mask=None, scale=None):
    """Chapter 02's attention written out (grouped heads, the causal rule aligned to the last keys), in float32."""
    return llminfer.attention.get_backend("explicit")(q.float(), k.float(), v.float(), causal=causal, mask=mask,
                                                       scale=scale).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens, context_lens, block_size", [
    ([1] * 6, [0, 5, 16, 17, 40, 63], 16),               # a decode step, every sequence at its own length
    ([1, 7, 1, 20], [33, 0, 8, 12], 8),                    # decodes beside prefill chunks
    ([3, 1, 1], [70, 100, 1], 4),                          # long contexts over many small blocks
])
def test_the_paged_kernel_equals_the_gather_path(dtype, query_lens, context_lens, block_size):
    n_heads, n_kv_heads, head_dim, num_blocks = 8, 2, 32, 96
    meta = _step(query_lens, context_lens, block_size, num_blocks, seed=sum(context_lens))
    generator = torch.Generator().manual_seed(len(query_lens))
    pools = [torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=generator).to(dtype)
             for _ in range(2)]
    q = torch.randn(1, n_heads, meta.num_tokens, head_dim, generator=generator).to(dtype)
    expected = gather_attention(q, pools[0], pools[1], meta, _reference)
    got = get_paged_kernel("native")(q, pools[0], pools[1], meta, None)
    assert got.shape == expected.shape == (1, n_heads, meta.num_tokens, head_dim)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    # a different block table gives a different answer: the kernel reads through the tables
    moved = meta.block_table_tensor.clone()
    moved[0, 0] = (moved[0, 0] + 1) % num_blocks
    other = cpu.paged_attention(q, pools[0], pools[1], moved, meta.token_seq, meta.positions)
    assert not torch.allclose(other[:, :, :1].float(), got[:, :, :1].float())


def test_the_paged_kernel_refuses_a_block_outside_the_pool():
    meta = _step([1, 1], [20, 3], 8, 16, seed=0)
    pools = [torch.zeros(16, 8, 2, 16) for _ in range(2)]
    q = torch.zeros(1, 4, 2, 16)
    tables = meta.block_table_tensor.clone()
    tables[0, 1] = 99
    with pytest.raises(RuntimeError, match=r"block 99 of sequence 0 is outside the pool's 0\.\.15"):
        cpu.paged_attention(q, pools[0], pools[1], tables, meta.token_seq, meta.positions)
    with pytest.raises(RuntimeError, match=r"position 20 of token 0 is outside its block table's 1 blocks of 8"):
        cpu.paged_attention(q, pools[0], pools[1], tables[:, :1].contiguous(), meta.token_seq, meta.positions)


def test_the_matrix_vector_threshold_is_one_number():
    """Python's MAX_TOKENS is what the C++ was built with: up to it the matrix-vector loops, past it the
    blocked kernel; both sides of it give torch's products."""
    assert torch.ops.llminfer.matvec_max_rows() == cpu.MAX_TOKENS
    weight = torch.randn(200, 96, generator=torch.Generator().manual_seed(0))
    for rows in (cpu.MAX_TOKENS, cpu.MAX_TOKENS + 1):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(cpu.gemv(x, weight), x @ weight.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-bias-gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_engine_step_in_one_call_gives_the_layers_numbers(name, dtype):
    """A mixed step (decodes and prefill chunks over scattered blocks) through the stack's one op over the pool: the
    same logits and the same K/V written into the pool as the layers run one by one over the gather path."""
    model = optimized_copy(random_model(SMALL_CONFIGS[name]).to(dtype))
    assert type(model.layers) is fast.NativeDecoderStack
    cfg = model.config
    query_lens, context_lens = [1, 9, 1, 4], [21, 0, 5, 30]
    meta = _step(query_lens, context_lens, 8, 40, seed=3)
    caches = [PagedKVCache.for_model(model, 40, 8, kernel="gather") for _ in range(2)]
    generator = torch.Generator().manual_seed(1)
    for layer in range(cfg.n_layers):                     # the contexts already in the pool: the same in both
        for pool in ("k", "v"):
            values = torch.randn(getattr(caches[0], pool)[layer].shape, generator=generator).to(dtype)
            for cache in caches:
                getattr(cache, pool)[layer].copy_(values)
    ids = torch.randint(0, cfg.vocab_size, (1, meta.num_tokens), generator=generator)
    outputs, calls = [], []
    real = fast.NativeDecoderStack.native_step

    def counted(self, *args):
        out = real(self, *args)
        calls.append(out is not None)
        return out

    for one_call, cache in zip((True, False), caches):
        step = AttentionMetadata(meta.seqs, meta.query_lens, meta.context_lens, meta.block_tables, 8)
        cache.bind(step)
        fast.NativeDecoderStack.native_step = counted if one_call else (lambda *args: None)
        try:
            with torch.inference_mode():
                outputs.append(model(ids, step.positions, cache).float())
        finally:
            fast.NativeDecoderStack.native_step = real
            cache.unbind()
    assert calls == [True]                                   # the first forward ran as one native call
    tolerance = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(outputs[0], outputs[1], atol=tolerance, rtol=tolerance)
    for layer in range(cfg.n_layers):
        torch.testing.assert_close(caches[0].k[layer].float(), caches[1].k[layer].float(), atol=tolerance,
                                   rtol=tolerance)
        torch.testing.assert_close(caches[0].v[layer].float(), caches[1].v[layer].float(), atol=tolerance,
                                   rtol=tolerance)


def test_every_engine_step_is_one_native_call(native_calls):
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    params = SamplingParams(max_new_tokens=5)
    refs = [llminfer.generate(model, p, max_new_tokens=5).token_ids for p in prompts]
    engine = LLMEngine(model, block_size=8, max_num_seqs=8, max_num_batched_tokens=64, optimize=True)
    assert [o.token_ids for o in engine.generate(prompts, params)] == refs
    assert len(native_calls) == engine.stats.steps
    # decode steps always; the prefill chunks too where the blocked kernel runs (AVX2)
    assert all(native_calls) if cpu.blocked_prefill(torch.float32) else any(native_calls)
    assert engine.cache.kernel_name == "native"


def test_the_optimised_engine_leaves_the_callers_model_as_it_was():
    model = random_model(SMALL_CONFIGS["qwen2-bias-gqa"])
    before = {name: (p.data_ptr(), p.clone()) for name, p in model.named_parameters()}
    classes = [type(m) for m in model.modules()]
    backend = model.attn_backend
    engine = LLMEngine(model, block_size=16, max_num_seqs=4, optimize=True)
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3))
    assert engine.model is not model and fast.is_fused(engine.model) and fast.uses_native_kernels(engine.model)
    assert not fast.is_fused(model) and not fast.uses_native_kernels(model)
    assert [type(m) for m in model.modules()] == classes and model.attn_backend == backend
    for name, p in model.named_parameters():
        pointer, values = before[name]
        assert p.data_ptr() == pointer and torch.equal(p, values), name


def test_a_copy_shares_the_weights_no_transform_touches():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    copied = optimized_copy(model)
    assert copied.lm_head.weight is copied.embed_tokens.weight                 # the tie holds in the copy
    assert model.lm_head.weight is model.embed_tokens.weight
    shared = {p.untyped_storage().data_ptr() for p in model.parameters()} & \
        {p.untyped_storage().data_ptr() for p in copied.parameters()}
    # the small test model stays off huge pages (under 8 MiB): its norms and o/down projections are shared
    assert copied.layers[0].self_attn.o_proj.weight.untyped_storage().data_ptr() in shared
    assert copied.layers[0].self_attn.o_proj.weight is not model.layers[0].self_attn.o_proj.weight


def test_the_engine_prepares_its_stack_once_and_again_when_told_the_weights_changed(monkeypatch):
    """The runner prepares the stack for its pools when it is made; every step runs what was prepared. A weight
    changed afterwards is the caller's to announce (`load_weights`), which the next step prepares again."""
    made = []

    class Counted(fast.PreparedStack):
        def __init__(self, *args):
            made.append(1)
            super().__init__(*args)

    monkeypatch.setattr(fast, "PreparedStack", Counted)
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    params = SamplingParams(max_new_tokens=6)
    refs = [llminfer.generate(model, p, max_new_tokens=6).token_ids for p in prompts]
    engine = LLMEngine(model, block_size=8, max_num_seqs=4, optimize=True)
    stack = engine.model.layers
    assert len(made) == 1 and stack.prepare(engine.cache).holds(engine.cache.k, engine.cache.v)
    for _ in range(2):
        assert [o.token_ids for o in engine.generate(prompts, params)] == refs
    assert len(made) == 1 and engine.stats.steps > 2           # every step ran the one prepared stack

    down = stack[0].mlp.down_proj
    with torch.no_grad():                                  # a weight's storage moved (.data rebound) ...
        down.weight.data = down.weight.data.clone()
    stack.load_weights()                                   # ... and the caller says so
    assert [o.token_ids for o in engine.generate(prompts, params)] == refs
    assert len(made) == 2 and stack.weights[0].down.weight is down.weight

    norm = stack[1].input_layernorm                        # a module replaced: read when the caller says so
    replacement = llminfer.model.RMSNorm(norm.weight.shape[0], norm.eps)
    with torch.no_grad():
        replacement.weight.copy_(norm.weight)
    stack[1].input_layernorm = replacement
    assert stack.weights[1].input_norm is norm.weight
    stack.load_weights()
    assert stack.weights[1].input_norm is replacement.weight
    assert [o.token_ids for o in engine.generate(prompts, params)] == refs and len(made) == 3


@pytest.mark.parametrize("optimize", [False, True])
def test_the_head_runs_only_on_the_rows_that_are_sampled(optimize):
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    engine = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=12,
                       optimize=optimize)
    seen = []
    handle = engine.model.lm_head.register_forward_hook(lambda module, args, out: seen.append(
        (tuple(args[0].shape), tuple(out.shape))))
    try:
        a = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4))
        engine.step()                                     # a's whole prompt: 3 rows, the last one sampled
        b = engine.add_request(list(range(10, 30)), SamplingParams(max_new_tokens=2))    # 20 tokens: chunked
        c = engine.add_request([40, 41], SamplingParams(max_new_tokens=2))
        engine.step()                                     # a's decode and b's first 11: b's chunk samples nothing
        engine.step()                                     # a's decode, b's last 9, c's 2: three rows sampled of 12
    finally:
        handle.remove()
    steps = [record.entries for record in engine.trace]
    assert steps == [((a, "prefill", 3),), ((a, "decode", 1), (b, "prefill", 11)),
                     ((a, "decode", 1), (b, "prefill", 9), (c, "prefill", 2))]
    dim, vocab = model.config.dim, model.config.vocab_size
    assert seen == [((1, 1, dim), (1, 1, vocab)), ((1, 1, dim), (1, 1, vocab)), ((1, 3, dim), (1, 3, vocab))]
