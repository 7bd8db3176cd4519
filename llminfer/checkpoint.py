"""The one checkpoint reader: safetensors folders (sharded too) and llama.cpp GGUF files; saving in Hugging Face's
layout; the bundled and installed models; random weights of a published shape. Chapter 00.

Models are built on the meta device (no memory) and each weight is then read, converted to the target dtype
and placed on the target device one tensor at a time, so loading needs about the weights' own size in that
dtype, never a float32 copy of the whole model beside it.

    checkpoint = open_checkpoint("tiny-capitals")      # config and tensor table, from the headers alone
    check_layout(checkpoint, expected_shapes(checkpoint.config))   # every tensor there, at its shape
    model = read_model(checkpoint, transform)           # transform: shard for a rank, keep quantized blocks

`load_pretrained` is those three steps with no transform; `llminfer.parallel` and `llminfer.quant` pass theirs.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from .config import ModelConfig, get_preset
from .device import check_fits, dtype_bytes, resolve_device
from .gguf_reader import (INSTALLED, gguf_config, gguf_tensor_names, gguf_tokenizer, installed_gguf,
                          read_gguf_tensor, read_header, rope_heads)
from .model import Transformer
from .moe import HF_EXPERT_NAMES, HF_EXPERT_WIDTH, STACKED
from .tokenizer import Tokenizer

__all__ = ["load_pretrained", "save_pretrained", "load_random", "resolve_device", "bundled_models", "model_folder",
           "HUB_TIMEOUT_S", "Checkpoint", "StoredTensor", "ReadTransform", "open_checkpoint", "check_layout",
           "check_header_shapes", "check_vocabularies", "warn_if_not_finite",
           "read_model", "read_config", "load_tokenizer", "expected_shapes", "read_json_object", "parse_dtype",
           "checkpoint_dtype", "DTYPE_NAMES"]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors")     # what save_pretrained writes, and may remove
_HUB_FILES = ["config.json", "generation_config.json", "tokenizer.json", "*.safetensors", _INDEX]
_FLOAT_STORAGE = ("F64", "F32", "F16", "BF16")
_STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I32": 4, "I64": 8}


def _gguf_float_types(name: str) -> list[str]:
    from .gguf_reader import supported_types
    return supported_types()


_GGUF_FLOAT_TYPES = _gguf_float_types     # every type gguf.quants dequantizes

# Seconds the hub may stay silent (connect, read) before a hub id is given up on; $LLMINFER_HUB_TIMEOUT overrides it.
HUB_TIMEOUT_S = 20.0


def _models_dir() -> Path:
    """Where the bundled models live: $LLMINFER_MODELS, else data/models in a clone, else llminfer/models in a wheel."""
    env = os.environ.get("LLMINFER_MODELS")
    if env:
        return Path(env)
    package = Path(__file__).resolve().parent
    in_clone = package.parent / "data" / "models"
    return in_clone if in_clone.is_dir() else package / "models"


def bundled_models() -> list[str]:
    """Names of the models shipped in data/models."""
    root = _models_dir()
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []


def read_json_object(path: str | Path) -> dict:
    """The JSON object in a file such as config.json; ValueError naming the file if it is not one. Chapter 00."""
    return _read_json_object(Path(path))


def _read_json_object(path: Path) -> dict:
    """The JSON object in path; ValueError naming the file if it is not valid JSON or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         "download or write the file again") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                         "fix the file or download it again") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__} where a JSON object {{...}} is expected; "
                         "fix the file or download it again")
    return value


def _shard_path(folder: Path, index: Path, name) -> Path:
    """The shard `name` listed in index, refused unless it names a file inside folder."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{index} lists the shard {name!r}, which is not a file name")
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive \
            or ".." in parts:
        raise ValueError(f"{index} lists the shard {name!r}, a path that leaves the model folder {folder}; "
                         "an index may only name files inside its folder, such as 'model-00001-of-00002.safetensors'")
    path = folder / name
    root = folder.resolve()
    target = path.resolve()
    # A hub download keeps each file as a link from snapshots/<commit>/ into the repository's blobs/ folder.
    hub_blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    if not (target.is_relative_to(root) or (hub_blobs is not None and target.is_relative_to(hub_blobs))):
        raise ValueError(f"{index} lists the shard {name!r}, a link to {target}, outside the model folder {folder}; "
                         "copy the file into the folder instead of linking to it")
    return path


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights, checked before any is read."""
    single = folder / _SINGLE
    index = folder / _INDEX
    if single.is_file() and index.is_file():
        raise ValueError(f"{folder} holds both {_SINGLE} and {_INDEX}, so which one has the weights is ambiguous; "
                         "delete the stale one (llminfer.save_pretrained leaves only what it wrote)")
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} is not a valid safetensors index: it needs a non-empty \"weight_map\" object "
                             "from tensor names to shard files")
        shards: dict[str, Path] = {}
        for name in weight_map.values():     # every path is checked before any file is opened
            if not (isinstance(name, str) and name in shards):
                shards[name] = _shard_path(folder, index, name)
        files = [shards[name] for name in sorted(shards)]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index.name} lists the shard {f.name}, which is missing from {folder}")
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(f"{folder} holds only pickle checkpoint(s) {pickles}; llminfer reads safetensors only and "
                         "never unpickles a file (it can run arbitrary code). Convert it once where you trust it, "
                         "e.g. with transformers' save_pretrained(..., safe_serialization=True)")
    raise FileNotFoundError(f"no weights in {folder}: expected {_SINGLE} or {_INDEX}")


