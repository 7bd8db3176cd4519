"""The bytes of an MoE decode step: the distinct-expert formula against exact enumeration and sampling, the
byte and FLOP counts against numbers worked out by hand."""
from fractions import Fraction
from itertools import combinations, product
from types import SimpleNamespace

import pytest
import torch

from llminfer import costs
from llminfer.costs import MoEShape

# vocab 10, dim 4, 2 layers, 2 query heads and 1 K/V head of width 2, dense MLP width 8 (as test_costs.TINY).
TINY = SimpleNamespace(vocab_size=10, dim=4, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=8,
                       head_dim=None, qkv_bias=False)
# 4 routed experts of width 3, 2 per token, a shared expert of width 2
MOE = MoEShape(n_experts=4, top_k=2, expert_hidden_dim=3, shared_hidden_dim=2)


@pytest.mark.parametrize("n_experts, top_k, batch", [(5, 2, 3), (4, 1, 4), (6, 3, 2), (4, 4, 2), (3, 1, 1)])
def test_distinct_experts_formula_equals_exact_enumeration(n_experts, top_k, batch):
    subsets = list(combinations(range(n_experts), top_k))          # each token's equally likely choices
    total = sum(len(set().union(*picks)) for picks in product(subsets, repeat=batch))
    exact = Fraction(total, len(subsets) ** batch)
    formula = n_experts * (1 - (1 - Fraction(top_k, n_experts)) ** batch)
    assert exact == formula
    assert costs.expected_distinct_experts(n_experts, top_k, batch) == pytest.approx(float(exact), rel=1e-12)


def test_distinct_experts_formula_against_sampling():
    # 20000 batches of 8 tokens, each choosing 4 of 16 experts without replacement (a random permutation's head);
    # the count's standard deviation is below 2, so the mean's is below 0.015: a margin of 0.1 is > 6 sigma
    n_experts, top_k, batch, samples = 16, 4, 8, 20000
    generator = torch.Generator().manual_seed(0)
    picks = torch.rand(samples, batch, n_experts, generator=generator).argsort(-1)[..., :top_k]
    touched = torch.zeros(samples, n_experts, dtype=torch.bool)
    touched.scatter_(1, picks.reshape(samples, -1), True)
    measured = touched.sum(1).double().mean().item()
    assert measured == pytest.approx(costs.expected_distinct_experts(n_experts, top_k, batch), abs=0.1)


def test_distinct_experts_limits():
    assert costs.expected_distinct_experts(256, 8, 1) == pytest.approx(8)          # B = 1: the k chosen
    assert costs.expected_distinct_experts(256, 8, 0) == 0
    assert costs.expected_distinct_experts(256, 8, 100000) == pytest.approx(256)  # B → ∞: all of them
    assert costs.expected_distinct_experts(8, 8, 3) == 8                           # k = E: dense
    # small k·B against E: almost every pick is new, a little below k·B
    assert 15.5 < costs.expected_distinct_experts(1024, 2, 8) < 16
    counts = [costs.expected_distinct_experts(64, 4, b) for b in range(1, 200)]
    assert all(a < b for a, b in zip(counts, counts[1:])) and counts[-1] < 64


def test_moe_bytes_by_hand():
    # weights read by the dense TINY: 348 (its embedding is gathered). Per layer: attention 48, dense MLP 96.
    # MoE layer: router 4x4 = 16, shared 3*4*2 = 24, each expert 3*4*3 = 36
    step = costs.moe_decode_step_bytes(TINY, MOE, 1, cached_len=0, dtype_bytes=1)
    assert step.always_bytes == 348 - 2 * 96 + 2 * (16 + 24) == 236
    assert step.distinct_experts == pytest.approx(2)
    assert step.expert_bytes == pytest.approx(2 * 2 * 36)               # 2 layers, 2 experts
    assert step.kv_bytes == 2 * 2 * 1 * 2                               # K and V, 2 layers, 1 head of 2, 1 position
    assert step.total_bytes == pytest.approx(236 + 144 + 8)
    assert step.dense_bytes == pytest.approx(step.total_bytes)         # at batch 1 the MoE is its active model
    # batch 3 under random routing: 4 (1 - (1/2)^3) = 3.5 experts a layer; the dense twin reads 2 a layer
    step = costs.moe_decode_step_bytes(TINY, MOE, 3, cached_len=4, dtype_bytes=2)
    assert step.distinct_experts == pytest.approx(3.5)
    assert step.expert_bytes == pytest.approx(2 * 3.5 * 36 * 2)
    assert step.kv_bytes == 2 * 2 * 1 * 2 * 5 * 3 * 2
    assert step.dense_bytes == pytest.approx(236 * 2 + 2 * 2 * 36 * 2 + step.kv_bytes)
    assert step.per_token_bytes == pytest.approx(step.total_bytes / 3)
    # a measured count replaces the expectation
    assert costs.moe_decode_step_bytes(TINY, MOE, 3, distinct_experts=4, dtype_bytes=1).expert_bytes == 2 * 4 * 36


