"""A mixture-of-experts model served: the engine (continuous batching, paged KV, its fast path falling back to the
layers with the reason) and the OpenAI server make generate()'s greedy tokens, on a small random Qwen3-MoE
checkpoint read from a folder."""
from __future__ import annotations

import random

import openai
import pytest
import torch

import llminfer
from llminfer import cpu, fast
from llminfer.engine import LLMEngine, SamplingParams
from llminfer.serve.server import OpenAIServer, ServeConfig, ServerThread, build_app
from small_models import word_tokenizer

pytestmark = pytest.mark.timeout(300)

CONFIG = llminfer.ModelConfig(vocab_size=64, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                              max_seq_len=256, model_type="qwen3_moe", n_experts=8, n_experts_per_tok=2,
                              moe_hidden_dim=32, norm_topk_prob=True, mlp_only_layers=(1,), norm_eps=1e-6)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The model and tokenizer read back from a Qwen3-MoE folder, prompts, and generate()'s tokens for each alone."""
    folder = tmp_path_factory.mktemp("qwen3-moe")
    llminfer.save_pretrained(llminfer.Transformer(CONFIG).init_weights(0, std=0.15), folder,
                             word_tokenizer(CONFIG.vocab_size))
    model, tokenizer = llminfer.load_pretrained(folder)
    rng = random.Random(0)
    prompts = [[rng.randrange(CONFIG.vocab_size - 1) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    lengths = [rng.randint(1, 8) for _ in prompts]
    refs = [llminfer.generate(model, p, max_new_tokens=n, ignore_eos=True).token_ids for p, n in zip(prompts, lengths)]
    assert len({tuple(r) for r in refs}) > 5                    # the tokens vary: the experts matter
    return model, tokenizer, prompts, lengths, refs


@pytest.mark.parametrize("optimize", [False, True])
def test_the_engine_batches_an_moe_model_as_generate_runs_it_alone(moe, optimize):
    model, _, prompts, lengths, refs = moe
    assert model.config.eos_token_id is None                       # no request stops early
    engine = LLMEngine(model, block_size=8, max_num_seqs=6, max_num_batched_tokens=64, optimize=optimize)
    params = [SamplingParams(max_new_tokens=n, eos_token_id=None) for n in lengths]
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == refs
    assert engine.stats.blocks_used == 0
    if optimize:    # the fast path's copy: experts on the native products, the layer stack on its modules, and why
        assert cpu.available(), f"the native CPU kernels did not build: {cpu.why_unavailable()}"
        stack = engine.model.layers
        assert type(stack) is fast.NativeDecoderStack and stack.weights is None
        assert "mixture of experts" in stack.fallback
        assert [type(layer.mlp).__name__ for layer in stack] == ["NativeMoEFeedForward", "FusedMLP",
                                                                  "NativeMoEFeedForward"]
        assert type(model.layers) is llminfer.model.DecoderStack           # the caller's model is unchanged


def test_the_fast_path_keeps_the_q_and_k_norms():
    """Fusing q, k and v into one product keeps Qwen3's per-head norms: the logits stay the model's."""
    model = llminfer.Transformer(CONFIG).init_weights(1, std=0.15).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
        ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        expected = model(ids)
        fast.fuse_projections(model)
        assert type(model.layers[0].self_attn) is fast.FusedAttention
        assert (model(ids) - expected).abs().max() < 1e-5


def test_the_server_answers_an_moe_model_with_generate_tokens(moe):
    model, tokenizer, prompts, lengths, refs = moe
    state = OpenAIServer(model, tokenizer, ServeConfig(model_name="qwen3-moe-tiny"),
                         engine=LLMEngine(model, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=128))
    with ServerThread(build_app(server=state)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for prompt, n, ref in list(zip(prompts, lengths, refs))[:4]:
            reply = client.completions.create(model="qwen3-moe-tiny", prompt=prompt, max_tokens=n, temperature=0)
            assert reply.choices[0].text == tokenizer.decode(ref)
            assert reply.usage.completion_tokens == len(ref)


def test_a_cuda_graph_of_an_moe_model_is_refused_and_generate_steps_run():
    """The experts' slices are sized on the host each step, which a captured graph cannot replay: refused by name;
    the eager static step makes generate()'s tokens."""
    from llminfer.cuda_graphs import StaticDecoder
    model = llminfer.Transformer(CONFIG).init_weights(2, std=0.15).eval()
    with pytest.raises(ValueError, match="mixture-of-experts model cannot be captured in a CUDA graph"):
        StaticDecoder(model, max_seq_len=64, mode="graph")
    ids = list(range(5, 25))
    expected = llminfer.generate(model, ids, max_new_tokens=6, ignore_eos=True).token_ids
    decoder = StaticDecoder(model, max_seq_len=64, mode="eager")
    assert llminfer.generate(model, ids, max_new_tokens=6, ignore_eos=True, step=decoder).token_ids == expected
