"""A layer stack in one native call a step (llminfer.fast.NativeDecoderStack over the contract of llminfer.cpu.stack:
a stack prepared once with its weights by name, the op `run_stack` for contiguous or paged K/V) against the same model
run module by module."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import llminfer
from llminfer import fast
from llminfer.cuda_graphs import StaticDecoder
from llminfer import cpu
from llminfer.cpu.stack import LAYER_TENSORS, Activations, CacheKind, PreparedStack, layer_arguments
from llminfer.engine.paged_cache import PagedKVCache
from llminfer.model import DecoderLayer, DecoderStack
from llminfer.quant.kv_cache import Int8KVCache
from llminfer.static_cache import StaticKVCache

from small_models import SMALL_CONFIGS, random_model


def _pair(name: str | llminfer.ModelConfig, fmt: str):
    """(reference, native): the same weights (of a small model by name, or of a config), the reference run module
    by module with torch's kernels."""
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    config = SMALL_CONFIGS[name] if isinstance(name, str) else name
    reference, native = (random_model(config).to(dtype) for _ in range(2))
    if fmt in ("int8", "int4"):
        for model, kernel in ((reference, "dequantize"), (native, "native")):
            llminfer.quant.quantize(model, fmt, group_size=32 if fmt == "int4" else None, kernel=kernel)
    fast.optimize_decode(native)
    return reference, native


CASES = [("llama-gqa-tied", "fp32"), ("qwen2-bias-gqa", "fp32"), ("llama-mha-untied", "fp32"),
         ("llama3-rope-scaling", "fp32"), ("llama-gqa-tied", "bf16"), ("qwen2-bias-gqa", "bf16"),
         ("llama-gqa-tied", "int8"), ("qwen2-bias-gqa", "int8"), ("llama-gqa-tied", "int4")]


@pytest.mark.parametrize("name,fmt", CASES)
def test_one_call_per_step_gives_the_modules_numbers(name, fmt, native_calls):
    reference, native = _pair(name, fmt)
    assert type(native.layers) is fast.NativeDecoderStack
    assert all(type(layer) is DecoderLayer for layer in native.layers)
    assert len(native.layers.weights) == reference.config.n_layers      # every layer's weights, read by name
    assert list(native.state_dict()) == list(fast.fuse_projections(copy.deepcopy(reference)).state_dict())
    vocab = reference.config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, vocab, (2, 11), generator=g)
    # float32 agrees to rounding; bfloat16 rounds where the modules round, to within a few of its steps
    tolerance = {"fp32": 2e-4, "bf16": 6e-2, "int8": 2e-4, "int4": 2e-4}[fmt]
    with torch.inference_mode():
        ref_cache, nat_cache = reference.new_cache(2, 40), native.new_cache(2, 40)
        torch.testing.assert_close(native(prompt, cache=nat_cache), reference(prompt, cache=ref_cache),
                                   atol=tolerance, rtol=tolerance)
        # 22 tokens, a prefill: one call too, where the blocked kernel runs (AVX2; for bfloat16, no bfloat16 hardware)
        assert native_calls == [cpu.blocked_prefill(reference.dtype)]
        for n_new in (1, 3, 2, 1):                           # decode steps and short verification runs
            ids = torch.randint(0, vocab, (2, n_new), generator=g)
            got, expected = native(ids, cache=nat_cache), reference(ids, cache=ref_cache)
            torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
        assert native_calls[1:] == [True] * 4
        assert nat_cache.length == ref_cache.length == 18
        for layer in (0, reference.config.n_layers - 1):     # the K/V each step wrote, position by position
            torch.testing.assert_close(nat_cache.get(layer)[0], ref_cache.get(layer)[0], atol=tolerance, rtol=tolerance)
            torch.testing.assert_close(nat_cache.get(layer)[1], ref_cache.get(layer)[1], atol=tolerance, rtol=tolerance)


