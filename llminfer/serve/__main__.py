"""`python -m llminfer.serve --model tiny-capitals --port 8000`: the OpenAI-compatible server. Chapter 11.

It listens on 127.0.0.1 (this machine only) unless --host names another address, which needs an API key
(--api-key or LLMINFER_API_KEY; clients send it as a Bearer token) or --allow-unauthenticated. Without a key it
answers only requests whose Host names the address it listens on or one of --allowed-hosts, so a web page cannot
reach it through DNS rebinding; CORS is closed unless --allowed-origins names origins. Ctrl-C (SIGINT) or
SIGTERM shuts it down gracefully: no new connections, in-flight requests finish for up to
--drain-timeout seconds, the rest are aborted, then the engine stops.

`--disaggregated` serves from a prefill worker and a decode worker in two more processes, K/V shipped between
them (`llminfer.serve.disagg`, chapter 12); this process routes. Both workers run on the CPU, each with
--threads threads (1 by default). They take no structured-output constraint: such requests get a 400 there.
"""
from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import sys

from ..checks import MIN_TEMPERATURE, HelpFormatter

# The server's default cap on the KV pool, as a share of free memory (the library's LLMEngine takes up to half):
# a server shares its machine, and short requests need far less than max_num_seqs full-length ones.
SERVE_KV_MEMORY_FRACTION = 0.05
# The server's default cap on the prompt tokens of a step that runs anything else (LLMEngine's max_prefill_tokens):
# prompts that arrive together start one after another, so most reach their first token in a short step.
SERVE_MAX_PREFILL_TOKENS = 64

__all__ = ["main", "parse_args", "build_server", "API_KEY_VARIABLE", "SERVE_KV_MEMORY_FRACTION",
           "SERVE_MAX_PREFILL_TOKENS"]

API_KEY_VARIABLE = "LLMINFER_API_KEY"


def is_loopback(host: str) -> bool:
    """Whether host is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _size(text: str) -> int:
    """Bytes from '536870912', '512MiB', '2GiB' or '1.5GB' (argparse type of --kv-cache-memory)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size like 536870912, '512MiB' or '2GiB'")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(match.group(1)) * scale)


