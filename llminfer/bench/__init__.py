"""`python -m llminfer.bench <what>`: prefill and decode beside the machine's measured ceilings and beside peers. Chapter 04.

    prefill-decode   ceilings, prefill, decode contenders, batch sweep, context scaling, the engine section (ch. 04)
    decode           decode at every precision beside llama.cpp, transformers and the bandwidth (chapter 08)
    real             llminfer against llama.cpp on one real GGUF file (chapter 08)
    engine           batching, chunked prefill, prefix caching, KV memory (chapters 05-06)
    serve            load-test a server, or llminfer's against vLLM's (chapter 11)
    gpu              make test-gpu: every CUDA path on one GPU (< 10 minutes)
    llama-cpp        build the llama.cpp peer at its best for this CPU (make peer-llama-cpp), or print its options
    structured       JSON parse/validity rates free and constrained; radix tree vs block hashes (chapter 13)
    moe              an MoE layer's experts by a loop and grouped, prefill and decode, beside the bytes (ch. 14)

The layer they share, each part written once:

    measure     contenders taking turns (`llminfer.timing.interleave`), thread counts, shapes, ceiling probes
    report      the machine's description, the load, and the writer of JSON + table + plot
    figures     MFU, MBU, ratios and the roofline, as pure functions of timings
    transformers_contender   transformers `generate` on the same weights, as a GenerationResult

For the chapters, as functions: `moe.time_experts` (chapter 14) times an MoE layer's experts run by a loop and
grouped by expert, in one interleaved run, beside the bytes each call reads.
"""
from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Runs `python -m llminfer.bench <what> [options]` (argv without the program); returns its exit status."""
    from .cli import main as run_command_line

    return run_command_line(argv)