# head size 16 (the prefill attention's blocks need a multiple of 16) and an MLP of 104 (SwiGLU's 16-lane pass then
# leaves 8 for the 8-lane one)
LONG_PROMPT_CONFIG = llminfer.ModelConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=104,
                                          max_seq_len=512)


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
@pytest.mark.parametrize("batch,length", [(1, 40), (2, 20)])
def test_a_long_prompt_gives_the_modules_numbers(fmt, batch, length, native_calls):
    """Prompts of 16 tokens or more: with AVX-512 the prompt's attention runs in blocks of 16 positions (a last block
    of 8 for 40 tokens, of 4 for 20), RoPE, the norms and SwiGLU in their vector passes; then decode steps."""
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    reference, native = (random_model(LONG_PROMPT_CONFIG).to(dtype) for _ in range(2))
    fast.optimize_decode(native)
    tolerance = {"fp32": 2e-4, "bf16": 6e-2}[fmt]
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, LONG_PROMPT_CONFIG.vocab_size, (batch, length), generator=g)
    with torch.inference_mode():
        ref_cache, nat_cache = reference.new_cache(batch, 64), native.new_cache(batch, 64)
        torch.testing.assert_close(native(prompt, cache=nat_cache), reference(prompt, cache=ref_cache),
                                   atol=tolerance, rtol=tolerance)
        for _ in range(3):
            ids = torch.randint(0, LONG_PROMPT_CONFIG.vocab_size, (batch, 1), generator=g)
            torch.testing.assert_close(native(ids, cache=nat_cache), reference(ids, cache=ref_cache),
                                       atol=tolerance, rtol=tolerance)
    assert native_calls == [cpu.blocked_prefill(dtype, batch * length)] + [True] * 3


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_a_prompt_whose_products_go_in_groups_of_tokens_gives_the_modules_numbers(fmt, native_calls):
    """400 tokens through one layer of SmolLM2-135M's widths: every product's outputs outgrow the blocked kernel's
    budget for chunks of inputs, so its tokens go in groups (with float32 tiles, for every format but bfloat16: four,
    of 128, 128, 128 and 16 tokens, each taking its 576 inputs at once, and for down's 1536 inputs seven of 64, each
    in two chunks; in bfloat16 224 and 176, and four for down), SwiGLU taken from the tiles or panels group by
    group."""
    config = llminfer.ModelConfig(vocab_size=97, dim=576, n_layers=1, n_heads=9, n_kv_heads=3, hidden_dim=1536,
                                  max_seq_len=416)
    reference, native = _pair(config, fmt)
    prompt = torch.randint(0, config.vocab_size, (1, 400), generator=torch.Generator().manual_seed(5))
    tolerance = 6e-2 if fmt == "bf16" else 2e-4
    with torch.inference_mode(), cpu.force_prefill("blocked"):
        ref_cache, nat_cache = reference.new_cache(1, 416), native.new_cache(1, 416)
        torch.testing.assert_close(native(prompt, cache=nat_cache), reference(prompt, cache=ref_cache),
                                   atol=tolerance, rtol=tolerance)
        for got, expected in zip(nat_cache.get(0), ref_cache.get(0)):
            torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    assert native_calls == [True]


