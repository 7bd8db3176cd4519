"""Mixture of experts: the router by hand, the two ways to run the experts, logits against transformers' Qwen3-MoE,
Mixtral and OLMoE, published sizes, and bad configs refused before anything is allocated."""
from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

import llminfer
from llminfer.checkpoint import open_checkpoint
from llminfer.moe import MoEFeedForward, experts_grouped, experts_loop, route

TOLERANCE = 1e-5

SMALL_HF = {
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=512)),
    "qwen3_moe-unnormalised": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=False, max_position_embeddings=512)),
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig(
        vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=512)),
    "olmoe": (transformers.OlmoeForCausalLM, transformers.OlmoeConfig(
        vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, max_position_embeddings=512,
        eos_token_id=None, pad_token_id=None)),
}


def hf_model(name: str, seed: int = 0):
    """A small transformers MoE model with random weights, its norm scales perturbed so that they matter."""
    cls, config = SMALL_HF[name]
    torch.manual_seed(seed)
    model = cls(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
    return model


# --- the router, by hand ----------------------------------------------------------------------------

def test_route_by_hand_both_orders():
    """Logits (2, 1, 0, -1) over 4 experts, k = 2: both orders choose experts 0 and 1; the weights differ."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    e = math.e
    # Mixtral: softmax over the two chosen logits: e^2 / (e^2 + e^1) = 1 / (1 + 1/e)
    weights, ids = route(logits, 2, softmax_before_topk=False, normalize=False)
    assert ids.tolist() == [[0, 1]] and ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert weights[0].tolist() == pytest.approx([1 / (1 + 1 / e), 1 / (1 + e)], abs=1e-7)
    # Qwen3-MoE / OLMoE: softmax over all four, then the two largest: they sum to less than one
    total = e ** 2 + e + 1 + 1 / e
    weights, ids = route(logits, 2, softmax_before_topk=True, normalize=False)
    assert ids.tolist() == [[0, 1]]
    assert weights[0].tolist() == pytest.approx([e ** 2 / total, e / total], abs=1e-7)
    assert weights.sum().item() == pytest.approx((e ** 2 + e) / total) and weights.sum() < 0.9
    # ... renormalised (norm_topk_prob): Mixtral's numbers again
    weights, _ = route(logits, 2, softmax_before_topk=True, normalize=True)
    assert weights[0].tolist() == pytest.approx([1 / (1 + 1 / e), 1 / (1 + e)], abs=1e-7)


def test_route_takes_the_softmax_in_float32_and_refuses_a_bad_k():
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = route(logits.bfloat16(), 3, softmax_before_topk=True, normalize=True)
    assert weights.dtype == torch.float32 and ids.shape == (5, 3)
    assert torch.allclose(weights.sum(-1), torch.ones(5))
    for k in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match=rf"top_k={k!r} must be an integer in 1..8"):
            route(logits, k, softmax_before_topk=False, normalize=False)


# --- two ways to run the experts ----------------------------------------------------------------------

def random_moe(n_experts=8, top_k=2, dim=32, expert_dim=24, seed=0, **kwargs) -> MoEFeedForward:
    torch.manual_seed(seed)
    moe = MoEFeedForward(dim, n_experts, top_k, expert_dim, softmax_before_topk=True, normalize=True, **kwargs)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.2)
    return moe.eval()


@pytest.mark.parametrize("tokens", [1, 7, 64])
@torch.no_grad()
def test_loop_and_grouped_give_the_same_sum(tokens):
    moe = random_moe()
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens))
    weights, ids = moe.route(x)
    args = (x, weights, ids, moe.w_gate, moe.w_up, moe.w_down)
    loop, grouped = experts_loop(*args), experts_grouped(*args)
    assert torch.allclose(loop, grouped, atol=1e-6, rtol=0)
    # and both are the definition, Σ_j w[t, j] · expert_{ids[t, j]}(x[t]), token by token
    for t in range(tokens):
        expect = sum(weights[t, j] * F_expert(moe, ids[t, j].item(), x[t]) for j in range(ids.shape[1]))
        assert torch.allclose(grouped[t], expect, atol=1e-5, rtol=1e-5)
    assert grouped.abs().max() > 0.05


def F_expert(moe, e, x):
    return moe.w_down[e] @ (torch.nn.functional.silu(moe.w_gate[e] @ x) * (moe.w_up[e] @ x))


def test_forward_impl_switch_and_an_unknown_impl():
    moe = random_moe(shared_expert_dim=16)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        grouped = moe(x)
        moe.impl = "loop"
        loop = moe(x)
    assert grouped.shape == x.shape and torch.allclose(grouped, loop, atol=1e-6, rtol=0)
    moe.impl = "fused"
    with pytest.raises(ValueError, match="impl='fused' must be one of loop, grouped"):
        moe(x)


def test_shared_expert_with_its_gate_equals_qwen2_moe_block():
    """The shared expert and its sigmoid gate, against transformers' Qwen2-MoE block on the same weights."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    config = transformers.Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                         num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)
    torch.manual_seed(0)
    block = Qwen2MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.2)
    ours = MoEFeedForward(32, 6, 2, 24, softmax_before_topk=True, normalize=False, shared_expert_dim=40,
                          shared_expert_gate=True)
    gate_up = block.experts.gate_up_proj.detach()                    # transformers 5 keeps experts fused: (E, 2I, D)
    with torch.no_grad():
        ours.router.weight.copy_(block.gate.weight)
        ours.w_gate.copy_(gate_up[:, :24])
        ours.w_up.copy_(gate_up[:, 24:])
        ours.w_down.copy_(block.experts.down_proj)
        ours.shared_expert.load_state_dict(block.shared_expert.state_dict())
        ours.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
        x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(2))
        diff = (ours(x) - block(x)).abs().max().item()
        ours.shared_expert_gate = None                                # DeepSeek's shared experts have no gate
        assert (ours(x) - block(x)).abs().max() > 1e-3
    assert diff <= TOLERANCE


