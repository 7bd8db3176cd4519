"""Transformer.use_decode_layout: a memory-order change that must not change a single answer."""
import pytest
import torch

import llminfer

WIDE = llminfer.ModelConfig(vocab_size=101, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96,
                            max_seq_len=32)


@pytest.mark.parametrize("tied", [True, False])
def test_layout_keeps_shapes_names_and_logits(tied, tmp_path):
    model = llminfer.load_random(WIDE.replace(tie_embeddings=tied), device="cpu", seed=5)
    ids = torch.randint(0, WIDE.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    before = {name: (tuple(p.shape), p.detach().clone()) for name, p in model.named_parameters()}
    with torch.inference_mode():
        expected = model(ids)
        model.use_decode_layout()
        torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    for name, (shape, values) in before.items():
        assert tuple(after[name].shape) == shape and torch.equal(after[name], values)
    gate = model.layers[0].mlp.gate_proj.weight                 # (96, 32): more outputs than inputs
    assert not gate.is_contiguous() and gate.t().is_contiguous()
    assert model.layers[0].mlp.down_proj.weight.is_contiguous()  # (32, 96): left as it was
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    llminfer.save_pretrained(model, tmp_path)
    loaded, _ = llminfer.load_pretrained(tmp_path, device="cpu", load_tokenizer=False)
    for name, param in loaded.named_parameters():
        assert torch.equal(param, after[name])


def test_cached_generation_is_unchanged():
    model = llminfer.load_random(WIDE, device="cpu", seed=6)
    ids = torch.randint(0, WIDE.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    expected = llminfer.generate(model, ids, max_new_tokens=8).token_ids
    assert llminfer.generate(model.use_decode_layout(), ids, max_new_tokens=8).token_ids == expected
