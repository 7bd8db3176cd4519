"""`python -m llminfer.parallel tp|pp`: a tensor- or pipeline-parallel generation, from a shell. Chapter 10.

Started by torchrun, each process joins the group torchrun set up:

    torchrun --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29511 \\
        -m llminfer.parallel tp --prompt "The capital of France is" --check

Started by itself, it launches the processes (--world-size of them) the way a notebook does:

    python -m llminfer.parallel pp --world-size 2 --micro-batches 2

Rank 0 prints the generated text, what each rank holds, and with --check whether the tokens match an unsplit
model's in this process.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from llminfer.checkpoint import load_tokenizer, model_folder

from .launch import distributed_worker
from .loading import read_config
from .plan import pipeline_plan, tensor_parallel_plan
from .workers import RunSpec, pp_worker, run_pipeline_parallel, run_tensor_parallel, tp_worker


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m llminfer.parallel", description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["tp", "pp"], help="tensor parallel or pipeline parallel")
    parser.add_argument("--model", default="tiny-capitals", help="a bundled model's name or a model folder")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (ignored under torchrun)")
    parser.add_argument("--micro-batches", type=int, default=1, help="pp: micro-batches (the prompt is repeated "
                        "this many times to make a batch)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    parser.add_argument("--port", type=int, default=None, help="rendezvous port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--check", action="store_true", help="compare the tokens with an unsplit model's")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    folder = model_folder(args.model)
    config = read_config(folder)
    tokenizer = load_tokenizer(folder)
    prompt = [tokenizer.encode(args.prompt)] * (args.micro_batches if args.mode == "pp" else 1)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.world_size
    if args.mode == "tp":
        tensor_parallel_plan(config, world_size)
    else:
        pipeline_plan(config, world_size)
    spec = RunSpec(str(folder), prompt, args.new_tokens, micro_batches=(args.micro_batches,),
                   return_logits=False)
    if under_torchrun:
        with distributed_worker(args.backend) as ctx:
            result = (tp_worker if args.mode == "tp" else pp_worker)(ctx, spec)
            rank, backend = ctx.rank, ctx.backend
        if rank != 0:
            return 0
        results = [result]
    else:
        run = run_tensor_parallel if args.mode == "tp" else run_pipeline_parallel
        kwargs = {"world_size": world_size} if args.mode == "tp" else {"n_stages": world_size,
                                                                       "micro_batches": (args.micro_batches,),
                                                                       "record": False}
        results = run(str(folder), prompt, args.new_tokens, backend=args.backend, port=args.port, **kwargs)
        backend = args.backend or "default"
    if args.mode == "tp":
        tokens = results[0]["token_ids"]
    else:
        tokens = results[0]["runs"][args.micro_batches]["token_ids"][0]     # every stage holds the tokens
    print(f"{args.mode} over {world_size} processes ({backend}): {args.prompt!r} -> {tokenizer.decode(tokens)!r}")
    for result in results:
        where = (f"heads {result['local_heads']}, K/V heads {result['kv_head_range']}" if args.mode == "tp"
                 else f"layers {result['layers'][0]}..{result['layers'][1] - 1}")
        print(f"  rank {result['rank']}: {where}, {result['resident_bytes'] / 2**20:.2f} MiB of weights, "
              f"{result['bytes_read'] / 2**20:.2f} of {result['checkpoint_bytes'] / 2**20:.2f} MiB read from disk")
    if args.check:
        import llminfer

        model, _ = llminfer.load_pretrained(folder, load_tokenizer=False)
        reference = llminfer.generate(model, prompt[:1], max_new_tokens=args.new_tokens, ignore_eos=True).token_ids
        same = reference == tokens
        print(f"same tokens as one process: {same}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