def _unreadable(path: Path, exc: Exception) -> ValueError:
    return ValueError(f"could not read {path}: {exc}. The file is truncated or not a safetensors file; "
                      "download or save it again")


def _tensor_layout(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name -> (file, shape, stored dtype), from the files' headers alone (no tensor data is read)."""
    layout: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                entries = [(name, f.get_slice(name)) for name in f.keys()]
                entries = [(name, tuple(s.get_shape()), s.get_dtype()) for name, s in entries]
        except Exception as exc:  # safetensors raises its own error types for truncated or corrupt files
            raise _unreadable(path, exc) from None
        for name, shape, stored in entries:
            if name in layout:
                raise ValueError(f"the tensor {name!r} is stored twice, in {layout[name][0].name} and {path.name}; "
                                 "the checkpoint is inconsistent, save or download it again")
            layout[name] = (path, shape, stored)
    return layout


def _read_tensor(path: Path, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor of a safetensors file as a new tensor of dtype on device. Chapter 00."""
    try:
        # One open per tensor: an open file's mapping keeps every page read through it resident until it is
        # closed, which would hold the whole file, in its stored dtype, beside the converted weights.
        with safe_open(str(path), framework="pt") as f:
            stored = f.get_tensor(name)
    except Exception as exc:
        raise _unreadable(path, exc) from None
    converted = stored.to(dtype=dtype, copy=True)   # a copy owned by the model, not a view of the file
    del stored                                      # drops the file mapping before the next tensor is read
    return converted.to(device)


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else "model." + name


def _llminfer_name(hf_name: str) -> str:
    return hf_name.removeprefix("model.")


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint as its header describes it, in torch's (rows, cols) order; nothing read yet.
    Chapter 00."""

    name: str                    # its name in the file ('model.layers.0.mlp.up_proj.weight', 'blk.0.ffn_up.weight')
    path: Path
    shape: tuple[int, ...]
    stored: str                  # 'F32', 'BF16', 'I8', 'U8' (safetensors) or a GGUF type ('Q4_1', 'Q8_0', ...)
    gguf: object = None          # the GGUF tensor entry, for a tensor of a GGUF file
    rope_heads: int | None = None  # GGUF q/k: the heads whose rows llama.cpp's converter reordered
    parts: tuple = ()            # an MoE layer's experts, one StoredTensor each, read stacked (E, rows, cols)
    rows: tuple[int, int] | None = None   # only rows [start, stop) of each expert of a fused (E, 2I, D) tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data in the file."""
        if self.parts:
            return sum(part.nbytes for part in self.parts)
        if self.gguf is not None:
            return self.gguf.nbytes
        return _STORED_BYTES.get(self.stored, 4) * math.prod(self.shape)

    def read(self, dtype: torch.dtype | None, device, shard=None) -> torch.Tensor:
        """The tensor (rows or columns [start, stop) of it for a shard) as a new tensor of dtype on device; dtype
        None keeps the stored integer or float type (safetensors). GGUF blocks are dequantized; experts are read one
        at a time into their stacked tensor."""
        if self.parts:
            if shard is not None:
                raise ValueError(f"{self.name} stacks {len(self.parts)} experts' tensors and is read whole; "
                                 "a model of experts is not split by rows or columns")
            first = self.parts[0].read(dtype, device)
            stacked = torch.empty((len(self.parts), *first.shape), dtype=first.dtype, device=first.device)
            stacked[0] = first
            for i, part in enumerate(self.parts[1:], start=1):
                stacked[i] = part.read(dtype, device)
            return stacked
        if self.gguf is not None:
            return read_gguf_tensor(self.path, self.gguf, dtype or torch.float32, device, self.rope_heads, shard)
        if self.rows is not None:
            if shard is not None:
                raise ValueError(f"{self.name} holds two experts' products side by side and is read whole")
            shard = SimpleNamespace(dim=1, start=self.rows[0], stop=self.rows[1])
        if shard is None and dtype is not None:
            return _read_tensor(self.path, self.name, dtype, device)
        try:
            with safe_open(str(self.path), framework="pt") as f:
                lazy = f.get_slice(self.name)
                stored = lazy[:] if shard is None else (lazy[shard.start:shard.stop] if shard.dim == 0
                                                        else lazy[:, shard.start:shard.stop])
        except Exception as exc:
            raise _unreadable(self.path, exc) from None
        converted = stored.to(dtype=dtype or stored.dtype, copy=True).contiguous()
        del stored
        return converted.to(device)


@dataclass
class Checkpoint:
    """A checkpoint opened from its headers alone: config, tensors by llminfer's parameter names, and where the
    tokenizer comes from. Chapter 00."""

    source: Path                         # the model folder, or the .gguf file
    config: ModelConfig
    tensors: dict[str, StoredTensor]     # 'layers.0.self_attn.q_proj.weight' -> its stored tensor
    format: str                          # 'safetensors' or 'gguf'
    extra_config: dict = field(default_factory=dict)    # config.json entries ModelConfig does not read
    gguf_header: object = None

    @property
    def name(self) -> str:
        return self.source.stem if self.format == "gguf" else self.source.name

    @property
    def described_by(self) -> str:
        return "the GGUF metadata" if self.format == "gguf" else "config.json"

    def source_name(self, name: str) -> str:
        """The stored tensor behind parameter `name`: a tied head that is not stored is read as the embedding."""
        if name not in self.tensors and name == "lm_head.weight" and self.config.tie_embeddings:
            return "embed_tokens.weight"
        return name

    def load_tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer: tokenizer.json (+ generation_config.json), or the GGUF metadata."""
        if self.format == "gguf":
            return gguf_tokenizer(self.gguf_header)
        return _load_tokenizer(self.source, self.config)


def check_layout(checkpoint: Checkpoint, expected: dict[str, tuple[int, ...]], stored_types=None,
                 allowed_extra=()) -> None:
    """Raises ValueError, before any tensor is read, unless the checkpoint holds every expected tensor at its
    shape, in one of stored_types (default: the floating-point ones), and nothing else. Chapter 00."""
    custom = stored_types is not None
    stored_types = stored_types or (_GGUF_FLOAT_TYPES if checkpoint.format == "gguf" else _FLOAT_STORAGE)
    by = checkpoint.described_by
    for name, shape in expected.items():
        entry = checkpoint.tensors.get(checkpoint.source_name(name))
        if entry is None:
            raise ValueError(f"the checkpoint has no tensor {_stored_label(checkpoint, name)!r} (expected shape "
                             f"{shape} from {by})")
        if tuple(entry.shape) != tuple(shape):
            raise ValueError(f"tensor {entry.name!r} has shape {tuple(entry.shape)} in the checkpoint but {by} "
                             f"implies {tuple(shape)}; the weights and {by} do not belong together")
        allowed = stored_types(name) if callable(stored_types) else stored_types
        if entry.stored not in allowed:
            if custom:
                raise ValueError(f"tensor {entry.name!r} is stored as {entry.stored} in {entry.path.name}, expected "
                                 f"{' or '.join(allowed)}; the file was not written for this configuration")
            if checkpoint.format == "gguf":
                raise ValueError(f"tensor {entry.name!r} is stored as {entry.stored} in {entry.path.name}; llminfer "
                                 f"reads the GGUF types {', '.join(allowed)}")
            raise ValueError(f"tensor {entry.name!r} is stored as {entry.stored} in {entry.path.name}; llminfer "
                             f"loads floating-point weights ({', '.join(allowed)}), not quantized ones")
    known = {checkpoint.source_name(n) for n in expected} | {"lm_head.weight"} | set(allowed_extra)
    unexpected = sorted(entry.name for n, entry in checkpoint.tensors.items()
                        if n not in known and not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"the checkpoint holds tensors this architecture does not use: {unexpected[:5]}; "
                         f"is {by} for a different model?")


def _stored_label(checkpoint: Checkpoint, name: str) -> str:
    return name if checkpoint.format == "gguf" else _hf_name(name)


def open_checkpoint(path_or_name: str | Path) -> Checkpoint:
    """A checkpoint's config and tensor table, from headers alone: a safetensors folder (sharded too), a .gguf file,
    a bundled or installed model's name, or a hub id. Chapter 00."""
    source = _locate(path_or_name)
    if source.is_file():
        return _open_gguf(source)
    config_path = source / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {source}; a model folder needs config.json, weights "
                                "(model.safetensors) and tokenizer.json")
    hf = _read_json_object(config_path)
    extra = {k: hf[k] for k in ("quantization_config", "torch_dtype", "dtype") if k in hf}
    config = ModelConfig.from_hf({k: v for k, v in hf.items() if k != "quantization_config"})
    files = _weight_files(source)
    tensors = {_llminfer_name(name): StoredTensor(name, path, shape, stored)
               for name, (path, shape, stored) in _tensor_layout(files).items()}
    _stack_experts(tensors, config)
    checkpoint = Checkpoint(source, config, tensors, "safetensors", extra)
    check_header_shapes(checkpoint)
    return checkpoint


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def _expert_names(config: ModelConfig, layer: int) -> tuple[str, str, dict[str, str]]:
    """The checkpoint's names (without 'model.') of an MoE layer: its router, and for each stacked parameter the
    pattern of its experts' tensors ('layers.0.mlp.experts.{}.gate_proj.weight'). Chapter 14."""
    block, router, leaves = HF_EXPERT_NAMES[config.model_type]
    prefix = f"layers.{layer}.{block}"
    return (f"{prefix}.{router}.weight",
            {param: f"{prefix}.experts.{{}}.{leaf}.weight" for param, leaf in zip(STACKED, leaves)})


def _split_fused_experts(tensors: dict[str, StoredTensor], config: ModelConfig, layer: int, fused: str,
                         width: str) -> None:
    """transformers' fused experts of one layer, gate_up_proj (E, 2I, D) and down_proj (E, D, I), as w_gate and w_up
    (the two row halves of gate_up_proj) and w_down; ValueError naming the config.json field they disagree with."""
    gate_up, down = tensors.pop(fused + "gate_up_proj"), tensors.pop(fused + "down_proj")
    n, wide = config.n_experts, config.moe_hidden_dim
    for entry, shape in ((gate_up, (n, 2 * wide, config.dim)), (down, (n, config.dim, wide))):
        if tuple(entry.shape) != shape:
            raise ValueError(f"fused expert tensor {entry.name!r} has shape {tuple(entry.shape)} but config.json "
                             f"implies {shape} from num_experts={n}, hidden_size={config.dim} and {width}={wide}; "
                             "the weights and config.json do not belong together")
    prefix = f"layers.{layer}.mlp."
    tensors[prefix + "w_gate"] = replace(gate_up, shape=(n, wide, config.dim), rows=(0, wide))
    tensors[prefix + "w_up"] = replace(gate_up, shape=(n, wide, config.dim), rows=(wide, 2 * wide))
    tensors[prefix + "w_down"] = down


def _stack_experts(tensors: dict[str, StoredTensor], config: ModelConfig) -> None:
    """Renames each MoE layer's router to 'layers.i.mlp.router.weight' and replaces its experts' per-expert tensors
    by one stacked entry each ('layers.i.mlp.w_gate', (E, I, D)), in place, from the headers alone. Raises
    ValueError, before any tensor is read, naming the config.json field the experts disagree with. Chapter 14."""
    if config.model_type not in HF_EXPERT_NAMES:
        return
    width = HF_EXPERT_WIDTH[config.model_type]
    for layer in config.moe_layers:
        router, patterns = _expert_names(config, layer)
        if router in tensors:
            tensors[f"layers.{layer}.mlp.router.weight"] = tensors.pop(router)
        fused = router.rsplit(".", 2)[0] + ".experts."   # transformers' in-memory layout: experts fused in 3-D
        if fused + "gate_up_proj" in tensors and fused + "down_proj" in tensors:
            _split_fused_experts(tensors, config, layer, fused, width)
            continue
        for param, pattern in patterns.items():
            found = re.compile(re.escape(pattern).replace(r"\{\}", r"(\d+)"))
            experts = {int(m.group(1)): name for name in tensors if (m := found.fullmatch(name))}
            if not experts:
                continue                                 # check_layout names the missing stacked tensor
            label = "model." + pattern.format("{0.." + str(max(experts)) + "}")
            if sorted(experts) != list(range(config.n_experts)):
                raise ValueError(
                    f"layer {layer} of the checkpoint holds {len(experts)} experts ({label}) but config.json gives "
                    f"num_experts={config.n_experts} (ModelConfig.n_experts); the weights and config.json do not "
                    f"belong together: set num_experts to {len(experts)} if the checkpoint is right")
            parts = tuple(tensors.pop(experts[e]) for e in range(config.n_experts))
            wide = (config.moe_hidden_dim, config.dim) if param != "w_down" else (config.dim, config.moe_hidden_dim)
            for part in parts:
                if tuple(part.shape) != wide:
                    raise ValueError(
                        f"expert tensor {part.name!r} has shape {tuple(part.shape)} but config.json implies {wide} "
                        f"from hidden_size={config.dim} and {width}={config.moe_hidden_dim} (ModelConfig."
                        f"moe_hidden_dim); the weights and config.json do not belong together: set {width} to the "
                        f"checkpoint's expert width")
            tensors[f"layers.{layer}.mlp.{param}"] = StoredTensor(label, parts[0].path, (len(parts), *wide),
                                                                   parts[0].stored, parts=parts)


def check_header_shapes(checkpoint: Checkpoint) -> None:
    """Raises ValueError unless the config's layer count, vocabulary and width agree with the tensor table, from
    the headers alone (before a model, even on meta, is built for a config that could be absurd). Chapter 00."""
    config, by = checkpoint.config, checkpoint.described_by
    layers = {int(m.group(1)) for m in map(_LAYER_INDEX.match, checkpoint.tensors) if m}
    stored = max(layers) + 1 if layers else 0
    if stored != config.n_layers:
        raise ValueError(f"{by} gives {config.n_layers} layers (n_layers) but the checkpoint's tensors hold "
                         f"{stored} (layers.0 .. layers.{stored - 1}); the weights and {by} do not belong together")
    entry = checkpoint.tensors.get("embed_tokens.weight")
    if entry is not None and tuple(entry.shape) != (config.vocab_size, config.dim):
        raise ValueError(f"tensor {entry.name!r} has shape {tuple(entry.shape)} in the checkpoint but {by} implies "
                         f"{(config.vocab_size, config.dim)} (vocab_size, dim); the weights and {by} do not belong "
                         "together")


def _open_gguf(path: Path) -> Checkpoint:
    header = read_header(path)
    config = gguf_config(header)
    names = gguf_tensor_names(header)
    tensors = {names[name]: StoredTensor(name, path, entry.shape, entry.type_name, entry,
                                         rope_heads(header, config, name))
               for name, entry in header.tensors.items()}
    checkpoint = Checkpoint(path, config, tensors, "gguf", gguf_header=header)
    check_header_shapes(checkpoint)
    return checkpoint


class ReadTransform:
    """How a reader changes the model as it fills it; this base changes nothing. Subclasses shard for a rank
    (chapter 10) or keep quantized blocks (chapter 08). Chapter 00."""

    def layout(self, checkpoint: Checkpoint) -> dict:
        """Keyword arguments for check_layout (e.g. stored_types) where this transform reads other tensors."""
        return {}

    def check(self, checkpoint: Checkpoint, device) -> None:
        """Raises ValueError, before any tensor is read, if the transform cannot apply to this checkpoint here."""

    def prepare(self, model: Transformer) -> Transformer:
        """The model (on meta, no memory yet) changed before reading: modules split, dropped or renamed."""
        return model

    def replace(self, name: str, module: nn.Module, checkpoint: Checkpoint, dtype: torch.dtype, device):
        """A module built from the checkpoint in place of `module`, whose parameters are then not read; or None."""
        return None

    def source(self, name: str, module: nn.Module) -> tuple[str, object]:
        """The checkpoint's parameter name behind `name` and the shard of it to read (None: all of it)."""
        return name, None

    def local_bytes(self, model: Transformer, dtype: torch.dtype) -> int:
        """Bytes this process holds once the model is read, for the memory check."""
        return sum(p.numel() for p in model.parameters()) * dtype_bytes(dtype)

    def what(self, checkpoint: Checkpoint, dtype: torch.dtype) -> str:
        return f"the weights of {checkpoint.name} in {dtype}"

    def read(self, name: str, entry: StoredTensor, tensor: torch.Tensor) -> None:
        """Called with every tensor read (for a report of what was read)."""


def read_model(checkpoint: Checkpoint, transform: ReadTransform | None = None, device=None,
               dtype: torch.dtype | str | None = None) -> Transformer:
    """The checkpoint's model, built on meta, changed by transform, memory-checked, then filled one tensor at a time
    on device in dtype. The layout must have been checked (check_layout). Chapter 00."""
    transform = transform or ReadTransform()
    device = resolve_device(device)
    dtype = _check_dtype(dtype, checkpoint)
    model = transform.prepare(_empty_model(checkpoint.config, device))
    check_fits(transform.local_bytes(model, dtype), device, transform.what(checkpoint, dtype))
    for name, module in list(model.named_modules()):
        if not name:
            continue
        built = transform.replace(name, module, checkpoint, dtype, device)
        if built is not None:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, built)

    def read(name: str, param: torch.Tensor) -> torch.Tensor:
        module_name, _, _attr = name.rpartition(".")
        source, shard = transform.source(name, model.get_submodule(module_name))
        entry = checkpoint.tensors[checkpoint.source_name(source)]
        tensor = entry.read(dtype, device, shard)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"read {tuple(tensor.shape)} for {name} but the model expects {tuple(param.shape)}")
        transform.read(name, entry, tensor)
        return tensor

    _fill_parameters(model, read)
    return model.eval()