def _dtype(text: str) -> str:
    """--dtype as the loader's one parser reads it, by its full name ('bf16' -> 'bfloat16'; 'auto' stays)."""
    from ..checkpoint import parse_dtype
    try:
        parsed = parse_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return parsed if parsed == "auto" else str(parsed).removeprefix("torch.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llminfer.serve", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="tiny-capitals", help="a bundled model's name, a folder, or a hub id")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes the server to the network")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="clients must send it as 'Authorization: Bearer <key>' on every /v1 route (default: the "
                        f"{API_KEY_VARIABLE} variable, which keeps it out of the process list)")
    p.add_argument("--allowed-hosts", nargs="+", default=(), metavar="HOST",
                   help="Host header values served beside the bound address's (name or name:port; checked when "
                        "there is no API key, and always once given)")
    p.add_argument("--allowed-origins", nargs="+", default=(), metavar="ORIGIN",
                   help="web origins (https://app.example) whose pages may read responses through CORS "
                        "(default: none, CORS closed)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without an API key (anyone who reaches it may use it)")
    p.add_argument("--device", default=None, help="cpu, cuda, mps (default: the best available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--dtype", default=None, type=_dtype,
                   help="weights and KV cache dtype: float32, bfloat16, float16 (or fp32, bf16, fp16, ...), or auto "
                        "for the checkpoint's own (default: float32, the book's default)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output a request may have (default: the model's context length)")
    p.add_argument("--no-optimize", action="store_true",
                   help="run the model as written instead of the fast path (fused projections, native kernels)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: from free memory)")
    p.add_argument("--kv-cache-memory", type=_size, default=None,
                   help="KV pool size in bytes, e.g. 512MiB or 2GiB (default: what --max-num-seqs full-length "
                        "requests need, at most --kv-memory-fraction of the free memory)")
    p.add_argument("--kv-memory-fraction", type=float, default=SERVE_KV_MEMORY_FRACTION,
                   help="with neither --num-blocks nor --kv-cache-memory, the largest share of free memory the KV "
                        "pool takes")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-prefill-tokens", type=int, default=SERVE_MAX_PREFILL_TOKENS,
                   help="the most prompt tokens a step runs beside decodes or another prompt's chunk (a step with "
                        "nothing else may take --max-num-batched-tokens); 0: no cap")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--prefix-cache", choices=("hash", "radix"), default="hash",
                   help="how cached prefixes are found: chapter 06's block hashes or chapter 13's radix tree")
    p.add_argument("--max-structured-states", type=int, default=100_000,
                   help="the most automaton states a structured-output pattern (response_format, structured_outputs) "
                        "may compile to; a larger one gets HTTP 400 before any compute")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--max-queued-requests", type=int, default=128,
                   help="requests allowed to wait for the engine; more get HTTP 429")
    p.add_argument("--drain-timeout", type=float, default=10.0, help="seconds in-flight requests get at shutdown")
    p.add_argument("--default-temperature", type=float, default=1.0,
                   help="temperature for requests that leave it unset (the OpenAI API's default is 1)")
    p.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                   help="largest request body accepted; larger ones get HTTP 413")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client has to send a request's headers before its connection is closed")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's body once its headers are in")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0, help="seconds an idle connection stays open")
    p.add_argument("--max-connections", type=int, default=256,
                   help="concurrent connections; more get HTTP 503")
    p.add_argument("--disaggregated", action="store_true",
                   help="prefill and decode in two worker processes, K/V shipped between them (chapter 12; CPU)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        p.error(f"--port must lie in 0..65535, got {args.port}")
    try:
        ipaddress.ip_address(args.host)
    except ValueError:
        if args.host != "localhost":
            p.error(f"--host must be an IP address (127.0.0.1 for this machine only), got {args.host!r}")
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_VARIABLE) or None
    if args.api_key is not None and (not args.api_key.strip() or not args.api_key.isprintable()):
        p.error("--api-key must be a non-empty printable string")
    if not is_loopback(args.host) and args.api_key is None and not args.allow_unauthenticated:
        p.error(f"--host {args.host} exposes the server to the network, but no API key is set: pass --api-key (or "
                f"set {API_KEY_VARIABLE}), or --allow-unauthenticated to serve it open to anyone")
    if args.max_model_len is not None and args.max_model_len < 1:
        p.error(f"--max-model-len must be >= 1, got {args.max_model_len}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    for flag, value, low in (("--max-queued-requests", args.max_queued_requests, 1),
                             ("--block-size", args.block_size, 1), ("--num-blocks", args.num_blocks, 1),
                             ("--max-num-seqs", args.max_num_seqs, 1),
                             ("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
                             ("--max-prefill-tokens", args.max_prefill_tokens, 0),
                             ("--max-request-bytes", args.max_request_bytes, 1024),
                             ("--max-connections", args.max_connections, 1),
                             ("--max-structured-states", args.max_structured_states, 1)):
        if value is not None and value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    for flag, value, low in (("--drain-timeout", args.drain_timeout, 0.0),
                             ("--header-timeout", args.header_timeout, 0.001),
                             ("--body-timeout", args.body_timeout, 0.001),
                             ("--keep-alive-timeout", args.keep_alive_timeout, 0.001)):
        if not math.isfinite(value) or value < low:
            p.error(f"{flag} must be a finite number of seconds >= {low:g}, got {value}")
    if not math.isfinite(args.kv_memory_fraction) or not 0 < args.kv_memory_fraction <= 1:
        p.error(f"--kv-memory-fraction must lie in (0, 1], got {args.kv_memory_fraction}")
    if args.kv_cache_memory is not None and args.num_blocks is not None:
        p.error("pass --num-blocks or --kv-cache-memory, not both")
    t = args.default_temperature
    if not math.isfinite(t) or not (t == 0 or MIN_TEMPERATURE <= t <= 2):
        p.error(f"--default-temperature must be 0 (greedy) or lie in {MIN_TEMPERATURE:.3g}..2, got {t}")
    if args.disaggregated and args.device not in (None, "cpu"):
        p.error(f"--disaggregated runs both workers on the CPU, got --device {args.device}; drop --device")
    return args


def build_server(args: argparse.Namespace):
    """Loads the model and returns the FastAPI app for these arguments."""
    import torch

    import llminfer
    from llminfer.checkpoint import model_folder

    from .server import ServeConfig, build_app
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model, tokenizer = llminfer.load_pretrained(args.model, device="cpu" if args.disaggregated else args.device,
                                                dtype=args.dtype)
    folder = model_folder(args.model)
    add_bos = False
    try:
        import json
        add_bos = bool(json.loads((folder / "tokenizer_config.json").read_text()).get("add_bos_token", False))
    except (OSError, ValueError):
        pass
    config = ServeConfig(
        model_name=args.served_model_name or args.model, max_queued_requests=args.max_queued_requests,
        drain_timeout_s=args.drain_timeout, default_temperature=args.default_temperature, add_bos=add_bos,
        max_request_bytes=args.max_request_bytes, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
        max_connections=args.max_connections, api_key=args.api_key, allowed_hosts=tuple(args.allowed_hosts),
        allowed_origins=tuple(args.allowed_origins), max_structured_states=args.max_structured_states,
        engine_kwargs=dict(block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                           kv_cache_memory=args.kv_cache_memory, kv_memory_fraction=args.kv_memory_fraction,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           max_prefill_tokens=args.max_prefill_tokens or None,
                           enable_prefix_caching=not args.no_prefix_caching, prefix_cache=args.prefix_cache,
                           chunked_prefill=not args.no_chunked_prefill, max_model_len=args.max_model_len,
                           optimize=not args.no_optimize))
    if not args.disaggregated:
        return build_app(model, tokenizer, config, model_folder=folder)
    from .disagg import DisaggregatedEngine, ModelSpec
    from .server import OpenAIServer
    weights_dtype = str(model.dtype).removeprefix("torch.")     # --dtype auto resolved by the load
    del model                                  # the workers load their own copies
    threads = args.threads or 1
    decode_kwargs = {k: v for k, v in config.engine_kwargs.items() if k != "optimize"}   # workers run as written
    pair = DisaggregatedEngine(ModelSpec(name=args.model, dtype=weights_dtype), decode_kwargs,
                               prefill_threads=threads,
                               decode_threads=threads).start()
    try:
        server = OpenAIServer(None, tokenizer, config, engine=pair, model_folder=folder, close_engine=True)
    except BaseException:
        pair.close()
        raise
    return build_app(server=server)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import uvicorn

    from .limits import uvicorn_options
    app = build_server(args)
    state = app.state.server
    where = "this machine only" if is_loopback(args.host) else "reachable from the network"
    where += ", API key required" if args.api_key else ", no API key"
    print(f"llminfer: serving {state.config.model_name!r} on http://{args.host}:{args.port}/v1 ({where}); "
          f"{state.engine!r}", file=sys.stderr, flush=True)
    sizing = getattr(state.engine, "pool_sizing", None)
    if sizing is not None:
        print(f"llminfer: KV pool {state.engine.cache.nbytes / 2**20:.1f} MiB = {sizing}", file=sys.stderr,
              flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=max(1, int(round(args.drain_timeout))), **uvicorn_options(state.config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
