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
    with torch.inference_mode():
        token = llminfer.prefill(model, ids, reference).argmax(-1)
        model(ids, cache=graphed.cache, start_pos=0)
        for position in range(7, 11):
            expected = llminfer.decode_step(model, token, reference, position)
            got = graphed.decode(token, position)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            token = expected.argmax(-1)
        # positions past the current one are masked: stale K/V there must not change the answer
        graphed.cache.k[0][:, :, 11:] = 1e3
        torch.testing.assert_close(graphed.decode(token, 10), llminfer.decode_step(model, token, reference, 10),
                                   rtol=1e-4, atol=1e-4)


def test_generate_timed_gives_greedy_tokens_on_cpu():
    model = _model()
    ids = torch.randint(0, TINY.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    ttft, latencies, tokens = GraphedDecoder(model, max_seq_len=12).generate_timed(ids, 6)
    assert tokens == llminfer.generate(model, ids, max_new_tokens=6).token_ids
    assert len(latencies) == 5 and ttft > 0
    with pytest.raises(ValueError, match="cache positions"):
        GraphedDecoder(model, max_seq_len=8).generate_timed(ids, 6)


def test_capture_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        GraphedDecoder(_model(), max_seq_len=8).capture()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_matches_eager_generation_on_cuda():
    model = _model("cuda")
    ids = torch.randint(0, TINY.vocab_size, (1, 9), device="cuda")
    ttft, latencies, tokens = GraphedDecoder(model, max_seq_len=24).generate_timed(ids, 12)
    assert tokens == llminfer.generate(model, ids, max_new_tokens=12).token_ids
    assert len(latencies) == 11
