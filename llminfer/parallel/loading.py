"""Shard-on-read: each rank reads only its slice of every tensor from the safetensors files. Chapter 10.

    model = load_tensor_parallel("tiny-capitals", rank=r, world_size=2)   # inside a worker: group defaults
    model = load_pipeline_stage("tiny-capitals", stage=s, n_stages=2)

The model is built on the meta device (no memory), split by the same transform a loaded model would get
(`tensor_parallel`, `pipeline_stage`), and then each remaining parameter is filled from the file: a split one by
reading just its rows or columns through safetensors' lazy slices, a whole one in full, a dropped one not at all.
`model.parallel_load` records the bytes read, so a test can check that a rank read about 1/world_size.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from llminfer.checkpoint import (_FLOAT_STORAGE, _check_dtype, _empty_model, _hf_name, _locate, _meta_model,
                                 _read_json_object, _tensor_layout, _unreadable, _weight_files)
from llminfer.config import ModelConfig
from llminfer.device import check_fits, dtype_bytes, resolve_device
from llminfer.model import Transformer

from .tensor import Shard

__all__ = ["LoadReport", "load_sharded", "load_tensor_parallel", "load_pipeline_stage", "read_config"]


@dataclass
class LoadReport:
    """What a sharded load read from disk. Chapter 10."""

    bytes_read: int = 0           # bytes of tensor data taken from the files, in their stored dtype
    checkpoint_bytes: int = 0     # bytes of every tensor the model needs, in their stored dtype
    tensors_read: int = 0


_STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def read_config(path_or_name: str | Path) -> ModelConfig:
    """The ModelConfig of a model folder or bundled model, read from its config.json alone. Chapter 10."""
    folder = _locate(path_or_name)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    return ModelConfig.from_hf(_read_json_object(config_path))


def _read_shard(path: Path, name: str, shard: Shard | None, dtype: torch.dtype, device) -> torch.Tensor:
    """Rows or columns [start, stop) of one stored tensor (the whole of it for shard None), as a new tensor."""
    try:
        with safe_open(str(path), framework="pt") as f:
            lazy = f.get_slice(name)
            if shard is None:
                stored = lazy[:]
            elif shard.dim == 0:
                stored = lazy[shard.start:shard.stop]
            else:
                stored = lazy[:, shard.start:shard.stop]
    except Exception as exc:
        raise _unreadable(path, exc) from None
    converted = stored.to(dtype=dtype, copy=True).contiguous()
    del stored
    return converted.to(device)


def load_sharded(path_or_name: str | Path, transform, device=None, dtype: torch.dtype | None = None) -> Transformer:
    """A model built on meta, changed by transform(model) (which splits or drops modules), then filled with only
    the slices its parameters hold, read from the safetensors files. Chapter 10."""
    device = resolve_device(device)
    dtype = _check_dtype(dtype)
    folder = _locate(path_or_name)
    config = read_config(folder)
    files = _weight_files(folder)
    layout = _tensor_layout(files)
    expected = {_hf_name(name): tuple(p.shape) for name, p in _meta_model(config).named_parameters()}
    for hf, shape in expected.items():
        if hf not in layout:
            raise ValueError(f"the checkpoint has no tensor {hf!r} (expected shape {shape} from config.json)")
        stored_path, stored_shape, stored = layout[hf]
        if stored_shape != shape:
            raise ValueError(f"tensor {hf!r} has shape {stored_shape} in the checkpoint but config.json implies "
                             f"{shape}; the weights and config.json do not belong together")
        if stored not in _FLOAT_STORAGE:
            raise ValueError(f"tensor {hf!r} is stored as {stored} in {stored_path.name}; only floating-point "
                             f"weights ({', '.join(_FLOAT_STORAGE)}) load")
    model = transform(_empty_model(config, device))
    local_bytes = sum(p.numel() for p in model.parameters()) * dtype_bytes(dtype)
    check_fits(local_bytes, device, f"this process's share of the weights of {folder.name} in {dtype}")
    report = LoadReport(checkpoint_bytes=sum(
        _STORED_BYTES.get(layout[hf][2], 4) * _numel(shape) for hf, shape in expected.items()))

    rename = getattr(getattr(model, "parallel", None), "checkpoint_name", None) or (lambda name: name)

    def source_name(name: str) -> str:
        name = rename(name)                           # a pipeline stage numbers its layers from 0
        if name == "lm_head.weight" and config.tie_embeddings:
            return _hf_name("embed_tokens.weight")    # a tied head is stored once, as the embedding
        return _hf_name(name)

    def read(name: str, param: torch.Tensor) -> torch.Tensor:
        hf = source_name(name)
        stored_path, _shape, stored = layout[hf]
        module_name, _, _attr = name.rpartition(".")
        shard = getattr(model.get_submodule(module_name), "shard", None)
        tensor = _read_shard(stored_path, hf, shard, dtype, device)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"read {tuple(tensor.shape)} for {name} but the split model expects "
                             f"{tuple(param.shape)}")
        report.bytes_read += tensor.numel() * _STORED_BYTES.get(stored, 4)
        report.tensors_read += 1
        return tensor

    _fill_parameters(model, read)
    model.parallel_load = report
    return model.eval()


def _fill_parameters(model, read) -> None:
    """Replaces every (meta) parameter by read(name, param); a parameter held by two modules (a tied head)
    is read once and stays shared."""
    new = {id(param): torch.nn.Parameter(read(name, param), requires_grad=False)
           for name, param in list(model.named_parameters())}
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is not None and id(param) in new:
                module._parameters[attr] = new[id(param)]


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def load_tensor_parallel(path_or_name: str | Path, group=None, *, rank: int | None = None,
                         world_size: int | None = None, device=None, dtype: torch.dtype | None = None) -> Transformer:
    """This rank's shard of a tensor-parallel model, read slice by slice from its safetensors files. Chapter 10."""
    from .tensor import tensor_parallel

    return load_sharded(path_or_name, lambda m: tensor_parallel(m, group, rank=rank, world_size=world_size),
                        device=device, dtype=dtype)


def load_pipeline_stage(path_or_name: str | Path, stage: int, n_stages: int, group=None, device=None,
                        dtype: torch.dtype | None = None) -> Transformer:
    """The layers of one pipeline stage (and the embedding or head if it holds them), read from disk. Chapter 10."""
    from .pipeline import pipeline_stage

    return load_sharded(path_or_name, lambda m: pipeline_stage(m, stage, n_stages, group), device=device,
                        dtype=dtype)