@pytest.mark.parametrize("batch,length", [(2, 40), (1, 33)])
def test_swiglu_taken_by_the_blocked_kernel_gives_the_bits_of_the_product_and_swiglu_apart(batch, length,
                                                                                           native_calls):
    """A bfloat16 prefill whose MLP width is a multiple of 24 takes SwiGLU in the blocked kernel's panels (where
    AVX512-BF16 runs): each group of 24 gate rows with its 24 up rows, the gate's and up's outputs never written; with
    AMX tiles, a multiple of 16 takes it from the tiles, 16 gate rows and their 16 up rows a block. The same model
    widened by 8 rows of zeros (gate and up rows, down columns: silu(0)·0 = 0 adds nothing) fits neither, so it runs
    the product and then SwiGLU over its rows, and must give the same bits: logits and K/V.
    80 and 33 rows: whole and partial token tiles, and an odd last token."""
    narrow_config = LONG_PROMPT_CONFIG.replace(hidden_dim=96)
    narrow = random_model(narrow_config).to(torch.bfloat16)
    wide = llminfer.Transformer(narrow_config.replace(hidden_dim=104)).to(torch.bfloat16).eval()
    state = narrow.state_dict()
    with torch.no_grad():
        for name, param in wide.state_dict().items():
            param.zero_()
            value = state[name]
            param[tuple(slice(0, n) for n in value.shape)] = value
    prompt = torch.randint(0, narrow_config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = narrow(prompt)
        assert torch.equal(wide(prompt), expected)               # the modules: the padding changes nothing
        runs = []
        for model in (narrow, wide):
            fast.optimize_decode(model)
            cache = model.new_cache(batch, 64)
            with cpu.force_prefill("blocked"):
                runs.append((model(prompt, cache=cache), [cache.get(layer) for layer in range(2)]))
    assert native_calls == [True, True]
    (logits, kv), (wide_logits, wide_kv) = runs
    torch.testing.assert_close(logits, expected, atol=6e-2, rtol=6e-2)
    assert torch.equal(logits, wide_logits)
    assert all(torch.equal(a, b) for pair, other in zip(kv, wide_kv) for a, b in zip(pair, other))


THREAD_CASES = [("llama-gqa-tied", "fp32"), ("qwen2-bias-tied", "fp32"), ("qwen2-bias-gqa", "bf16"),
                ("llama-mha-untied", "bf16"), ("llama-gqa-tied", "int8"), ("llama-gqa-tied", "int4"),
                ("qwen2-bias-gqa", "int4a8")]


@pytest.mark.parametrize("name,fmt", THREAD_CASES)
def test_the_steps_threads_share_the_layers_without_changing_a_bit(name, fmt, native_calls):
    """A decode step's few tokens run every layer in one parallel region: each thread its rows of each product
    and its K/V heads of attention. One thread, two, and more threads than K/V heads (qwen2-bias-tied has one,
    llama-gqa-tied two) give the same bits, logits and caches, as each row and head is computed the same way:
    also past 64 positions, where attention once split a query's keys into blocks by the number of threads."""
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    model = random_model(SMALL_CONFIGS[name]).to(dtype)
    if fmt.startswith("int"):
        llminfer.quant.quantize(model, "int4" if fmt.startswith("int4") else "int8",
                                group_size=32 if fmt.startswith("int4") else None,
                                activations="int8" if fmt == "int4a8" else "float")
    fast.optimize_decode(model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, vocab, (2, 70), generator=g)
    steps = [torch.randint(0, vocab, (2, n), generator=g) for n in (1, 3, 1, 2)]
    runs = _decode_at_threads(model, prompt, steps, 80, (1, 2, 5))
    assert native_calls[-4:] == [True] * 4                     # the steps ran as one call each
    _assert_the_same_bits(runs)


def _decode_at_threads(model, prompt, steps, cache_len: int, thread_counts) -> list[tuple[list, list]]:
    """For each thread count: the logits of the prompt and of each step (a cache of cache_len positions), and the
    cache's K/V of every layer after them."""
    runs = []
    saved = torch.get_num_threads()
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            with torch.inference_mode():
                cache = model.new_cache(prompt.shape[0], cache_len)
                logits = [model(prompt, cache=cache)] + [model(ids, cache=cache) for ids in steps]
            runs.append((logits, [cache.get(layer) for layer in range(model.config.n_layers)]))
    finally:
        torch.set_num_threads(saved)
    return runs


def _assert_the_same_bits(runs) -> None:
    for logits, kv in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(logits, runs[0][0]))
        assert all(torch.equal(a, b) for pair, first in zip(kv, runs[0][1]) for a, b in zip(pair, first))


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_a_long_cache_shares_attention_by_blocks_of_keys_without_changing_a_bit(fmt, native_calls):
    """From SPLIT_KEYS cached positions on, a decode step's threads share its attention by blocks of keys, every
    K/V head's, instead of by heads: each block's parts are merged in order, so one thread, two and three give the
    same bits (the step's steps of 1 and 3 tokens of 2 sequences), and the modules' numbers to rounding."""
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    config = LONG_PROMPT_CONFIG.replace(max_seq_len=cpu.SPLIT_KEYS + 64)
    reference, native = (random_model(config).to(dtype) for _ in range(2))
    fast.optimize_decode(native)
    g = torch.Generator().manual_seed(13)
    prompt = torch.randint(0, config.vocab_size, (2, cpu.SPLIT_KEYS - 2), generator=g)
    # the first step's 1023 keys by heads, then 1026 and 1027 by blocks
    steps = [torch.randint(0, config.vocab_size, (2, n), generator=g) for n in (1, 3, 1)]
    tolerance = {"fp32": 2e-4, "bf16": 6e-2}[fmt]
    runs = _decode_at_threads(native, prompt, steps, config.max_seq_len, (1, 2, 3))
    assert native_calls[-len(steps):] == [True] * len(steps)  # the steps ran as one call each
    assert torch.ops.llminfer.split_keys() == cpu.SPLIT_KEYS   # the kernels were built with the threshold used here
    _assert_the_same_bits(runs)
    with torch.inference_mode():
        cache = reference.new_cache(2, config.max_seq_len)
        reference(prompt, cache=cache)
        for ids, got in zip(steps, runs[1][0][1:]):
            torch.testing.assert_close(got, reference(ids, cache=cache), atol=tolerance, rtol=tolerance)


