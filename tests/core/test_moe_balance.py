"""Load balance by hand: tokens per expert, distinct experts, capacity and what it drops, the balance loss."""
import math

import pytest
import torch

from llminfer import costs, moe_balance


def test_tokens_per_expert_and_distinct_by_hand():
    ids = torch.tensor([[0, 1], [1, 2], [1, 0]])
    assert moe_balance.tokens_per_expert(ids, 4).tolist() == [2, 3, 1, 0]
    assert moe_balance.distinct_experts(ids) == 3
    # batches of 2 rows: {0,1,2} and {1,0,3}; the fifth row is a leftover and left out
    ids = torch.tensor([[0, 1], [1, 2], [1, 0], [3, 1], [2, 3]])
    assert moe_balance.mean_distinct_experts(ids, 2) == 3.0
    assert moe_balance.mean_distinct_experts(ids, 1) == 2.0        # one token: its k experts
    assert moe_balance.mean_distinct_experts(ids, 5) == 4


def test_mean_distinct_of_random_choices_follows_the_formula():
    generator = torch.Generator().manual_seed(1)
    ids = torch.rand(64000, 32, generator=generator).argsort(-1)[:, :4]   # 64000 tokens, 4 of 32 at random
    for batch in (1, 4, 16):
        expected = costs.expected_distinct_experts(32, 4, batch)
        assert moe_balance.mean_distinct_experts(ids, batch) == pytest.approx(expected, abs=0.15)


def test_capacity_by_hand():
    assert moe_balance.expert_capacity(6, 4, 2, 1.0) == 3            # 6 tokens x 2 choices / 4 experts
    assert moe_balance.expert_capacity(6, 4, 2, 1.25) == 4           # ceil(3.75)
    assert moe_balance.expert_capacity(6, 4, 2, 0.5) == 2            # ceil(1.5)
    assert moe_balance.expert_capacity(0, 4, 2, 1.0) == 0


def test_dropping_in_order_of_arrival_by_hand():
    # capacity ceil(1.0 * 3 * 2 / 4) = 2. Expert 0 is offered tokens 0, 1, 2: token 2's first choice is dropped
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    result = moe_balance.apply_capacity(weights, ids, 4, 1.0)
    assert result.capacity == 2
    assert result.kept.tolist() == [[True, True], [True, True], [False, True]]
    assert result.tokens_per_expert.tolist() == [3, 2, 1, 0]
    assert result.kept_per_expert.tolist() == [2, 2, 1, 0]
    assert result.dropped_fraction == pytest.approx(1 / 6)
    assert result.lost_weight_fraction == pytest.approx(0.5 / 3)
    assert result.tokens_fully_dropped == 0
    # the same assignments arriving in the other order drop the other token: the first come are served
    reversed_result = moe_balance.apply_capacity(weights.flip(0), ids.flip(0), 4, 1.0)
    assert reversed_result.kept.tolist() == [[True, True], [True, True], [False, True]]
    assert reversed_result.lost_weight_fraction == pytest.approx(0.6 / 3)
    # a capacity factor of 1.5 (3 slots) keeps everything; 0.25 (1 slot) drops token 1 and 2 of expert 0 and
    # token 2 of expert 1
    assert moe_balance.apply_capacity(weights, ids, 4, 1.5).kept.all()
    tight = moe_balance.apply_capacity(weights, ids, 4, 0.25)
    assert tight.kept.tolist() == [[True, True], [False, True], [False, False]]
    assert tight.tokens_fully_dropped == 1
    assert tight.lost_weight_fraction == pytest.approx((0.7 + 1.0) / 3)


def test_balance_loss_by_hand():
    # both tokens prefer expert 0 with p = 3/4: f = (1, 0), P = (3/4, 1/4), loss = 2 * 3/4
    logits = torch.tensor([[math.log(3.0), 0.0], [math.log(3.0), 0.0]])
    loss = moe_balance.balance_loss(logits)
    assert loss.loss == pytest.approx(1.5)
    assert loss.token_fraction.tolist() == [1.0, 0.0]
    assert loss.mean_probability.tolist() == pytest.approx([0.75, 0.25])
    # perfect balance: each of 8 tokens sure of its own expert (f = P = 1/8); and a router with no preference
    assert moe_balance.balance_loss(20.0 * torch.eye(8)).loss == pytest.approx(1.0, abs=1e-6)
    assert moe_balance.balance_loss(torch.zeros(5, 8), top_k=2).loss == pytest.approx(1.0)
    # collapse: every token sure of expert 0 scores E
    collapsed = torch.zeros(16, 8)
    collapsed[:, 0] = 30.0
    assert moe_balance.balance_loss(collapsed).loss == pytest.approx(8.0, rel=1e-6)
    assert moe_balance.balance_loss(collapsed, top_k=2).loss == pytest.approx(4.0, rel=1e-5)   # f = (1/2, 1/2, 0...)
    # not a lower bound: one confident token and three hesitant ones. f = (1/4, 3/4), P = (0.615, 0.385)
    probs = torch.tensor([[0.99, 0.01], [0.49, 0.51], [0.49, 0.51], [0.49, 0.51]])
    assert moe_balance.balance_loss(probs.log()).loss == pytest.approx(2 * (0.25 * 0.615 + 0.75 * 0.385))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="expert id 4 is outside 0..3"):
        moe_balance.tokens_per_expert(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match=r"ids must be an integer tensor of shape \(tokens, top_k\)"):
        moe_balance.distinct_experts(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"batch_size must be an integer in 1..2"):
        moe_balance.mean_distinct_experts(torch.tensor([[0], [1]]), 3)
    with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
        moe_balance.expert_capacity(4, 4, 1, 0.0)
    with pytest.raises(ValueError, match="top_k=3 is more than n_experts=2"):
        moe_balance.expert_capacity(4, 2, 3, 1.0)
    with pytest.raises(ValueError, match=r"weights must be a tensor of the shape of ids \(1, 2\)"):
        moe_balance.apply_capacity(torch.ones(2, 1), torch.tensor([[0, 1]]), 2, 1.0)
    with pytest.raises(ValueError, match=r"top_k must be an integer in 1..2"):
        moe_balance.balance_loss(torch.zeros(3, 2), top_k=3)


def test_routing_is_recorded_as_the_layer_chose_it():
    from llminfer.moe import MoEFeedForward
    torch.manual_seed(0)
    moe = MoEFeedForward(8, 6, 2, 5, softmax_before_topk=True, normalize=False)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.5)
    x = torch.randn(3, 4, 8)                                          # a batch of 3 sequences of 4 tokens
    ((weights, ids),) = moe_balance.record_routing(moe, x)
    expected_weights, expected_ids = moe.route(x.reshape(-1, 8))
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)
    assert ids.shape == (12, 2) and moe.router._forward_hooks == {}     # the hook is gone afterwards
    with pytest.raises(ValueError, match="no MoEFeedForward layer"):
        moe_balance.record_routing(torch.nn.Linear(8, 8), x)
