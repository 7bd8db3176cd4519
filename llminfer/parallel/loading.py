"""Shard-on-read: each rank reads only its slice of every tensor from the checkpoint. Chapter 10.

    model = load_tensor_parallel("tiny-capitals", rank=r, world_size=2)   # inside a worker: group defaults
    model = load_pipeline_stage("tiny-capitals", stage=s, n_stages=2)

The one checkpoint reader (`llminfer.checkpoint.read_model`) builds the model on the meta device (no memory);
the transform here splits it by the same function a loaded model would get (`tensor_parallel`,
`pipeline_stage`) and tells the reader which slice each remaining parameter holds: a split one is read as just
its rows or columns through safetensors' lazy slices, a whole one in full, a dropped one not at all.
`model.parallel_load` records the bytes read, so a test can check that a rank read about 1/world_size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from llminfer.checkpoint import ReadTransform, check_layout, expected_shapes, open_checkpoint, read_config, read_model
from llminfer.model import Transformer

__all__ = ["LoadReport", "load_sharded", "load_tensor_parallel", "load_pipeline_stage", "read_config"]


@dataclass
class LoadReport:
    """What a sharded load read from disk. Chapter 10."""

    bytes_read: int = 0           # bytes of tensor data taken from the files, in their stored dtype
    checkpoint_bytes: int = 0     # bytes of every tensor the model needs, in their stored dtype
    tensors_read: int = 0


class ShardOnRead(ReadTransform):
    """The reader's transform for one rank: split the model by `split`, read each parameter's shard. Chapter 10."""

    def __init__(self, split, report: LoadReport):
        self.split, self.report = split, report

    def prepare(self, model: Transformer) -> Transformer:
        self.model = self.split(model)
        return self.model

    def source(self, name: str, module) -> tuple[str, object]:
        rename = getattr(getattr(self.model, "parallel", None), "checkpoint_name", None)
        return (rename(name) if rename else name), getattr(module, "shard", None)   # a stage numbers from 0

    def what(self, checkpoint, dtype) -> str:
        return f"this process's share of the weights of {checkpoint.name} in {dtype}"

    def read(self, name: str, entry, tensor: torch.Tensor) -> None:
        self.report.bytes_read += entry.nbytes * tensor.numel() // max(1, math.prod(entry.shape))
        self.report.tensors_read += 1


def load_sharded(path_or_name: str | Path, transform, device=None, dtype: torch.dtype | None = None) -> Transformer:
    """A model built on meta, changed by transform(model) (which splits or drops modules), then filled with only
    the slices its parameters hold, read from the checkpoint. Chapter 10."""
    checkpoint = open_checkpoint(path_or_name)
    expected = expected_shapes(checkpoint.config)
    check_layout(checkpoint, expected)
    report = LoadReport(checkpoint_bytes=sum(checkpoint.tensors[checkpoint.source_name(n)].nbytes for n in expected))
    model = read_model(checkpoint, ShardOnRead(transform, report), device=device, dtype=dtype)
    model.parallel_load = report
    return model


def load_tensor_parallel(path_or_name: str | Path, group=None, *, rank: int | None = None,
                         world_size: int | None = None, device=None, dtype: torch.dtype | None = None) -> Transformer:
    """This rank's shard of a tensor-parallel model, read slice by slice from its checkpoint. Chapter 10."""
    from .tensor import tensor_parallel

    return load_sharded(path_or_name, lambda m: tensor_parallel(m, group, rank=rank, world_size=world_size),
                        device=device, dtype=dtype)


def load_pipeline_stage(path_or_name: str | Path, stage: int, n_stages: int, group=None, device=None,
                        dtype: torch.dtype | None = None) -> Transformer:
    """The layers of one pipeline stage (and the embedding or head if it holds them), read from disk. Chapter 10."""
    from .pipeline import pipeline_stage

    return load_sharded(path_or_name, lambda m: pipeline_stage(m, stage, n_stages, group), device=device,
                        dtype=dtype)
