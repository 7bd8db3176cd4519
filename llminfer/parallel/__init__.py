"""Tensor, pipeline and expert parallelism on torch.distributed: gloo on the CPU, NCCL on GPUs, the same code.
Chapters 10 and 14.

    tensor_parallel(model, group)              split a model in place for one rank (Megatron-style)
    pipeline_stage(model, stage, n_stages)     keep one stage's layers; activations go by send/recv
    load_tensor_parallel(name, ...)            read only this rank's slices from the safetensors files
    load_pipeline_stage(name, stage, n)        read only this stage's layers
    launch(worker, args, world_size)           run worker(ctx, *args) in fresh processes (notebook or script)
    run_tensor_parallel / run_pipeline_parallel / measure_communication   the chapter's runs, checked first
    cost_model                                 memory per device, α–β communication, predicted step times
    expert                                     expert parallelism (chapter 14): all-to-all dispatch and combine

From a shell, the same runs go through torchrun: `torchrun --nproc-per-node 2 -m llminfer.parallel tp`.
"""
from . import cost_model, expert
from .launch import WorkerContext, WorkerError, check_worker, distributed_worker, launch
from .loading import load_pipeline_stage, load_sharded, load_tensor_parallel, read_config
from .pipeline import bubble_fraction, ideal_bubble_fraction, pipeline_generate, pipeline_stage
from .plan import (check_backend, check_port, pipeline_plan, split_micro_batches, tensor_parallel_plan)
from .tensor import CommStats, resident_bytes, tensor_parallel
from .workers import collective_waits, measure_communication, run_pipeline_parallel, run_tensor_parallel, stage_timeline

__all__ = [
    "cost_model", "expert", "WorkerContext", "WorkerError", "check_worker", "distributed_worker", "launch",
    "load_pipeline_stage", "load_sharded", "load_tensor_parallel", "read_config", "bubble_fraction",
    "ideal_bubble_fraction", "pipeline_generate", "pipeline_stage", "check_backend", "check_port", "pipeline_plan",
    "split_micro_batches", "tensor_parallel_plan", "CommStats", "resident_bytes", "tensor_parallel",
    "collective_waits", "measure_communication", "run_pipeline_parallel", "run_tensor_parallel", "stage_timeline",
]