def test_greedy_decoding_picks_the_same_tokens(native_calls):
    reference, native = _pair("llama-gqa-tied", "fp32")
    ids = torch.randint(0, reference.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    expected = llminfer.generate(reference, ids, max_new_tokens=20).token_ids
    assert llminfer.generate(native, ids, max_new_tokens=20).token_ids == expected
    # every decode step was one call, and the prefill too where the blocked kernel runs
    assert native_calls == [cpu.blocked_prefill()] + [True] * 19


PREFILL_CASES = [("llama-gqa-tied", "fp32"), ("qwen2-bias-gqa", "fp32"), ("llama3-rope-scaling", "fp32"),
                 ("llama-gqa-tied", "bf16"), ("qwen2-bias-gqa", "int8"), ("llama-gqa-tied", "int4")]


@pytest.mark.parametrize("name,fmt", PREFILL_CASES)
def test_a_prefill_runs_in_one_call(name, fmt, native_calls):
    """A prompt of many tokens, then more prompt on top of it (a chunked prefill), then decode: the stack takes
    each in one call, its products by the blocked kernel (quantized and bfloat16 rows widened to float32 a
    block at a time), and every position's logits and the K/V written agree with the modules."""
    reference, native = _pair(name, fmt)
    tolerance = {"fp32": 2e-4, "bf16": 6e-2, "int8": 2e-4, "int4": 2e-4}[fmt]
    vocab = reference.config.vocab_size
    g = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        ref_cache, nat_cache = reference.new_cache(2, 160), native.new_cache(2, 160)
        for n_new in (100, 37, 1):
            ids = torch.randint(0, vocab, (2, n_new), generator=g)
            torch.testing.assert_close(native(ids, cache=nat_cache), reference(ids, cache=ref_cache),
                                       atol=tolerance, rtol=tolerance)
        for layer in range(reference.config.n_layers):
            for i in (0, 1):
                torch.testing.assert_close(nat_cache.get(layer)[i], ref_cache.get(layer)[i], atol=tolerance,
                                           rtol=tolerance)
    assert native_calls == [cpu.blocked_prefill(reference.dtype)] * 2 + [True]
    # the static decoder's prefill takes it too, and gives the modules' last logits
    prompt = torch.randint(0, vocab, (1, 70), generator=g)
    decoder = StaticDecoder(native, max_seq_len=96)
    with torch.inference_mode():
        torch.testing.assert_close(decoder.prefill(prompt), reference(prompt)[:, -1], atol=tolerance, rtol=tolerance)
    assert native_calls[-1] is cpu.blocked_prefill(reference.dtype)


@pytest.mark.parametrize("torch_faster", [False, True])
def test_a_bfloat16_prefill_takes_torchs_matmul_where_it_measured_faster(monkeypatch, native_calls, torch_faster):
    """Where torch's bfloat16 matmul measured faster than the blocked kernel (a CPU with AVX512-BF16 or AMX, say),
    a bfloat16 prefill runs the modules; decode steps and other formats are unchanged."""
    vector = cpu.isa() != "portable"
    monkeypatch.setattr(cpu, "prefill_path", lambda dtype=torch.float32, rows=128: "torch" if not vector or (
        torch_faster and dtype == torch.bfloat16) else "blocked")
    assert cpu.blocked_prefill(torch.float32) is vector and cpu.blocked_prefill(torch.int8) is vector
    blocked_bf16 = vector and not torch_faster
    assert cpu.blocked_prefill(torch.bfloat16, 40) is blocked_bf16
    reference, native = _pair("llama-gqa-tied", "bf16")
    vocab = reference.config.vocab_size
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        ref_cache, nat_cache = reference.new_cache(2, 64), native.new_cache(2, 64)
        for n_new in (40, 1):                                     # a prefill, then a decode step
            ids = torch.randint(0, vocab, (2, n_new), generator=g)
            torch.testing.assert_close(native(ids, cache=nat_cache), reference(ids, cache=ref_cache),
                                       atol=6e-2, rtol=6e-2)
    assert native_calls == [blocked_bf16, True]
    head = native.lm_head                                         # a NativeLinear with bfloat16 weights
    calls = []
    real = cpu.gemv
    monkeypatch.setattr(cpu, "gemv", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    with torch.inference_mode():
        head(torch.randn(1, 20, head.in_features, dtype=torch.bfloat16))
        head(torch.randn(1, 2, head.in_features, dtype=torch.bfloat16))
    assert calls == ([20] if blocked_bf16 else []) + [2]


def test_a_static_cache_step_and_the_modules_step():
    """The compiled decoder's static cache (explicit positions), and the same step through the modules."""
    reference, native = _pair("qwen2-bias-gqa", "fp32")
    ids = torch.randint(0, reference.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ref_cache = reference.new_cache(1, 16)
        reference(ids, cache=ref_cache)
        expected = reference(ids[:, :1], cache=ref_cache)
        cache = StaticKVCache.for_model(native, 1, 16)
        native(ids, cache=cache)
        got = native(ids[:, :1], positions=torch.tensor([6]), cache=cache)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
        # the same step through the modules (native products and attention, a call each)
        cache = native.new_cache(1, 16)
        native(ids, cache=cache)
        native.layers = DecoderStack(native.layers)
        got = native(ids[:, :1], cache=cache)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


def test_what_the_one_call_cannot_take_runs_the_modules(native_calls):
    reference, native = _pair("llama-gqa-tied", "fp32")
    vocab = reference.config.vocab_size
    ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(5))

    def step(model, cache, **kw):
        model(ids, cache=cache, **kw)
        return model(ids[:, :1], cache=cache, **kw)

    with torch.inference_mode():
        expected = step(reference, reference.new_cache(1, 16))
        # an int8 KV cache has no slots to hand over
        c = native.config
        torch.testing.assert_close(step(native, Int8KVCache(c.n_layers, 1, c.n_kv_heads, 16, c.head_dim)),
                                   step(reference, Int8KVCache(c.n_layers, 1, c.n_kv_heads, 16, c.head_dim)),
                                   atol=2e-4, rtol=2e-4)
        # another attention backend: the modules call it
        native.set_attention_backend("explicit")
        torch.testing.assert_close(step(native, native.new_cache(1, 16)), expected, atol=2e-4, rtol=2e-4)
        native.set_attention_backend("native")
        # no cache at all
        torch.testing.assert_close(native(ids[:, :1]), reference(ids[:, :1]), atol=2e-4, rtol=2e-4)
    assert not any(native_calls)
    # autograd needs the modules too
    x = native(ids[:, :1], cache=native.new_cache(1, 16))
    assert x.requires_grad and native_calls[-1] is False
    with torch.inference_mode():
        step(native, native.new_cache(1, 16))
    assert native_calls[-1] is True


def test_the_stack_keeps_its_class_when_sliced():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    assert type(model.layers) is DecoderStack and type(model.layers[:2]) is DecoderStack
    fast.optimize_decode(model)
    assert type(model.layers[1:]) is fast.NativeDecoderStack


def _prepared_over_static_cache(native, max_seq_len=16):
    """(stack, cache, x, cos, sin): native's stack prepared over a static cache at position 3 of a one-token step."""
    cache = StaticKVCache.for_model(native, 1, max_seq_len)
    cos, sin = native.rope_tables(max_seq_len)
    x = torch.randn(1, 1, native.config.dim, generator=torch.Generator().manual_seed(0))
    return native.layers.prepare(cache), cache, x, cos[3:4], sin[3:4]


def test_bad_inputs_to_the_stack_ops_name_the_sizes():
    _, native = _pair("llama-gqa-tied", "fp32")
    stack = native.layers
    prepared, cache, x, cos, sin = _prepared_over_static_cache(native)
    with torch.inference_mode():
        assert prepared.step(x, cos, sin, torch.tensor([3])).shape == x.shape
        with pytest.raises(RuntimeError, match="position 16 is outside the cache's 0..15"):
            prepared.step(x, cos, sin, torch.tensor([16]))
        with pytest.raises(RuntimeError, match="dtype"):
            prepared.step(x.bfloat16(), cos, sin, torch.tensor([3]))
        with pytest.raises(RuntimeError, match="contiguous caches takes no block tables"):
            prepared.step(x, cos, sin, torch.tensor([3]), torch.tensor([0]), torch.zeros(1, 2, dtype=torch.long))
        weights = stack.weights
        swapped = [dataclasses.replace(weights[0], qkv=weights[0].o)] + weights[1:]   # o's weight where qkv's goes
        with pytest.raises(RuntimeError, match="do not fit dim"):
            PreparedStack(swapped, *stack.heads, CacheKind.CONTIGUOUS, cache.k, cache.v).step(
                x, cos, sin, torch.tensor([3]))
        int8_on_float = [dataclasses.replace(weights[0], o=dataclasses.replace(weights[0].o,
                                                                               activations=Activations.INT8))]
        with pytest.raises(RuntimeError, match="o.weight's activations are 1; they are 0 \\(float\\) or, for int4"):
            PreparedStack(int8_on_float + weights[1:], *stack.heads, CacheKind.CONTIGUOUS, cache.k, cache.v).step(
                x, cos, sin, torch.tensor([3]))
        paged = PagedKVCache.for_model(native, 8, 4)
        over_pool = PreparedStack(weights, *stack.heads, CacheKind.PAGED, paged.k, paged.v)
        with pytest.raises(RuntimeError, match="a paged pool needs token_seq and block_tables"):
            over_pool.step(x, cos, sin, torch.tensor([3]))


def test_prepare_stack_refuses_fields_that_do_not_describe_the_layers():
    k = [torch.zeros(1, 2, 8, 16)] * 2
    with pytest.raises(RuntimeError, match="2 K caches, 2 V caches, 3 tensors, 4 epsilons and 8 activation formats do "
                                           "not describe the same number of layers \\(15 tensors"):
        torch.ops.llminfer.prepare_stack([None] * 3, [1e-5] * 4, [0] * 8, 4, 0.25, 0, k, k)
    with pytest.raises(RuntimeError, match="cache_kind 2 is 0 \\(contiguous caches\\) or 1 \\(a paged pool\\)"):
        torch.ops.llminfer.prepare_stack([None] * 30, [1e-5] * 4, [0] * 8, 4, 0.25, 2, k, k)
    with pytest.raises(ValueError, match="2 layers need as many K and V caches, got 1 and 1"):
        PreparedStack([None, None], 4, 16, CacheKind.CONTIGUOUS, k[:1], k[:1])


@pytest.mark.parametrize("fmt", ["fp32", "int4a8"])
def test_a_layer_crosses_as_named_fields_in_one_order(fmt):
    """The fields' order is written once on each side: the kernels give back LAYER_TENSORS' names; a product's
    activations are a field of their own (W4A8: INT8), not a tensor passed twice."""
    assert torch.ops.llminfer.layer_fields() == list(LAYER_TENSORS)
    model = random_model(SMALL_CONFIGS["qwen2-bias-gqa"])
    if fmt == "int4a8":
        llminfer.quant.quantize(model, "int4", group_size=32, activations="int8")
    stack = fast.optimize_decode(model).layers
    tensors, eps, activations = layer_arguments(stack.weights)
    n_layers = model.config.n_layers
    assert len(tensors) == len(LAYER_TENSORS) * n_layers and len(eps) == 2 * n_layers
    assert activations == [int(Activations.INT8 if fmt == "int4a8" else Activations.FLOAT)] * 4 * n_layers
    first = dict(zip(LAYER_TENSORS, tensors))
    layer = model.layers[0]
    assert first["input_norm"] is layer.input_layernorm.weight and first["qkv_bias"] is layer.self_attn.qkv_proj.bias
    assert all(first[f"{p}.scale"] is None for p in ("qkv", "o", "gate_up", "down")) == (fmt == "fp32")
    present = [id(t) for t in tensors if t is not None]
    assert len(present) == len(set(present))                           # no tensor twice


@pytest.mark.parametrize("masked", [False, True])
def test_attention_over_many_key_blocks(masked):
    """A long cache is split into key blocks over the threads and merged (the online softmax)."""
    g = torch.Generator().manual_seed(11)
    q, k, v = torch.randn(2, 6, 2, 32, generator=g), torch.randn(2, 3, 700, 32, generator=g), \
        torch.randn(2, 3, 700, 32, generator=g)
    mask = torch.rand(2, 1, 2, 700, generator=g) > 0.3 if masked else None
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cpu.decode_attention(q, k, v, mask)
    finally:
        torch.set_num_threads(threads)
    if mask is None:
        mask = torch.ones(2, 700, dtype=torch.bool).tril(698)[None, None]
    reference = llminfer.attention.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=False,
                                             mask=mask)[0]
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)