def _fill_parameters(model: nn.Module, read) -> None:
    """Replaces every meta parameter by read(name, param); one held by two modules (a tied head) is read once and
    stays shared; parameters already filled (by a transform's replacement) are left alone."""
    new = {id(param): nn.Parameter(read(name, param), requires_grad=param.requires_grad)
           for name, param in list(model.named_parameters()) if param.is_meta}
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is not None and id(param) in new:
                module._parameters[attr] = new[id(param)]


class _SkipMetaInit(TorchFunctionMode):
    """Skips torch.nn.init's fills of meta tensors, which hold no values (and whose random fills would otherwise
    load torch's compiler, seconds and about 100 MiB, the first time)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def _meta_model(config: ModelConfig) -> Transformer:
    """A Transformer on the meta device: shapes and names, no memory."""
    with torch.device("meta"), _SkipMetaInit():
        return Transformer(config)


def _empty_model(config: ModelConfig, device: torch.device) -> Transformer:
    """A Transformer whose parameters live on the meta device (no memory) and whose buffers, if any, on device."""
    model = _meta_model(config)
    if next(model.buffers(), None) is None:
        return model
    # Buffers (tables computed from the config, e.g. rotary frequencies) are made by __init__ and are not in a
    # checkpoint: build again with them on device and only the parameters on meta.
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        with torch.device(device), _SkipMetaInit():
            model = Transformer(config)
    finally:
        nn.Module.register_parameter = register
    return model


def _set_parameters(model: Transformer, tensors) -> Transformer:
    """Replace each (meta) parameter by tensors(name, param), one at a time; a tied head stays tied."""
    for name, param in list(model.named_parameters()):   # a tied head is listed once, as embed_tokens.weight
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(tensors(name, param), requires_grad=param.requires_grad))
    if model.config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


# dtype names, as transformers and the server's --dtype spell them (any case, 'torch.' in front or not).
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "float": torch.float32,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16}
# The torch dtype holding each stored type exactly (GGUF and safetensors names); a quantized GGUF block (Q4_1:
# 4-bit codes times an fp16 scale, plus an fp16 minimum) is dequantized to float32.
_STORED_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def parse_dtype(dtype) -> torch.dtype | str:
    """The torch dtype that a dtype argument names (a floating-point torch.dtype, a name in DTYPE_NAMES; None is
    float32), or 'auto' (the checkpoint's own, see checkpoint_dtype); ValueError listing the names. Chapter 00."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        if name == "auto" or name in DTYPE_NAMES:
            return DTYPE_NAMES.get(name, "auto")
    raise ValueError(f"dtype={dtype!r} is not a floating-point dtype; pass a torch dtype such as torch.bfloat16, one "
                     f"of the names {', '.join(DTYPE_NAMES)}, or 'auto' for the checkpoint's own dtype")


def checkpoint_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The checkpoint's own dtype, what dtype='auto' loads in: config.json's torch_dtype (or dtype) where it names
    one, else the type its weight matrices are stored in; GGUF blocks (Q4_1, Q8_0, ...) widen to float32, which
    holds code x scale (+ minimum) exactly. Matrices of mixed types give float32. Chapter 00."""
    for key in ("dtype", "torch_dtype"):
        name = checkpoint.extra_config.get(key)
        if isinstance(name, str) and name.lower() in DTYPE_NAMES:
            return DTYPE_NAMES[name.lower()]
    stored = {_STORED_DTYPES.get(entry.stored, torch.float32)
              for entry in checkpoint.tensors.values() if len(entry.shape) >= 2}
    return stored.pop() if len(stored) == 1 else torch.float32


def _check_dtype(dtype, checkpoint: Checkpoint | None = None) -> torch.dtype:
    """parse_dtype's torch dtype, with 'auto' resolved against the checkpoint (refused where there is none)."""
    parsed = parse_dtype(dtype)
    if parsed != "auto":
        return parsed
    if checkpoint is None:
        raise ValueError("dtype='auto' means the checkpoint's own dtype, and random weights have no checkpoint; pass "
                         f"a dtype such as 'float32' or 'bfloat16' (one of {', '.join(DTYPE_NAMES)})")
    return checkpoint_dtype(checkpoint)


def _hub_timeout() -> float:
    text = os.environ.get("LLMINFER_HUB_TIMEOUT")
    if text is None:
        return HUB_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"LLMINFER_HUB_TIMEOUT={text!r} is not a positive number of seconds; set it like "
                         f"LLMINFER_HUB_TIMEOUT=20 or unset it (default {HUB_TIMEOUT_S:g})")
    return seconds


