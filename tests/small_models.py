"""Small random models of each supported kind, shared by the unit tests."""
from __future__ import annotations

import torch

import llminfer

# Small configurations covering what the Llama family varies: MHA vs GQA, tied vs untied head,
# Qwen2's q/k/v bias, Llama 3's rope scaling.
SMALL_CONFIGS = {
    "llama-mha-untied": llminfer.ModelConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=4,
                                             hidden_dim=112, max_seq_len=512),
    "llama-gqa-tied": llminfer.ModelConfig(vocab_size=101, dim=64, n_layers=3, n_heads=8, n_kv_heads=2,
                                           hidden_dim=96, max_seq_len=512, tie_embeddings=True, rope_theta=500000.0),
    "llama3-rope-scaling": llminfer.ModelConfig(
        vocab_size=89, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, hidden_dim=80, max_seq_len=512,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen2-bias-gqa": llminfer.ModelConfig(vocab_size=103, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                           hidden_dim=128, max_seq_len=512, qkv_bias=True, model_type="qwen2",
                                           norm_eps=1e-6, rope_theta=1e6),
    "qwen2-bias-tied": llminfer.ModelConfig(vocab_size=103, dim=32, n_layers=2, n_heads=4, n_kv_heads=1,
                                            hidden_dim=64, max_seq_len=512, qkv_bias=True, model_type="qwen2",
                                            tie_embeddings=True),
}


def random_model(config: llminfer.ModelConfig, seed: int = 0, std: float = 0.08) -> llminfer.Transformer:
    """A float32 model with random weights, biases and norm scales too, so that every parameter matters."""
    model = llminfer.Transformer(config).init_weights(seed, std=std).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight"):
                param.copy_(1.0 * (name.endswith("norm.weight")) + 0.1 * torch.randn(param.shape, generator=generator))
    return model



def word_tokenizer(vocab_size: int) -> llminfer.Tokenizer:
    """A word-level tokenizer over tokens t0..t{n-1} plus <eos>, for folders that need a tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return llminfer.Tokenizer(backend)