def _ops_of_a_step(decoder) -> set[str]:
    from torch.profiler import profile

    with profile() as prof:
        decoder.step(decoder.token, decoder.position)
    return {event.key for event in prof.key_averages() if event.key.startswith("llminfer::")}


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_the_compiled_step_runs_the_stack_in_one_call(fmt, native_calls):
    reference, native = _pair("llama-gqa-tied", fmt)
    ids = torch.randint(0, reference.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(9))
    decoder = fast.compile_decode(native, max_seq_len=32)
    assert True in native_calls                              # traced once, into the graph
    # the stack's weights and the decoder's caches were prepared before tracing: the step hands over x, not them
    assert isinstance(decoder._prepared_stack, PreparedStack) and decoder._prepared_stack.holds(decoder.cache.k,
                                                                                                 decoder.cache.v)
    assert "llminfer::run_stack" in _ops_of_a_step(decoder)
    assert decoder.generate(ids, max_new_tokens=12).token_ids == \
        llminfer.generate(reference, ids, max_new_tokens=12).token_ids
    assert native.layers._pinned is None                     # left as it was


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_a_compiled_decoders_prefill_runs_the_stack_where_the_blocked_kernel_does(fmt):
    """The prefill of a compiled decoder runs the stack prepared for its cache, with the numbers and cache writes of
    a prefill over a cache of its own; and the modules where the prefill path is torch's."""
    from torch.profiler import profile

    from llminfer.generate import prefill

    _, native = _pair("llama-gqa-tied", fmt)
    ids = torch.randint(0, native.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(4))
    decoder = fast.compile_decode(native, max_seq_len=32)
    for path, native_call in (("blocked", True), ("torch", False)):
        with cpu.force_prefill(path):
            with profile() as prof:
                got = decoder.prefill(ids)
            ops = {event.key for event in prof.key_averages() if event.key.startswith("llminfer::")}
            assert ("llminfer::run_stack" in ops) is native_call, (path, ops)
            cache = StaticKVCache.for_model(native, 1, 32)
            expected = prefill(native, ids, cache)
        assert torch.equal(got, expected), path
        for mine, theirs in zip(decoder.cache.k + decoder.cache.v, cache.k + cache.v):
            assert torch.equal(mine[:, :, :20], theirs[:, :, :20])