def _fetch_from_hub(repo_id: str) -> Path:
    """The local snapshot of a hub repository: downloaded, or from the cache when the hub cannot be reached."""
    timeout = _hub_timeout()
    from huggingface_hub import HfApi, snapshot_download

    try:
        # The first request of a download; huggingface_hub sends it with no timeout unless given one, so a
        # server that accepts the connection and never answers would otherwise hold the call forever.
        commit = HfApi().repo_info(repo_id, timeout=timeout).sha
    except Exception as exc:  # offline mode, no network, a silent server, no such repository
        hub_error = exc
    else:
        try:
            return Path(snapshot_download(repo_id, revision=commit, allow_patterns=_HUB_FILES, etag_timeout=timeout))
        except Exception as exc:
            hub_error = exc
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES, local_files_only=True))
    except Exception:
        raise OSError(f"could not fetch {repo_id!r} from the Hugging Face hub ({type(hub_error).__name__}: "
                      f"{hub_error}) and it is not in the local cache. Without a network, download the model "
                      "elsewhere and pass its local folder: llminfer.load_pretrained('/path/to/folder')") from None


def model_folder(path_or_name: str | Path) -> Path:
    """Returns where a model lives: a folder or .gguf file as given, a bundled model's folder or an installed
    model's file by name, or a hub id's local snapshot (fetched). Chapter 00."""
    return _locate(path_or_name)