# --- the decoder against transformers -----------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SMALL_HF))
def test_logits_match_transformers_loaded_from_its_folder(name, tmp_path):
    reference = hf_model(name)
    reference.save_pretrained(tmp_path)
    model, _ = llminfer.load_pretrained(tmp_path, device="cpu", load_tokenizer=False)
    config = model.config
    assert config.model_type == name.split("-")[0] and config.is_moe
    assert config.n_experts == reference.config.num_experts
    ids = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        got = model(ids)
        for layer in config.moe_layers:
            model.layers[layer].mlp.impl = "loop"
        looped = model(ids)
    diff = (expected - got).abs().max().item()
    print(f"{name}: max |logit difference| vs transformers = {diff:.3g}")
    assert diff <= TOLERANCE and (expected - looped).abs().max().item() <= TOLERANCE
    assert expected.abs().max() > 0.1


def test_dense_layers_between_moe_layers_follow_mlp_only_layers(tmp_path):
    reference = hf_model("qwen3_moe")
    reference.save_pretrained(tmp_path)
    model, _ = llminfer.load_pretrained(tmp_path, device="cpu", load_tokenizer=False)
    assert model.config.moe_layers == (0, 2)
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["MoEFeedForward", "MLP", "MoEFeedForward"]
    assert sum(p.numel() for p in model.parameters()) == model.config.n_params()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_transformers_reads_what_llminfer_saves(name, tmp_path):
    reference = hf_model(name, seed=4)
    reference.save_pretrained(tmp_path / "hf")
    model, _ = llminfer.load_pretrained(tmp_path / "hf", device="cpu", load_tokenizer=False)
    llminfer.save_pretrained(model, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(again) is type(reference)
    ids = torch.randint(0, 97, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (again(ids).logits - model(ids)).abs().max().item() <= TOLERANCE


# --- published shapes --------------------------------------------------------------------------------

@pytest.mark.parametrize("name, total, active, embeddings", [
    ("mixtral-8x7b", 46.7, 12.9, True),        # Mistral AI: 46.7B total, 12.9B a token
    ("qwen3-30b-a3b", 30.5, 3.3, True),        # Qwen: 30.5B total, 3.3B activated
    ("gpt-oss-20b", 20.9, 3.6, False),         # OpenAI counts 3.6B active without the embedding
])
def test_presets_have_their_published_total_and_active_parameters(name, total, active, embeddings):
    config = llminfer.get_preset(name)
    assert round(config.n_params() / 1e9, 1) == total
    assert abs(config.n_params(include_embeddings=embeddings, active=True) / 1e9 - active) < 0.06   # 3.35 is "3.3B"


def test_deepseek_v3_preset_is_its_moe_shape_with_approximated_attention():
    config = llminfer.get_preset("deepseek-v3")
    assert config.moe_layers == tuple(range(3, 61)) and config.shared_expert_dim == 2048
    assert abs(config.n_params() / 671e9 - 1) < 0.01                 # published 671B; MLA approximated
    assert abs(config.n_params(active=True) / 37e9 - 1) < 0.1        # published 37B
    with pytest.raises(ValueError, match="published shape for the cost model only"):
        llminfer.Transformer(config)


# --- bad input, before anything is allocated ----------------------------------------------------------

MOE = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, model_type="mixtral")


def test_top_k_above_the_experts_and_zero_experts_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"n_experts_per_tok \(config.json: num_experts_per_tok\) is 9, outside "
                                         r"1..8 .*set it to at most 8"):
        llminfer.ModelConfig(**MOE, n_experts=8, n_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"n_experts \(config.json: num_experts\) is 0, but a mixtral model .* at "
                                         r"least one"):
        llminfer.ModelConfig(**MOE, n_experts=0, n_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"n_experts \(config.json: num_experts\).* set for model_type='llama'"):
        llminfer.ModelConfig(**{**MOE, "model_type": "llama"}, n_experts=8, n_experts_per_tok=2)
    with pytest.raises(ValueError, match="top_k=3 must lie in 1..n_experts=2"):
        MoEFeedForward(8, 2, 3, 4, softmax_before_topk=True, normalize=True)
    base = dict(SMALL_HF["mixtral"][1].to_dict())
    for key, value, match in (("num_experts_per_tok", 7, "is 7, outside 1..6"),
                              ("num_local_experts", 0, "is 0, but a mixtral model")):
        with pytest.raises(ValueError, match=match):
            llminfer.ModelConfig.from_hf({**base, key: value})