def test_a_step_left_unspecialised_runs_the_prepared_stack_too():
    _, native = _pair("llama-gqa-tied", "fp32")
    decoder = StaticDecoder(native, max_seq_len=32, mode="compiled", specialize=False)
    decoder.warmup()
    assert isinstance(decoder._prepared_stack, PreparedStack)
    assert "llminfer::run_stack" in _ops_of_a_step(decoder)


def test_a_prepared_stack_gives_the_modules_numbers_and_writes_only_its_position():
    reference, native = _pair("qwen2-bias-gqa", "fp32")
    g = torch.Generator().manual_seed(3)
    cache = StaticKVCache.for_model(native, 1, 24)
    for layer_k, layer_v in zip(cache.k, cache.v):           # an earlier prompt already in the cache
        layer_k.normal_(generator=g)
        layer_v.normal_(generator=g)
    theirs, before = copy.deepcopy(cache), copy.deepcopy(cache)
    x = torch.randn(1, 1, native.config.dim, generator=g)
    cos, sin = native.rope_tables(24)
    position = torch.tensor([9])
    with torch.inference_mode():
        prepared = native.layers.prepare(cache)
        assert prepared is native.layers.prepare(cache)       # once per cache
        got = prepared.step(x, cos[9:10], sin[9:10], position)
        theirs.begin(1, 1, position)
        expected = DecoderStack(reference.layers)(x, cos[9:10], sin[9:10], theirs, reference._backend)
        theirs.end()
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    for mine, ref, was in zip(cache.k + cache.v, theirs.k + theirs.v, before.k + before.v):
        torch.testing.assert_close(mine, ref, atol=2e-4, rtol=2e-4)
        changed = (mine != was).any(-1).any(1)[0]             # (slots,): which positions the step wrote
        assert changed.nonzero().flatten().tolist() == [9]
    number = prepared.id
    native.layers.load_weights()                              # drops what was prepared
    del prepared                                              # the number goes with its object
    with pytest.raises(RuntimeError, match=f"no prepared stack {number} \\(released"):
        torch.ops.llminfer.run_stack(number, x, cos[9:10], sin[9:10], position)


