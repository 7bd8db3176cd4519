"""The static decoder: its static step checked against decode_step, and the token loop it plugs into."""
import pytest
import torch

import llminfer
from llminfer.cuda_graphs import StaticDecoder
from llminfer.static_cache import StaticKVCache

TINY = llminfer.ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, hidden_dim=80,
                            max_seq_len=64)


def _model(device="cpu"):
    return llminfer.load_random(TINY, device=device, dtype=torch.float32, seed=3)


def test_static_step_matches_decode_step_on_cpu():
    model = _model()
    ids = torch.randint(0, TINY.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    reference = model.new_cache(2, max_seq_len=12)
    static = StaticDecoder(model, batch_size=2, max_seq_len=12)
    token = llminfer.prefill(model, ids, reference).argmax(-1)
    static.prefill(ids)
    for _ in range(7, 11):
        expected = llminfer.decode_step(model, token, reference)
        got = static.decode(token)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        token = expected.argmax(-1)
    assert static.cache.length == reference.length == 11 and isinstance(static.cache, StaticKVCache)
    # positions past the current one are masked: stale K/V there must not change the answer
    static.cache.truncate(10)
    reference.truncate(10)
    static.cache.k[0][:, :, 11:] = 1e3
    torch.testing.assert_close(static.decode(token), llminfer.decode_step(model, token, reference),
                               rtol=1e-4, atol=1e-4)
    static.decode(token)                                                  # the last of the 12 positions
    with pytest.raises(ValueError, match=r"cache is full \(12 positions\)"):
        static.decode(token)


def test_the_static_step_runs_the_model_s_own_forward():
    """A change to the model (here: its attention backend) reaches the static step: no second copy of a layer."""
    model = _model()
    calls = []

    def counting_backend(q, k, v, causal=True, mask=None, scale=None):
        calls.append(mask is not None)
        return llminfer.attention.fast_attention(q, k, v, causal=causal, mask=mask, scale=scale)
    llminfer.attention.register_backend("counting-test", counting_backend, replace=True)
    model.set_attention_backend("counting-test")
    StaticDecoder(model, max_seq_len=12).generate(torch.tensor([[1, 2, 3]]), 3)
    assert calls == [False] * TINY.n_layers + [True] * 2 * TINY.n_layers   # prefill, then two static steps


def test_the_decoder_is_a_step_of_the_one_token_loop(monkeypatch):
    """decoder.generate and generate(step=decoder) are the same loop: sampling, seeds, EOS, logits, timings."""
    model = _model()
    ids = torch.randint(0, TINY.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    decoder = StaticDecoder(model, max_seq_len=12)
    eager = llminfer.generate(model, ids, max_new_tokens=6, return_logits=True)
    result = decoder.generate(ids, 6, return_logits=True)
    assert isinstance(result, llminfer.GenerationResult)
    through_generate = llminfer.generate(model, ids, max_new_tokens=6, step=decoder)
    assert result.token_ids == eager.token_ids == through_generate.token_ids
    assert len(result.itl_s) == 5 and result.ttft_s > 0 and result.num_prompt_tokens == 5
    assert len(result.logits) == 6
    assert max(float((a - b).abs().max()) for a, b in zip(result.logits, eager.logits)) < 1e-4
    eos = eager.token_ids[2]
    assert decoder.generate(ids, 6, eos_token_id=eos).token_ids == eager.token_ids[:eager.token_ids.index(eos) + 1]
    sampled = dict(max_new_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=5)
    assert decoder.generate(ids, **sampled).token_ids == llminfer.generate(model, ids, **sampled).token_ids
    processed = dict(max_new_tokens=6, min_p=0.05, repetition_penalty=1.5, presence_penalty=0.4,
                     frequency_penalty=0.3)                              # chapter 13's processors, on greedy rows
    assert decoder.generate(ids, **processed).token_ids == llminfer.generate(model, ids, **processed).token_ids
    batch = torch.randint(0, TINY.vocab_size, (3, 4), generator=torch.Generator().manual_seed(2))
    assert StaticDecoder(model, batch_size=3, max_seq_len=12).generate(batch, 5).token_ids == \
        llminfer.generate(model, batch, max_new_tokens=5).token_ids
    # the loop does the sampling: a decoder only provides prefill and decode
    picked = []
    real = llminfer.generate.__globals__["sample_next"]
    monkeypatch.setitem(llminfer.generate.__globals__, "sample_next", lambda *a, **k: picked.append(1) or real(*a, **k))
    decoder.generate(ids, 4)
    assert picked == [1] * 4


def test_bad_requests_are_refused_before_compute():
    model = _model()
    ids = torch.randint(0, TINY.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    decoder = StaticDecoder(model, max_seq_len=8)
    with pytest.raises(ValueError, match="need 10 cache positions, the decoder's cache holds 8"):
        decoder.generate(ids, 6)
    with pytest.raises(ValueError, match="at least one token"):
        decoder.generate(ids, 0)
    with pytest.raises(ValueError, match="built for batch_size=1, got 2"):
        llminfer.generate(model, ids.repeat(2, 1), max_new_tokens=2, step=decoder)
    with pytest.raises(ValueError, match="use_cache=False"):
        llminfer.generate(model, ids, max_new_tokens=2, step=decoder, use_cache=False)
    with pytest.raises(ValueError, match="mode must be one of eager, compiled, graph"):
        StaticDecoder(model, mode="fast")
    assert decoder.cache.length == 0


def test_graph_mode_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA model"):
        StaticDecoder(_model(), max_seq_len=8, mode="graph")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_matches_eager_generation_on_cuda():
    model = _model("cuda")
    ids = torch.randint(0, TINY.vocab_size, (1, 9), device="cuda")
    decoder = StaticDecoder(model, max_seq_len=24, mode="graph")
    result = decoder.generate(ids, 12, return_logits=True)
    eager = llminfer.generate(model, ids, max_new_tokens=12, return_logits=True)
    assert result.token_ids == eager.token_ids and len(result.itl_s) == 11 and decoder.graph is not None
    # the graph's output buffer is reused by every replay: the loop kept a copy of each step's logits
    assert max(float((a - b).abs().max()) for a, b in zip(result.logits, eager.logits)) < 1e-3
    assert decoder.generate(ids, 12).token_ids == eager.token_ids          # the captured graph replays again
