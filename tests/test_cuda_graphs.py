"""The static-shape decode step behind the CUDA-graph contender, checked against decode_step."""
import pytest
import torch

import llminfer
from llminfer.cuda_graphs import GraphedDecoder

TINY = llminfer.ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, hidden_dim=80,
                            max_seq_len=64)


def _model(device="cpu"):
    return llminfer.load_random(TINY, device=device, dtype=torch.float32, seed=3)


def test_static_step_matches_decode_step_on_cpu():
    model = _model()
    ids = torch.randint(0, TINY.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    reference = model.new_cache(2, max_seq_len=12)
    graphed = GraphedDecoder(model, batch_size=2, max_seq_len=12)
    token = llminfer.prefill(model, ids, reference).argmax(-1)
    llminfer.prefill(model, ids, graphed.cache)
    for _ in range(7, 11):
        expected = llminfer.decode_step(model, token, reference)
        got = graphed.decode(token)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        token = expected.argmax(-1)
    assert graphed.cache.length == reference.length == 11
    # positions past the current one are masked: stale K/V there must not change the answer
    graphed.cache.truncate(10)
    reference.truncate(10)
    graphed.cache.k[0][:, :, 11:] = 1e3
    torch.testing.assert_close(graphed.decode(token), llminfer.decode_step(model, token, reference),
                               rtol=1e-4, atol=1e-4)


def test_the_graph_captures_the_model_s_own_forward():
    """A change to the model (here: its attention backend) reaches the graphed step: no second copy of a layer."""
    model = _model()
    calls = []

    def counting_backend(q, k, v, causal=True, mask=None, scale=None):
        calls.append(mask is not None)
        return llminfer.attention.fast_attention(q, k, v, causal=causal, mask=mask, scale=scale)
    llminfer.attention.register_backend("counting-test", counting_backend, replace=True)
    model.set_attention_backend("counting-test")
    graphed = GraphedDecoder(model, max_seq_len=12)
    graphed.generate(torch.tensor([[1, 2, 3]]), 3)
    assert calls == [False] * TINY.n_layers + [True] * 2 * TINY.n_layers   # prefill, then two static steps


def test_generate_gives_greedy_tokens_and_the_shared_result_type_on_cpu():
    model = _model()
    ids = torch.randint(0, TINY.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    result = GraphedDecoder(model, max_seq_len=12).generate(ids, 6)
    assert isinstance(result, llminfer.GenerationResult)
    assert result.token_ids == llminfer.generate(model, ids, max_new_tokens=6).token_ids
    assert len(result.itl_s) == 5 and result.ttft_s > 0 and result.num_prompt_tokens == 5
    with pytest.raises(ValueError, match="cache positions"):
        GraphedDecoder(model, max_seq_len=8).generate(ids, 6)


def test_capture_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        GraphedDecoder(_model(), max_seq_len=8).capture()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_matches_eager_generation_on_cuda():
    model = _model("cuda")
    ids = torch.randint(0, TINY.vocab_size, (1, 9), device="cuda")
    result = GraphedDecoder(model, max_seq_len=24).generate(ids, 12)
    assert result.token_ids == llminfer.generate(model, ids, max_new_tokens=12).token_ids
    assert len(result.itl_s) == 11