PAGED_CASES = [("llama-gqa-tied", "fp32"), ("qwen2-bias-gqa", "bf16"), ("qwen2-bias-gqa", "int8"),
               ("llama-gqa-tied", "int4")]


@pytest.mark.parametrize("name,fmt", PAGED_CASES)
def test_a_paged_cache_runs_the_same_op_with_the_modules_numbers(name, fmt, native_calls):
    """The one op over a paged pool: a prompt, a chunk more and decode steps of one sequence in a PagedKVCache of
    blocks of 4 (its own block tables), every step one call, against the modules over a contiguous cache."""
    reference, native = _pair(name, fmt)
    tolerance = {"fp32": 2e-4, "bf16": 6e-2, "int8": 2e-4, "int4": 2e-4}[fmt]
    g = torch.Generator().manual_seed(17)
    ref_cache, pool = reference.new_cache(1, 40), PagedKVCache.for_model(native, 16, 4)
    with torch.inference_mode():
        for n_new in (11, 5, 1, 1, 2):
            ids = torch.randint(0, reference.config.vocab_size, (1, n_new), generator=g)
            torch.testing.assert_close(native(ids, cache=pool), reference(ids, cache=ref_cache), atol=tolerance,
                                       rtol=tolerance)
    assert native.layers.prepare(pool).kind is CacheKind.PAGED
    assert native_calls == [cpu.blocked_prefill(reference.dtype, 11)] + [True] * 4
    table = pool.block_tables[0]                              # the K/V each step wrote, read back through the table
    for layer in (0, reference.config.n_layers - 1):
        keys = pool.k[layer][table].reshape(-1, *pool.k[layer].shape[2:])[:20].transpose(0, 1)   # (H_kv, 20, D)
        torch.testing.assert_close(keys, ref_cache.get(layer)[0][0], atol=tolerance, rtol=tolerance)


