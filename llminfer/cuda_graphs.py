"""The static decoder: one-token steps over a static KV cache, run eagerly, compiled, or replayed from a CUDA graph.
Chapters 04 and 08.

A decode step launches a few hundred small kernels; on a GPU, launching them can take longer than
running them. A CUDA graph records the whole step once and replays it with one launch. Replay needs
every tensor at a fixed address and shape, so the graph captures the model's one forward with a
*static* cache: the position is a device tensor (not a Python int), K/V are written with
`index_copy_` into the preallocated buffers, and attention runs over the whole buffer with a mask
that hides the positions not yet written. The same fixed shapes let `torch.compile` make one graph for
every step (chapter 08). Nothing here re-implements a layer, and nothing here loops over tokens:
`StaticDecoder` is a step strategy of `llminfer.generate`'s one token loop, whatever runs its step.

    decoder = StaticDecoder(model, max_seq_len=64, mode="graph")      # or "compiled", or "eager"
    result = llminfer.generate(model, ids, max_new_tokens=16, step=decoder)   # = decoder.generate(ids, 16)

Mode "eager" runs the same static step on any device, which is how the CPU tests check it against
`decode_step`.
"""
from __future__ import annotations

import contextlib
import types
from abc import ABC, abstractmethod
from typing import ContextManager

import torch

from .generate import GenerationResult, check_capacity, check_request, prefill, token_loop
from .model import Transformer
from .static_cache import StaticKVCache
from .timing import stopwatch

__all__ = ["StaticDecoder", "NativeStep", "static_decode", "COMPILE_OPTIONS", "MODES"]


class NativeStep(ABC):
    """A layer stack that keeps its weights and a cache's buffers in native code and runs a step from them (chapter
    08's `llminfer.fast.NativeDecoderStack`). A StaticDecoder whose model's stack is one prepares it for its cache
    before its step is compiled, and traces the step with what was prepared pinned, so the compiled step hands over
    x, the RoPE rows and the positions alone. Chapter 08."""

    @abstractmethod
    def prepare(self, cache) -> object | None:
        """Returns the stack's weights and `cache`'s buffers kept in native code; None where it cannot run there."""

    @abstractmethod
    def pinned(self, prepared: object | None, cache) -> ContextManager:
        """Inside the block, a forward over `cache` that the stack can take runs `prepared`."""

MODES = ("eager", "compiled", "graph")

# inductor settings of the compiled step: weights frozen as constants (prepacked for the matmul kernels),
# and no size assertions in the generated wrapper (the shapes are static; each assertion is Python work in
# every step). max_autotune (benchmarking matmul templates per shape) is left off: on a 2-core CPU it
# multiplies the compile time by several for the same step.
COMPILE_OPTIONS = {"freezing": True, "size_asserts": False}


def static_decode(cache, token_buffer: torch.Tensor, position_buffer: torch.Tensor, token: torch.Tensor,
                  run) -> torch.Tensor:
    """One token (B,) at position cache.length through fixed input buffers: fills them, calls run() (a graph
    replay or a compiled step of the model's forward) for the logits (B, vocab), then advances the cache. Chapter 04."""
    if cache.length >= cache.capacity:
        raise ValueError(f"the decoder's cache is full ({cache.capacity} positions); make the decoder with a "
                         "larger max_seq_len")
    token_buffer.copy_(token.reshape(-1, 1))
    position_buffer.fill_(cache.length)
    logits = run()
    cache.length = cache.length + 1          # the step wrote one position; the cache's length follows
    return logits


