"""Decode steps replayed from a CUDA graph over a static KV cache: no per-kernel launch cost. Chapter 04.

A decode step launches a few hundred small kernels; on a GPU, launching them can take longer than
running them. A CUDA graph records the whole step once and replays it with one launch. Replay needs
every tensor at a fixed address and shape, so the graph captures the model's one forward with a
*static* cache: the position is a device tensor (not a Python int), K/V are written with
`index_copy_` into the preallocated buffers, and attention runs over the whole buffer with a mask
that hides the positions not yet written. Nothing here re-implements a layer. `step` runs the same
forward eagerly on any device, which is how the CPU tests check it against `decode_step`.
"""
from __future__ import annotations

import torch

from .generate import GenerationResult, TokenTimer, as_token_batch, prefill
from .static_cache import StaticKVCache

__all__ = ["GraphedDecoder", "static_decode"]


def static_decode(cache, token_buffer: torch.Tensor, position_buffer: torch.Tensor, token: torch.Tensor,
                  run) -> torch.Tensor:
    """One token (B,) at position cache.length through fixed input buffers: fills them, calls run() (a graph
    replay or a compiled step of the model's forward) for the logits (B, vocab), then advances the cache. Chapter 04."""
    if cache.length >= cache.capacity:
        raise ValueError(f"the decoder's cache is full ({cache.capacity} positions); make the decoder with a "
                         "larger max_seq_len")
    token_buffer.copy_(token.view(-1, 1))
    position_buffer.fill_(cache.length)
    logits = run()
    cache.length = cache.length + 1          # the step wrote one position; the cache's length follows
    return logits


class GraphedDecoder:
    """Greedy decoding whose steps replay one captured CUDA graph (eager `step` elsewhere). Chapter 04."""

    def __init__(self, model, batch_size: int = 1, max_seq_len: int | None = None):
        self.model = model
        self.cache = StaticKVCache.for_model(model, batch_size, max_seq_len)     # written at a positions tensor
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=model.device)   # (B, 1) static input
        self.position = torch.zeros(1, dtype=torch.long, device=model.device)            # (1,) static input
        self.graph = None
        self.logits = None                                                    # (B, vocab) static output

    @torch.inference_mode()
    def step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Returns logits (B, vocab) for token (B, 1) at `position` (1,), writing its K/V there: the model's forward."""
        return self.model(token, positions=position, cache=self.cache)[:, -1]

    def capture(self, warmup: int = 3) -> None:
        """Records one decode step into a CUDA graph (after warm-up runs on a side stream)."""
        if self.model.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA model, this one is on {self.model.device}; "
                               "use step() for eager decoding")
        self.model.rope_tables(self.model.config.max_seq_len)    # grown now, never during capture
        self.position.fill_(0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.step(self.token, self.position)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.step(self.token, self.position)

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """Returns logits (B, vocab) for token (B,) at position cache.length: a graph replay on CUDA, else eager."""
        if self.model.device.type == "cuda" and self.graph is None:
            raise RuntimeError("capture() the graph before the prefill: its warm-up overwrites position 0")
        return static_decode(self.cache, self.token, self.position, token, self._replay)

    def _replay(self) -> torch.Tensor:
        if self.model.device.type == "cuda":
            self.graph.replay()
            return self.logits
        return self.step(self.token, self.position)

    @torch.inference_mode()
    def generate(self, input_ids, max_new_tokens: int) -> GenerationResult:
        """Greedy decoding of max_new_tokens after a prefill of input_ids, timed like `generate`. Chapter 04."""
        ids = as_token_batch(input_ids)
        prompt_len = ids.shape[1]
        if ids.shape[0] != self.cache.batch_size:
            raise ValueError(f"the graph was built for batch_size={self.cache.batch_size}, got {ids.shape[0]} "
                             "sequences; make a GraphedDecoder for this batch")
        if max_new_tokens < 1 or prompt_len + max_new_tokens - 1 > self.cache.capacity:
            raise ValueError(f"{prompt_len} prompt tokens + {max_new_tokens} new need {prompt_len + max_new_tokens - 1} "
                             f"cache positions, the graph's cache holds {self.cache.capacity}; "
                             "pass a larger max_seq_len or fewer tokens (at least 1)")
        device = self.model.device
        if device.type == "cuda" and self.graph is None:
            self.capture()                     # before the prefill: capture's warm-up writes K/V at position 0
        self.cache.reset()
        timer = TokenTimer(device)
        timer.start()
        token = prefill(self.model, ids.to(device), self.cache).argmax(-1)          # (B,)
        made = [token]
        timer.token()
        for _ in range(1, max_new_tokens):
            token = self.decode(token).argmax(-1)
            made.append(token)
            timer.token()
        rows = torch.stack(made, dim=1).tolist()
        return timer.result(rows[0] if len(rows) == 1 else rows, prompt_len)