def test_a_weight_change_is_seen_once_the_caller_loads_the_weights_again():
    """The stack reads its weights when it is made, and again when the caller says so (`load_weights`): a module
    replaced afterwards is not seen before that, and a weight whose memory moved (.data rebound) is refused."""
    reference, native = _pair("llama-gqa-tied", "fp32")
    ids = torch.randint(0, reference.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(8))

    def step(model):
        with torch.inference_mode():
            cache = model.new_cache(1, 16)
            model(ids, cache=cache)
            return model(ids[:, :1], cache=cache)

    before = step(reference)
    torch.testing.assert_close(step(native), before, atol=2e-4, rtol=2e-4)
    for model in (reference, native):                        # a module replaced: the second layer's input norm
        norm = model.layers[1].input_layernorm
        replacement = llminfer.model.RMSNorm(norm.weight.shape[0], norm.eps)
        with torch.no_grad():
            replacement.weight.copy_(norm.weight * 2)
        model.layers[1].input_layernorm = replacement
    after = step(reference)
    assert not torch.allclose(after, before, atol=1e-3)
    torch.testing.assert_close(step(native), before, atol=2e-4, rtol=2e-4)      # the weights it read
    native.layers.load_weights()
    torch.testing.assert_close(step(native), after, atol=2e-4, rtol=2e-4)       # read again: the new ones
    down = native.layers[0].mlp.down_proj
    with torch.inference_mode():
        cache = native.new_cache(1, 16)
        native(ids, cache=cache)
        with torch.no_grad():
            down.weight.data = down.weight.data.clone()       # the same values elsewhere in memory
        with pytest.raises(RuntimeError, match="has moved since it was prepared .*prepare the stack again"):
            native(ids[:, :1], cache=cache)
    native.layers.load_weights()
    torch.testing.assert_close(step(native), after, atol=2e-4, rtol=2e-4)
