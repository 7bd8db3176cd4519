"""Expert parallelism with real processes (2 gloo ranks): an MoE layer whose experts are split over two ranks
computes what one process computes, moving exactly the bytes counted; the all-to-all is timed and fitted; the
α–β projection against hand-worked numbers."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llminfer.config import PRESETS
from llminfer.costs import MoEShape
from llminfer.moe import MoEFeedForward
from llminfer.parallel import cost_model, expert


def random_moe(seed: int = 0, **options) -> MoEFeedForward:
    """8 experts of width 24 over dim 16, 2 per token, with random weights large enough to spread the routing."""
    torch.manual_seed(seed)
    moe = MoEFeedForward(16, 8, 2, 24, **{"softmax_before_topk": True, "normalize": True, **options})
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.3)
    return moe.eval()


def _remote_pairs(moe, x, rank):
    """Of rank's tokens' (token, expert) pairs, how many choose an expert the other rank holds."""
    _, ids = moe.route(x)
    return int(((ids // 4) != rank).sum())


def test_ep2_layer_equals_one_process_and_moves_the_counted_bytes():
    moe = random_moe(shared_expert_dim=8, shared_expert_gate=True)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(7, 16, generator=generator), torch.randn(3, 16, generator=generator)]
    ranks = expert.run_expert_parallel(moe, inputs, repeats=2)
    full_expert_bytes = sum(p.numel() * 4 for p in (moe.w_gate, moe.w_up, moe.w_down))
    with torch.no_grad():
        references = [moe(x) for x in inputs]
    for rank, x, reference in zip(ranks, inputs, references):
        assert reference.abs().max() > 0.5                               # real outputs, not a vacuous comparison
        # the same sums, added in the same order; the products run on other row counts, so float32 rounding
        assert (rank["output"] - reference).abs().max() < 1e-5 * reference.abs().max()
        assert rank["expert_bytes"] * 2 == full_expert_bytes
    assert [r["experts"] for r in ranks] == [(0, 4), (4, 8)]
    sent = [_remote_pairs(moe, x, r) for r, x in enumerate(inputs)]
    assert sent[0] > 0 and sent[1] > 0
    for r in (0, 1):
        # dispatch: each pair of this rank's tokens bound for the other rank, a float32 row of 16
        assert ranks[r]["rows"]["dispatch"] == sent[r]
        assert ranks[r]["bytes"]["dispatch"] == sent[r] * 16 * 4
        # combine: what this rank received comes back
        assert ranks[r]["rows"]["combine"] == sent[1 - r]
        assert ranks[r]["bytes"]["combine"] == sent[1 - r] * 16 * 4
        assert ranks[r]["seconds"]["dispatch"] > 0 and ranks[r]["seconds"]["combine"] > 0


def test_ep2_layer_with_a_rank_without_tokens_and_softmax_after_topk():
    moe = random_moe(seed=4, softmax_before_topk=False, normalize=False)
    inputs = [torch.randn(6, 16, generator=torch.Generator().manual_seed(2)), torch.zeros(0, 16)]
    ranks = expert.run_expert_parallel(moe, inputs)
    assert ranks[0]["seconds"] == {}                                      # timed only when asked
    with torch.no_grad():
        reference = moe(inputs[0])
    assert (ranks[0]["output"] - reference).abs().max() < 1e-5 * reference.abs().max()
    assert ranks[1]["output"].shape == (0, 16)
    assert ranks[1]["rows"]["dispatch"] == 0 and ranks[1]["rows"]["combine"] == _remote_pairs(moe, inputs[0], 0)


def test_all_to_all_is_measured_and_fitted():
    sizes = [64, 1 << 16, 1 << 23]
    measured = expert.measure_all_to_all(sizes, repeats=2, budget_s=0.01)
    assert measured["sizes"] == sizes and measured["sent_bytes"] == [n / 2 for n in sizes]
    times = measured["seconds"]
    assert len(times) == 3 and all(t > 0 for t in times)
    # a physical floor, whatever the load: 4 MiB leave each rank, and no path between two processes moves that
    # at 200 GB/s
    assert times[2] > (1 << 22) / 200e9, times
    # the fit is chapter 10's (tested on synthetic timings there); a busy machine may leave nothing to fit
    fit = measured["fit"]
    assert (fit.alpha_s >= 0 and fit.bytes_per_s > 0) if fit else "do not grow" in measured["fit_error"]


def test_bad_splits_are_refused_before_any_process():
    with pytest.raises(ValueError, match="n_experts=8 is not divisible by world_size=3"):
        expert.run_expert_parallel(random_moe(), [torch.zeros(1, 16)] * 3, world_size=3)
    with pytest.raises(ValueError, match=r"one \(tokens, 16\) tensor per rank \(2\)"):
        expert.run_expert_parallel(random_moe(), [torch.zeros(1, 8)] * 2)


# --- the α–β projection, by hand --------------------------------------------------------------------------------

DEEPSEEK_V3 = PRESETS["deepseek-v3"]                                # 61 layers: 3 dense, then 58 MoE
DEEPSEEK_V3_MOE = MoEShape(n_experts=256, top_k=8, expert_hidden_dim=2048, shared_hidden_dim=2048, n_dense_layers=3)


def test_the_preset_has_deepseek_v3s_moe_shape():
    # https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json: n_routed_experts 256,
    # num_experts_per_tok 8, moe_intermediate_size 2048, n_shared_experts 1, first_k_dense_replace 3
    assert MoEShape.from_config(DEEPSEEK_V3) == DEEPSEEK_V3_MOE and DEEPSEEK_V3.dim == 7168


def test_ep_bytes_per_token_by_hand():
    # 8 ranks: 7 of a token's 8 copies leave its rank; FP8 dispatch, BF16 combine
    per_token = expert.ep_bytes_per_token(DEEPSEEK_V3, DEEPSEEK_V3_MOE, world_size=8, dispatch_bytes=1,
                                          combine_bytes=2)
    assert per_token["remote_copies"] == 7
    assert per_token["dispatch"] == 7 * 7168 and per_token["combine"] == 7 * 7168 * 2
    assert per_token["per_step_all_layers"] == 58 * 3 * 7 * 7168


def test_predict_ep_step_by_hand():
    node = cost_model.Link("toy", alpha_s=1.0, bytes_per_s=4.0, scope="node", source="test")
    cfg = SimpleNamespace(dim=4, n_layers=3)
    moe = MoEShape(n_experts=4, top_k=2, expert_hidden_dim=1, n_dense_layers=1)     # 2 MoE layers
    # 1 token, 2 copies, half of them to the other rank: 1 row of 4 values. Dispatch 1 byte each: 4 bytes over
    # 4 B/s + 1 s; combine 2 bytes each: 8 bytes, 2 s + 1 s. Two layers: 2 * (2 + 3)
    step = expert.predict_ep_step(cfg, 1, 2, node, moe=moe, dispatch_bytes=1, combine_bytes=2)
    assert (step.dispatch_bytes, step.combine_bytes) == (4, 8)
    assert (step.dispatch_seconds, step.combine_seconds, step.step_seconds) == (2.0, 3.0, 10.0)
    # 16 ranks on nodes of 4: of 8 copies, 3/16 stay in the node and 12/16 cross; the two links work at once
    cluster = cost_model.Link("toy cluster", alpha_s=2.0, bytes_per_s=1.0, scope="cluster", source="test")
    step = expert.predict_ep_step(cfg, 4, 16, node, cluster, gpus_per_node=4, moe=moe, dispatch_bytes=1)
    assert step.dispatch_bytes == 8 * 15 / 16 * 4
    assert step.dispatch_seconds == 2.0 + max(8 * 3 / 16 * 4 / 4.0, 8 * 12 / 16 * 4 / 1.0)
    with pytest.raises(ValueError, match="pass cluster_link"):
        expert.predict_ep_step(cfg, 1, 16, node, gpus_per_node=4, moe=moe)


def test_deepseek_v3_projection_on_h100_nodes():
    # 64 GPUs (8 nodes of 8, NVLink inside, 400 Gb/s InfiniBand across), 128 tokens per GPU: the cross-node
    # copies (7/8 of them) over 50 GB/s set the time
    nvlink, ib = cost_model.LINKS["nvlink4"], cost_model.LINKS["ib-ndr"]
    step = expert.predict_ep_step(DEEPSEEK_V3, 128, 64, nvlink, ib, dispatch_bytes=1)
    across = 128 * 8 * 56 / 64 * 7168
    assert step.dispatch_seconds == pytest.approx(ib.alpha_s + across / ib.bytes_per_s)
    assert step.combine_seconds == pytest.approx(ib.alpha_s + 2 * across / ib.bytes_per_s)
    assert step.step_seconds == pytest.approx(58 * (step.dispatch_seconds + step.combine_seconds))
    assert 0.01 < step.step_seconds < 0.05                              # tens of milliseconds a step


def small_moe_decoder():
    import llminfer
    config = llminfer.ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48,
                                  max_seq_len=64, model_type="qwen3_moe", n_experts=4, n_experts_per_tok=2,
                                  moe_hidden_dim=24, norm_topk_prob=True)
    return llminfer.Transformer(config).init_weights(seed=3, std=0.2).eval()


def test_ep2_greedy_tokens_of_an_moe_decoder_equal_one_process():
    import llminfer
    model = small_moe_decoder()
    # rank 0 decodes two prompts of 4 tokens, rank 1 one of 5: the ranks' prompt lengths may differ
    prompts = [[[5, 9, 13, 2], [7, 7, 1, 60]], [[3, 90, 4, 4, 8]]]
    ranks = expert.run_expert_parallel_generate(model, prompts, max_new_tokens=6)
    for rank, batch in zip(ranks, prompts):
        alone = llminfer.generate(model, batch, max_new_tokens=6, return_logits=True, ignore_eos=True)
        logits = torch.stack(alone.logits)
        assert rank["token_ids"] == alone.token_ids
        assert logits.std() > 0.1 and (rank["logits"] - logits).abs().max() < 1e-5
        assert rank["calls"] == 2 * 2 * 6                   # dispatch and combine, 2 layers, prefill + 5 steps
        assert rank["bytes"] > 0


def test_bad_prompts_are_refused_before_any_process():
    model = small_moe_decoder()
    with pytest.raises(ValueError, match=r"prompts\[0\] holds prompts of lengths \[4, 3\]"):
        expert.run_expert_parallel_generate(model, [[[5, 9, 13, 2], [7, 7, 1]], [[3, 90, 4, 4]]])
    with pytest.raises(ValueError, match="vocab"):                      # generate's checks, before any process
        expert.run_expert_parallel_generate(model, [[[5, 9, 13, 2]], [[3, 97, 4, 4]]])
    with pytest.raises(ValueError, match="max_seq_len=64"):
        expert.run_expert_parallel_generate(model, [[[5, 9]], [[3, 4]]], max_new_tokens=63)


def test_the_split_layer_is_timed_at_several_sizes():
    moe = random_moe(seed=5)
    ranks = expert.measure_expert_parallel(moe, token_counts=[1, 64], repeats=2)
    for rows in ranks:
        assert [row["tokens"] for row in rows] == [1, 64]
        small, large = rows
        # 64 tokens, 2 pairs each, over 8 experts in two blocks: far more rows leave than for one token (at most 2)
        assert small["bytes"]["dispatch"] <= 2 * 16 * 4 < large["bytes"]["dispatch"]
        assert all(row["seconds"]["dispatch"] > 0 and row["seconds"]["combine"] > 0 for row in rows)
    with pytest.raises(ValueError, match="token_counts must list integers in 1..65536"):
        expert.measure_expert_parallel(moe, token_counts=[0])