class StaticDecoder:
    """The token loop's step over a static KV cache: the model's forward, eager, compiled or a CUDA graph.
    Chapters 04 and 08.

    The prefill runs the model's forward eagerly into the cache, as `llminfer.generate` does; each later token
    is one static step (`decode`). mode="compiled" compiles that step with `torch.compile` (backend, options,
    dynamic; specialize=True, inductor only, drops the guards on the model's modules, so the step is tied to
    the model as it was compiled and a changed model needs a new decoder); mode="graph" captures it in a CUDA
    graph (a CUDA model only). `compile_s` is the time the first compiled call or the capture took.
    """

    def __init__(self, model, batch_size: int = 1, max_seq_len: int | None = None, mode: str = "eager",
                 options: dict | None = None, dynamic: bool = False, backend: str = "inductor",
                 specialize: bool = True):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if mode == "graph" and model.config.is_moe:
            raise ValueError("a mixture-of-experts model cannot be captured in a CUDA graph: each step reads how many "
                             "tokens each expert got on the host to slice its products (llminfer.moe), which a "
                             "captured graph would replay with the first step's counts; use mode='eager' or "
                             "'compiled'")
        if mode == "graph" and model.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA model, this one is on {model.device}; use mode='eager' "
                               "(or 'compiled') elsewhere")
        self.model = model
        self.mode = mode
        self.cache = StaticKVCache.for_model(model, batch_size, max_seq_len)     # written at a positions tensor
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=model.device)   # (B, 1) static input
        self.position = torch.zeros(1, dtype=torch.long, device=model.device)            # (1,) static input
        self.graph = None
        self.logits = None                                             # (B, vocab) the graph's static output
        self.compile_s = 0.0
        self.threads = torch.get_num_threads()
        self.options = None
        self._trace_options: dict = {}
        self._prepared_stack = None                 # the weights and caches a compiled native step uses, kept here
        self._ready = mode == "eager"
        model.rope_tables(model.config.max_seq_len)                   # grown now, never inside a graph
        if mode == "compiled":
            self._compile(options, dynamic, backend, specialize)

    def _compile(self, options, dynamic: bool, backend: str, specialize: bool) -> None:
        self.options = dict(COMPILE_OPTIONS if options is None else options) if backend == "inductor" else None
        options = self.options
        if options is not None and specialize:
            # no guards on the model's modules: checking them before every step costs more than a millisecond
            # for a 30-layer model. The step is specialised to the model as it is now; changing the model
            # (its weights' identity, its attention backend) afterwards needs a new decoder.
            options = dict(options, guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe)
        # Each decoder compiles its own copy of the step's code: torch.compile keeps its compiled graphs (and
        # their guards) per code object, and without module guards two decoders sharing one code object
        # could run each other's graphs.
        code = StaticDecoder._forward.__code__
        forward = types.FunctionType(code.replace(co_name=f"decode_step_{id(self):x}",
                                                  co_qualname=f"StaticDecoder.decode_step_{id(self):x}"),
                                     StaticDecoder._forward.__globals__)
        self._compiled = torch.compile(types.MethodType(forward, self), backend=backend, options=options,
                                       dynamic=dynamic, fullgraph=True)
        # Specialised, the step also takes the model's tensors (weights, cache buffers) as part of the graph
        # rather than as inputs gathered from the modules before every call: dynamo's `install_free_tensors`,
        # set while the step is traced. That gathering cost about 0.2 ms of each step (3% of a bfloat16 step
        # of a 135M model).
        self._trace_options = {"install_free_tensors": True} if options is not None and specialize else {}

    def _forward(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self.model(token, positions=position, cache=self.cache)[:, -1]           # (B, vocab)

    @torch.inference_mode()
    def step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Returns logits (B, vocab) for token (B, 1) at `position` (1,), writing its K/V there: the model's forward
        over the static cache, compiled in mode 'compiled'."""
        return self._compiled(token, position) if self.mode == "compiled" else self._forward(token, position)

    def _run(self) -> torch.Tensor:
        """The step over the fixed buffers: eager, compiled (traced on its first call), or a graph replay."""
        if self.mode == "graph":
            if self.graph is None:
                raise RuntimeError("capture the graph (warmup()) before the prefill: its warm-up overwrites "
                                   "position 0")
            self.graph.replay()
            return self.logits
        if not self._ready:
            return self._first_compiled_call()
        return self.step(self.token, self.position)

    def _first_compiled_call(self) -> torch.Tensor:
        """The compiled step's first call, which traces and compiles it, under the decoder's tracing options."""
        import torch._dynamo

        self._check_threads()
        with stopwatch(self.model.device) as watch, torch._dynamo.config.patch(**self._trace_options):
            with self._native_step():
                logits = self.step(self.token, self.position)
        self.compile_s = watch.seconds
        self._ready = True
        return logits

    @contextlib.contextmanager
    def _native_step(self):
        """While the step is traced: a layer stack that runs natively (a `NativeStep`) keeps its weights and this
        decoder's cache buffers (`prepare`), and the step is traced with them pinned, so the compiled step does not
        hand them over each time; the decoder keeps what was prepared (the step is tied to these weights and caches,
        as a specialised step is to its model)."""
        stack = self.model.layers if isinstance(self.model, Transformer) else None
        if not isinstance(stack, NativeStep):
            yield
            return
        self._prepared_stack = stack.prepare(self.cache)
        with stack.pinned(self._prepared_stack, self.cache):
            yield

    @torch.inference_mode()
    def warmup(self, runs: int = 3) -> float:
        """Compiles the step, or captures its CUDA graph (after `runs` warm-up steps on a side stream), if not yet
        done; returns the seconds that took (0.0 eager). The cache is left empty."""
        if not self._ready:
            self.position.fill_(0)
            if self.mode == "compiled":
                self._first_compiled_call()
            else:
                with stopwatch(self.model.device) as watch:
                    self._capture(runs)
                self.compile_s = watch.seconds
                self._ready = True
        self.cache.reset()
        return self.compile_s

    def _capture(self, runs: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(runs):
                self.step(self.token, self.position)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.step(self.token, self.position)

    def _check_threads(self) -> None:
        if self.mode == "compiled" and torch.get_num_threads() != self.threads:
            raise RuntimeError(f"the decoder was made with {self.threads} threads but torch now uses "
                               f"{torch.get_num_threads()}; compiled CPU code keeps its thread count, so make the "
                               "decoder under the thread count it will run with")

    # --- the step strategy of llminfer.generate's token loop ---------------------------------------------------

    def prepare(self, ids: torch.Tensor, max_new_tokens: int) -> None:
        """Refuses a request that does not fit (batch, cache, thread count), then compiles or captures if not yet
        done and empties the cache; before any compute of the request."""
        batch, prompt_len = ids.shape
        if batch != self.cache.batch_size:
            raise ValueError(f"the decoder was built for batch_size={self.cache.batch_size}, got {batch} sequences; "
                             "make a StaticDecoder for this batch")
        check_capacity(prompt_len, max_new_tokens, self.cache.capacity)
        self._check_threads()
        self.warmup()                          # before the prefill: a capture's warm-up writes K/V at position 0

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Eager forward over the prompt (B, T) into the empty cache; returns the last logits (B, vocab)."""
        self.cache.reset()
        return prefill(self.model, ids, self.cache, check_ids=False)  # checked by check_request, untimed

    @torch.inference_mode()
    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """Returns logits (B, vocab) for token (B,) at position cache.length: one static step."""
        return static_decode(self.cache, self.token, self.position, token, self._run)

    def generate(self, input_ids, max_new_tokens: int = 16, eos_token_id: int | None = None,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, return_logits: bool = False, min_p: float | None = None,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0) -> GenerationResult:
        """Up to max_new_tokens after the prompt through the one token loop, with this decoder's steps; returns
        the tokens with their TTFT/ITL timings (greedy by default). min_p and the penalties are chapter 13's
        processors, as in `llminfer.generate`. Chapters 04 and 08."""
        processors = dict(min_p=min_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty)
        ids = check_request(self.model.config, input_ids, max_new_tokens, eos_token_id, temperature, top_k, top_p,
                            seed, capacity=self.cache.capacity, **processors)
        return token_loop(self, ids, max_new_tokens, eos_token_id, temperature, top_k, top_p, seed, return_logits,
                          **processors)