def _locate(path_or_name: str | Path) -> Path:
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        return path
    name = str(path_or_name)
    if name in bundled_models():
        return _models_dir() / name
    if name in INSTALLED:
        return installed_gguf(name)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not path.exists():
        return _fetch_from_hub(name)
    raise FileNotFoundError(f"{name!r} is not a folder, a bundled model ({', '.join(bundled_models()) or 'none'}), "
                            f"an installed model ({', '.join(INSTALLED)}), a .gguf file "
                            "or a hub id like 'HuggingFaceTB/SmolLM2-135M'")


def read_config(path_or_name: str | Path) -> ModelConfig:
    """The ModelConfig of a model, from its config.json or GGUF metadata alone. Chapter 00."""
    source = _locate(path_or_name)
    if source.is_file():
        return gguf_config(read_header(source))
    config_path = source / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {source}")
    return ModelConfig.from_hf({k: v for k, v in _read_json_object(config_path).items() if k != "quantization_config"})


def load_tokenizer(path_or_name: str | Path) -> Tokenizer:
    """The tokenizer of a model folder (tokenizer.json), a GGUF file (its metadata) or a model's name. Chapter 00."""
    source = _locate(path_or_name)
    if source.is_file():
        return gguf_tokenizer(read_header(source))
    return _load_tokenizer(source, read_config(source))


