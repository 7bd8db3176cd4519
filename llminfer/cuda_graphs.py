"""Decode steps replayed from a CUDA graph over a static KV cache: no per-kernel launch cost. Chapter 04.

A decode step launches a few hundred small kernels; on a GPU, launching them can take longer than
running them. A CUDA graph records the whole step once and replays it with one launch. Replay needs
every tensor at a fixed address and shape, so this step differs from `Transformer.forward` in three ways:
the position is a device tensor (not a Python int), K/V are written with `index_copy_` into the
preallocated cache, and attention runs over the whole cache with a mask that hides the positions not
yet written. The model's own modules (projections, norms, MLP) do the rest, so the weights are shared.
`step` runs eagerly on any device, which is how the CPU tests check it against `decode_step`.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .model import apply_rope
from .timing import synchronize

__all__ = ["GraphedDecoder"]


class GraphedDecoder:
    """Greedy decoding whose steps replay one captured CUDA graph (eager `step` elsewhere). Chapter 04."""

    def __init__(self, model, batch_size: int = 1, max_seq_len: int | None = None):
        self.model = model
        self.cache = model.new_cache(batch_size, max_seq_len)
        size = self.cache.max_seq_len
        cos, sin = model.rope_tables(size)
        self.cos, self.sin = cos[:size], sin[:size]                           # (S, head_dim)
        self.positions = torch.arange(size, device=model.device)              # (S,)
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=model.device)   # (B, 1) static input
        self.pos = torch.zeros(1, dtype=torch.long, device=model.device)                 # (1,) static input
        self.graph = None
        self.logits = None                                                    # (B, vocab) static output

    @torch.inference_mode()
    def step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Returns logits (B, vocab) for token (B, 1) at position pos (1,), writing its K/V at pos."""
        model = self.model
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)   # (1, head_dim)
        visible = (self.positions <= pos)[None, None, None, :]                    # (1, 1, 1, S)
        x = model.embed_tokens(token)                                             # (B, 1, dim)
        batch = x.shape[0]
        for layer in model.layers:
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(batch, 1, attn.n_heads, attn.head_dim).transpose(1, 2)     # (B, H, 1, D)
            k = attn.k_proj(h).view(batch, 1, attn.n_kv_heads, attn.head_dim).transpose(1, 2)  # (B, H_kv, 1, D)
            v = attn.v_proj(h).view(batch, 1, attn.n_kv_heads, attn.head_dim).transpose(1, 2)  # (B, H_kv, 1, D)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys, values = self.cache.k[attn.layer_idx], self.cache.v[attn.layer_idx]         # (B, H_kv, S, D)
            keys.index_copy_(2, pos, k)
            values.index_copy_(2, pos, v)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible,
                                                 enable_gqa=attn.n_heads != attn.n_kv_heads)   # (B, H, 1, D)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, 1, attn.n_heads * attn.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.lm_head(model.norm(x))[:, -1]                                 # (B, vocab)

    def capture(self, warmup: int = 3) -> None:
        """Records one decode step into a CUDA graph (after warm-up runs on a side stream)."""
        if self.model.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA model, this one is on {self.model.device}; "
                               "use step() for eager decoding")
        self.pos.fill_(0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.step(self.token, self.pos)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.step(self.token, self.pos)

    def decode(self, token: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Returns logits (B, vocab) for token (B,) at start_pos: a graph replay on CUDA, else eager."""
        self.token.copy_(token.view(-1, 1))
        self.pos.fill_(start_pos)
        if self.model.device.type == "cuda":
            if self.graph is None:
                raise RuntimeError("capture() the graph before the prefill: its warm-up overwrites position 0")
            self.graph.replay()
            return self.logits
        return self.step(self.token, self.pos)

    @torch.inference_mode()
    def generate_timed(self, ids: torch.Tensor, new_tokens: int):
        """Returns (ttft_s, per-token latencies_s, token ids) of greedy decoding after prefill of ids (B, T)."""
        prompt_len = ids.shape[1]
        if prompt_len + new_tokens - 1 > self.cache.max_seq_len:
            raise ValueError(f"{prompt_len} prompt tokens + {new_tokens} new need {prompt_len + new_tokens - 1} "
                             f"cache positions, the graph's cache holds {self.cache.max_seq_len}")
        device = self.model.device
        if device.type == "cuda" and self.graph is None:
            self.capture()                     # before the prefill: capture's warm-up writes K/V at position 0
        self.cache.reset()
        synchronize(device)
        clock = time.perf_counter()
        token = self.model(ids, cache=self.cache, start_pos=0, last_only=True)[:, -1].argmax(-1)   # (B,)
        made = [token]
        synchronize(device)
        now = time.perf_counter()
        ttft, latencies, clock = now - clock, [], now
        for step in range(1, new_tokens):
            token = self.decode(token, prompt_len + step - 1).argmax(-1)
            made.append(token)
            synchronize(device)
            now = time.perf_counter()
            latencies.append(now - clock)
            clock = now
        rows = torch.stack(made, dim=1).tolist()
        return ttft, latencies, rows[0] if len(rows) == 1 else rows