def write_hf(tmp_path, name, **changes):
    """A transformers checkpoint whose config.json is then changed: weights and config no longer agree."""
    hf_model(name).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return tmp_path


@pytest.mark.parametrize("name, changes, match", [
    ("qwen3_moe", {"num_local_experts": 4}, r"layer 0 of the checkpoint holds 8 experts \(model.layers.0.mlp.experts"
                                            r".\{0..7\}.gate_proj.weight\) but config.json gives num_experts=4"),
    ("qwen3_moe", {"moe_intermediate_size": 40}, r"expert tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' has "
                                                 r"shape \(32, 64\) but .* moe_intermediate_size=40"),
    ("mixtral", {"num_local_experts": 8}, r"holds 6 experts .* num_experts=8 .*set num_experts to 6"),
    ("mixtral", {"intermediate_size": 50}, r"'model.layers.0.block_sparse_moe.experts.0.w1.weight' has shape "
                                           r"\(48, 64\) .* intermediate_size=50"),
])
def test_experts_that_do_not_match_config_json_are_refused_from_the_headers(tmp_path, name, changes, match):
    folder = write_hf(tmp_path, name, **changes)
    with pytest.raises(ValueError, match=match):
        open_checkpoint(folder)                                      # headers only: no model, no tensor read
    with pytest.raises(ValueError, match=match):
        llminfer.load_pretrained(folder, load_tokenizer=False)


def test_tensor_parallelism_refuses_an_moe_model_and_points_to_expert_parallelism():
    from llminfer.parallel.plan import tensor_parallel_plan
    config = llminfer.ModelConfig(**MOE, n_experts=8, n_experts_per_tok=2)
    with pytest.raises(ValueError, match="mixture of 8 experts; split its experts .* expert parallelism"):
        tensor_parallel_plan(config, 2)
    dense = llminfer.ModelConfig(**{**MOE, "model_type": "llama", "vocab_size": 96})
    assert tensor_parallel_plan(dense, 2).world_size == 2


# The fields of the published config.json files that describe the shape (from the hub pages PRESET_SOURCES names).
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
                 "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
                 "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
                 "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
                 "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
                 "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
                 "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
                 "use_sliding_window": False, "vocab_size": 151936}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
                "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
                "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
                "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1e6,
                "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
                "vocab_size": 32000}


@pytest.mark.parametrize("name, hf", [("qwen3-30b-a3b", QWEN3_30B_A3B), ("mixtral-8x7b", MIXTRAL_8X7B)])
def test_published_config_json_reads_as_the_preset(name, hf):
    assert llminfer.ModelConfig.from_hf(hf) == llminfer.get_preset(name)


def test_transformers_fused_expert_layout_reads_too(tmp_path):
    """A state_dict saved as transformers holds it in memory (gate_up_proj (E, 2I, D), down_proj (E, D, I)) reads
    as the per-expert files do; a fused tensor of the wrong width is refused naming the field."""
    from safetensors.torch import save_file
    reference = hf_model("qwen3_moe")
    reference.save_pretrained(tmp_path)
    tensors = {name: t.contiguous() for name, t in reference.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model, _ = llminfer.load_pretrained(tmp_path, load_tokenizer=False)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (reference(ids).logits - model(ids)).abs().max().item() <= TOLERANCE
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 16}))
    with pytest.raises(ValueError, match=r"fused expert tensor 'model.layers.0.mlp.experts.gate_up_proj' has shape "
                                         r"\(8, 64, 64\) .* moe_intermediate_size=16"):
        open_checkpoint(tmp_path)