def _token_id(value, path: Path, field: str) -> int | None:
    """bos/eos from generation_config.json: an id, the first of a list of ids, or None."""
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError(f"{path} has {field}={value!r}; it must be a token id (an integer >= 0), a list of them, or null")


def _load_tokenizer(folder: Path, config: ModelConfig) -> Tokenizer:
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}; add it, or pass load_tokenizer=False "
                                "to load the weights alone")
    gen = folder / "generation_config.json"
    gen_cfg = _read_json_object(gen) if gen.is_file() else {}
    bos = _token_id(gen_cfg.get("bos_token_id", config.bos_token_id), gen, "bos_token_id")
    eos = _token_id(gen_cfg.get("eos_token_id", config.eos_token_id), gen, "eos_token_id")
    settings = folder / "tokenizer_config.json"       # the chat template and add-BOS flag, where the folder has them
    tok_cfg = _read_json_object(settings) if settings.is_file() else {}
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):                     # named templates: [{"name": "default", "template": ...}]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{settings} has a chat_template that is not a string: {type(template).__name__}")
    return Tokenizer.from_file(folder / "tokenizer.json", bos, eos, chat_template=template or None,
                               add_bos_token=tok_cfg.get("add_bos_token") is True)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of every weight the config implies (a tied head listed once, as the embedding)."""
    return {name: tuple(p.shape) for name, p in _meta_model(config).named_parameters()}


def load_pretrained(path_or_name: str | Path, device: str | torch.device | None = None,
                    dtype: torch.dtype | str | None = None, load_tokenizer: bool = True,
                    transform: ReadTransform | None = None):
    """Returns (model, tokenizer) from a HF-format folder, a .gguf file, a bundled or installed model's name or a
    hub id; dtype is a torch dtype, a name ('bfloat16', 'bf16', ...: DTYPE_NAMES) or 'auto' (the checkpoint's own,
    see checkpoint_dtype), float32 by default; transform changes the model as it is read, e.g.
    llminfer.quant.keep_quantized(). Chapter 00."""
    device = resolve_device(device)
    requested = parse_dtype(dtype)                 # a bad name is refused before any file is opened
    checkpoint = open_checkpoint(path_or_name)
    dtype = _check_dtype(requested, checkpoint)
    tokenizer, missing = None, None
    if load_tokenizer:      # from tokenizer.json or the GGUF metadata, before the layout check and any weight read
        try:
            tokenizer = checkpoint.load_tokenizer()
        except ValueError as exc:       # a GGUF file without tokenizer metadata still has weights worth loading
            if checkpoint.format != "gguf" or "holds no tokenizer" not in str(exc):
                raise
            missing = exc
    if tokenizer is not None:
        check_vocabularies(tokenizer.vocab_size, checkpoint.config.vocab_size, checkpoint.name)
    expected = expected_shapes(checkpoint.config)
    check_layout(checkpoint, expected, **(transform.layout(checkpoint) if transform is not None else {}))
    if transform is not None:
        transform.check(checkpoint, device)
    if transform is None:
        check_fits(checkpoint.config.n_params() * dtype_bytes(dtype), device,
                   f"the weights of {checkpoint.name} in {dtype}")
    model = read_model(checkpoint, transform, device=device, dtype=dtype)
    warn_if_not_finite(model, checkpoint.name)
    if missing is not None:
        warnings.warn(f"{missing}. The weights are loaded; the tokenizer returned is None", stacklevel=2)
    return model, tokenizer


def check_vocabularies(tokenizer_size: int, model_size: int, name: str = "the model") -> None:
    """Raises ValueError if the tokenizer has ids the model's embedding lacks; warns if the model has ids the
    tokenizer cannot spell (a padded vocabulary: a sampled one fails to decode). Chapter 00."""
    if tokenizer_size > model_size:
        raise ValueError(f"the tokenizer of {name} has {tokenizer_size} ids but the model's vocabulary has "
                         f"{model_size}: ids {model_size}..{tokenizer_size - 1} would index past its embedding; the "
                         "tokenizer and the weights do not belong together")
    if tokenizer_size < model_size:
        warnings.warn(f"the model {name} has a vocabulary of {model_size} ids but its tokenizer spells only "
                      f"{tokenizer_size}; a generated id in {tokenizer_size}..{model_size - 1} cannot be decoded "
                      "(a padded vocabulary is normal, a wrong tokenizer is not)", stacklevel=3)


_FINITE_CHUNK = 1 << 20      # elements checked at once: the check's temporaries stay a few MB, not a weight's size


def _finite(weight: torch.Tensor) -> bool:
    """Whether every element of weight is finite, read in chunks (a whole-tensor isfinite would allocate a mask,
    and for low-precision dtypes temporaries, as large as the tensor)."""
    flat = weight.detach().reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + _FINITE_CHUNK]).all()) for i in range(0, flat.numel(), _FINITE_CHUNK))


def warn_if_not_finite(model: nn.Module, name: str = "the model") -> list[str]:
    """The names of floating-point weights holding NaN or inf (one pass over the weights), with a warning if any.
    Chapter 00."""
    bad = [n for n, p in model.named_parameters() if p.is_floating_point() and not p.is_meta and not _finite(p)]
    if bad:
        warnings.warn(f"{len(bad)} weight tensor(s) of {name} hold NaN or inf values ({', '.join(bad[:3])}"
                      f"{', ...' if len(bad) > 3 else ''}); its outputs will be NaN. Is the checkpoint damaged, or "
                      "stored in a dtype too narrow for its values?", stacklevel=3)
    return bad


def _parse_size(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be a positive number of bytes, got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size {size!r} is not a positive size like 5000000, '10MB' or '2GiB'")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return max(1, int(float(match.group(1)) * scale))


def save_pretrained(model: Transformer, folder: str | Path, tokenizer: Tokenizer | None = None,
                    max_shard_size: int | str | None = None) -> Path:
    """Write config.json and safetensors weights (sharded past max_shard_size) in Hugging Face's layout. Chapter 00.

    Weight files of an earlier save into the same folder that this save does not rewrite (model.safetensors,
    model-*-of-*.safetensors shards, the index) are removed, so the folder holds exactly the new weights.
    """
    folder = Path(folder)
    limit = _parse_size(max_shard_size) if max_shard_size is not None else None
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    hf_config = config.to_hf()
    hf_config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tensors = {}
    for name, param in model.named_parameters():  # a tied head is stored once, as the embedding
        tensors.update(_hf_tensors(config, name, param.detach().to("cpu")))
    total = sum(t.nbytes for t in tensors.values())
    if limit is None or total <= limit:
        save_file(tensors, str(folder / _SINGLE), metadata={"format": "pt"})
        written = {_SINGLE}
    else:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in tensors.items():
            if shards[-1] and size + tensor.nbytes > limit:
                shards.append({})
                size = 0
            shards[-1][name] = tensor
            size += tensor.nbytes
        weight_map = {}
        written = {_INDEX}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
            written.add(file)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for stale in folder.iterdir():   # after the new weights are complete: an earlier save's files go
        if stale.name not in written and (stale.name == _INDEX or _WEIGHT_FILE.fullmatch(stale.name)) \
                and (stale.is_file() or stale.is_symlink()):
            stale.unlink()
    if tokenizer is not None:
        tokenizer.save(folder / "tokenizer.json")
        (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tokenizer, config), indent=2) + "\n")
    return folder


def _hf_tensors(config: ModelConfig, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A parameter under its Hugging Face name(s): stacked experts as one tensor per expert, the router under the
    family's name. Chapter 14."""
    layer, _, leaf = name.partition(".mlp.")
    if config.model_type in HF_EXPERT_NAMES and leaf in ("router.weight", *STACKED):
        router, patterns = _expert_names(config, int(layer.removeprefix("layers.")))
        if leaf == "router.weight":
            return {_hf_name(router): tensor.contiguous()}
        return {_hf_name(patterns[leaf].format(e)): tensor[e].clone() for e in range(tensor.shape[0])}
    return {_hf_name(name): tensor.contiguous()}


