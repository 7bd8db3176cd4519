"""`python -m llminfer.serve --model tiny-capitals --port 8000`: the OpenAI-compatible server. Chapter 11.

It listens on 127.0.0.1 (this machine only) unless --host names another address. Ctrl-C (SIGINT) or
SIGTERM shuts it down gracefully: no new connections, in-flight requests finish for up to
--drain-timeout seconds, the rest are aborted, then the engine stops.

`--disaggregated` serves from a prefill worker and a decode worker in two more processes, K/V shipped between
them (`llminfer.serve.disagg`, chapter 12); this process routes. Both workers run on the CPU, each with
--threads threads (1 by default).
"""
from __future__ import annotations

import argparse
import ipaddress
import sys

__all__ = ["main", "parse_args", "build_server"]

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llminfer.serve", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-capitals", help="a bundled model's name, a folder, or a hub id")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes the server to the network")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cpu, cuda, mps (default: the best available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                   help="weights and KV cache dtype (default: float32, the book's default)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output a request may have (default: the model's context length)")
    p.add_argument("--no-optimize", action="store_true",
                   help="run the model as written instead of the fast path (fused projections, native kernels)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: from free memory)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--max-queued-requests", type=int, default=128,
                   help="requests allowed to wait for the engine; more get HTTP 429")
    p.add_argument("--drain-timeout", type=float, default=10.0, help="seconds in-flight requests get at shutdown")
    p.add_argument("--default-temperature", type=float, default=1.0,
                   help="temperature for requests that leave it unset (the OpenAI API's default is 1)")
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
    if args.max_model_len is not None and args.max_model_len < 1:
        p.error(f"--max-model-len must be >= 1, got {args.max_model_len}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.max_queued_requests < 1:
        p.error(f"--max-queued-requests must be >= 1, got {args.max_queued_requests}")
    if args.drain_timeout < 0:
        p.error(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
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
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    model, tokenizer = llminfer.load_pretrained(args.model, device="cpu" if args.disaggregated else args.device,
                                                dtype=dtype)
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
        engine_kwargs=dict(block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           enable_prefix_caching=not args.no_prefix_caching,
                           chunked_prefill=not args.no_chunked_prefill, max_model_len=args.max_model_len,
                           optimize=not args.no_optimize))
    if not args.disaggregated:
        return build_app(model, tokenizer, config, model_folder=folder)
    from .disagg import DisaggregatedEngine, ModelSpec
    from .server import OpenAIServer
    del model                                  # the workers load their own copies
    threads = args.threads or 1
    decode_kwargs = {k: v for k, v in config.engine_kwargs.items() if k != "optimize"}   # workers run as written
    pair = DisaggregatedEngine(ModelSpec(name=args.model, dtype=_DTYPES[args.dtype or "float32"]), decode_kwargs,
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
    app = build_server(args)
    state = app.state.server
    where = "this machine only" if args.host in ("127.0.0.1", "localhost", "::1") else "reachable from the network"
    print(f"llminfer: serving {state.config.model_name!r} on http://{args.host}:{args.port}/v1 ({where}); "
          f"{state.engine!r}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=max(1, int(round(args.drain_timeout))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