def test_moe_bytes_with_dense_layers_and_weight_bytes_by_hand():
    first_dense = MoEShape(4, 2, 3, shared_hidden_dim=2, n_dense_layers=1)
    step = costs.moe_decode_step_bytes(TINY, first_dense, 1, dtype_bytes=1)
    assert step.always_bytes == 348 - 96 + 16 + 24                       # one layer keeps its dense MLP
    assert step.expert_bytes == pytest.approx(2 * 36)
    # every weight: per MoE layer attention 48 + router 16 + shared 24 + 4 experts x 36, norms 20, table and head 40 each
    assert costs.moe_weight_bytes(TINY, MOE, 1) == 2 * (48 + 16 + 24 + 144) + 20 + 40 + 40 == 564
    # with every expert read, the step reads every weight but the gathered embedding
    assert costs.moe_decode_step_bytes(TINY, MOE, 8, distinct_experts=4, dtype_bytes=1).total_bytes == pytest.approx(
        564 - 40 + 2 * 2 * 1 * 2 * 8)


def test_moe_flops_by_hand_count_only_the_chosen_experts():
    # per MoE layer and token: attention 48 + router 16 + shared 24 + 2 experts x 36 = 160 weights, 2 FLOPs each;
    # the head 2 * 10 * 4; attention on one key: 2 layers * 2 heads * 2 dims * 4
    assert costs.moe_decode_step_flops(TINY, MOE, 1) == 2 * 2 * 160 + 80 + 32
    assert costs.moe_decode_step_flops(TINY, MOE, 5, cached_len=3) == 5 * (2 * 2 * 160 + 80 + 4 * 32)


def test_per_token_bytes_fall_slower_than_the_dense_twin():
    big = SimpleNamespace(vocab_size=1000, dim=64, n_layers=4, n_heads=4, n_kv_heads=4, hidden_dim=128,
                          head_dim=None, qkv_bias=False)
    moe = MoEShape(64, 4, 32)
    steps = [costs.moe_decode_step_bytes(big, moe, b) for b in (1, 8, 64, 512)]
    assert steps[0].per_token_bytes == pytest.approx(steps[0].dense_per_token_bytes)
    for step in steps[1:]:
        assert step.per_token_bytes > step.dense_per_token_bytes
    assert [s.per_token_bytes for s in steps] == sorted((s.per_token_bytes for s in steps), reverse=True)


@pytest.mark.parametrize("shape, words", [
    (dict(n_experts=4, top_k=5, expert_hidden_dim=3), ["top_k=5", "n_experts=4"]),
    (dict(n_experts=0, top_k=1, expert_hidden_dim=3), ["n_experts", ">= 1", "0"]),
    (dict(n_experts=4, top_k=1, expert_hidden_dim=0), ["expert_hidden_dim"]),
    (dict(n_experts=4, top_k=1, expert_hidden_dim=2, shared_hidden_dim=-1), ["shared_hidden_dim"]),
])
def test_bad_moe_shapes_are_refused_naming_the_field(shape, words):
    with pytest.raises(ValueError) as error:
        MoEShape(**shape)
    for word in words:
        assert word in str(error.value)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="n_dense_layers=3 is more than the model's n_layers=2"):
        costs.moe_decode_step_bytes(TINY, MoEShape(4, 2, 3, n_dense_layers=3))
    with pytest.raises(ValueError, match=r"distinct_experts=5 is impossible .* 2\.\.4"):
        costs.moe_decode_step_bytes(TINY, MOE, 2, distinct_experts=5)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        costs.moe_decode_step_bytes(TINY, MOE, 0)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 0"):
        costs.expected_distinct_experts(8, 2, -1)


def test_the_shape_is_read_from_a_config_with_experts():
    # a config's expert fields as ModelConfig names them; layer 0 keeps its dense MLP
    cfg = SimpleNamespace(**vars(TINY), n_experts=4, n_experts_per_tok=2, moe_hidden_dim=3, shared_expert_dim=2,
                          moe_layers=(1,), shared_expert_gate=False)
    assert MoEShape.from_config(cfg) == MoEShape(4, 2, 3, shared_hidden_dim=2, n_dense_layers=1)
    assert costs.moe_decode_step_bytes(cfg, batch_size=2) == costs.moe_decode_step_bytes(
        cfg, MoEShape(4, 2, 3, 2, 1), 2)
    with pytest.raises(ValueError, match="no experts"):
        MoEShape.from_config(TINY)


@pytest.mark.parametrize("family, changes", [
    ("mixtral", dict()),
    ("qwen3_moe", dict(norm_topk_prob=True, shared_expert_dim=40, shared_expert_gate=True, mlp_only_layers=(0,))),
    ("olmoe", dict(tie_embeddings=True)),
])
def test_moe_counts_equal_the_real_models_parameters(family, changes):
    import llminfer
    config = llminfer.ModelConfig(vocab_size=97, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=48,
                                  max_seq_len=64, model_type=family, n_experts=6, n_experts_per_tok=2,
                                  moe_hidden_dim=24, **changes)
    model = llminfer.Transformer(config)
    held = sum(p.numel() for p in model.parameters())                   # a tied table is one parameter
    assert costs.moe_weight_bytes(config, dtype_bytes=4) == 4 * held == 4 * config.n_params()
    # the dense twin reads the active weights, all but the gathered embedding table; so does the MoE at batch 1
    gathered = 0 if config.tie_embeddings else config.vocab_size * config.dim
    step = costs.moe_decode_step_bytes(config, batch_size=1, dtype_bytes=4)
    assert step.dense_bytes - step.kv_bytes == 4 * (config.n_params(active=True) - gathered)
    assert step.total_bytes == pytest.approx(step.dense_bytes, rel=1e-12)