def _tokenizer_config(tokenizer: Tokenizer, config: ModelConfig) -> dict:
    """tokenizer_config.json for a saved tokenizer: special tokens, the add-BOS flag and the chat template, as
    transformers' AutoTokenizer (and so vLLM) and this module's reader take them. Chapter 11."""
    def spelling(token_id):
        return None if token_id is None else tokenizer.backend.id_to_token(token_id)
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": spelling(tokenizer.bos_token_id),
           "eos_token": spelling(tokenizer.eos_token_id), "add_bos_token": bool(tokenizer.add_bos_token),
           "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": config.max_seq_len}
    if tokenizer.chat_template is not None:
        out["chat_template"] = tokenizer.chat_template.source
    return out


def load_random(name_or_config: str | ModelConfig, device: str | torch.device | None = None,
                dtype: torch.dtype | str | None = None, seed: int = 0, max_seq_len: int | None = None) -> Transformer:
    """A model of a published shape with random N(0, 0.02²) weights, for timing, never for text. Chapter 04."""
    config = get_preset(name_or_config) if isinstance(name_or_config, str) else name_or_config
    if max_seq_len is not None:
        config = config.replace(max_seq_len=max_seq_len)
    device = resolve_device(device)
    dtype = _check_dtype(dtype)
    check_fits(config.n_params() * dtype_bytes(dtype), device, f"a {config.n_params() / 1e6:.0f}M-parameter model "
               f"in {dtype}")
    model = _empty_model(config, device)
    model = _set_parameters(model, lambda name, param: torch.empty(param.shape, dtype=dtype, device=device))
    return model.init_weights(seed).eval()
