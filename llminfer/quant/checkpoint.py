"""Quantized checkpoints: integer codes with their scales beside them, in safetensors. Chapter 08.

`save_pretrained(model, folder)` writes config.json (with a "quantization_config" entry), and one
model.safetensors in Hugging Face's names, where each quantized layer `name` holds

    name.qweight   int8 (N, K) for int8; uint8 (N, K/2) two 4-bit codes per byte for int4; uint8 (N, K) below
    name.scales    (N, n_groups) in the model's dtype
    name.zeros     (N, n_groups) for int4/int3/int2: w = (q - 2^(b-1)) · scale + zero

Fused projections (`llminfer.fast.fuse_projections`) are written under the checkpoint's own q/k/v and
gate/up names, so the format does not depend on the fast path. `load_pretrained(folder)` checks every
tensor's name, dtype and shape against config.json and the quantization entry before it builds a layer.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from ..checkpoint import (ReadTransform, check_layout, model_folder, open_checkpoint, read_config, read_json_object,
                          read_model)
from ..config import ModelConfig
from ..device import dtype_bytes, resolve_device
from ..gguf_reader import QUANTIZED_BLOCKS, read_gguf_blocks
from ..model import Transformer
from ..tokenizer import Tokenizer
from .linear import KERNELS, QuantizedLinear, choose_kernel, quantization_targets, quantized_modules
from .weights import check_scheme

__all__ = ["save_pretrained", "load_pretrained", "FORMAT", "KeepQuantized", "keep_quantized"]

FORMAT = "llminfer-weight-only"
_FILE = "model.safetensors"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _hf(name: str) -> str:
    return name if name.startswith("lm_head") else "model." + name


def _split(config: ModelConfig, name: str) -> list[tuple[str, int, int]] | None:
    """For a fused projection, (original name, first row, end row) of each part; None otherwise."""
    head_dim = config.head_dim
    if name.endswith("self_attn.qkv_proj"):
        prefix = name[: -len("qkv_proj")]
        q, kv = config.n_heads * head_dim, config.n_kv_heads * head_dim
        return [(prefix + "q_proj", 0, q), (prefix + "k_proj", q, q + kv), (prefix + "v_proj", q + kv, q + 2 * kv)]
    if name.endswith("mlp.gate_up_proj"):
        prefix = name[: -len("gate_up_proj")]
        return [(prefix + "gate_proj", 0, config.hidden_dim), (prefix + "up_proj", config.hidden_dim,
                                                                2 * config.hidden_dim)]
    return None


def save_pretrained(model: Transformer, folder: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Writes config.json, generation_config.json and model.safetensors of a quantized model. Chapter 08."""
    info = getattr(model, "quantization", None)
    if not info or not quantized_modules(model):
        raise ValueError("the model is not quantized; quantize it with llminfer.quant.quantize first, or save a "
                         "float model with llminfer.save_pretrained")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor | None, rows: tuple[int, int] | None = None):
        if tensor is not None:
            tensor = tensor.detach()
            if rows is not None:
                tensor = tensor[rows[0]:rows[1]]
            tensors[name] = tensor.to("cpu").contiguous()

    done = set()
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            state = module.state()
            parts = _split(config, name) or [(name, 0, module.out_features)]
            for part, lo, hi in parts:
                for field in ("qweight", "scales", "zeros", "bias"):
                    put(f"{_hf(part)}.{field}", state[field], (lo, hi))
            done.update(id(p) for p in module.parameters())
    for name, param in model.named_parameters():          # float weights: norms, the embedding, fused floats
        if id(param) in done:
            continue
        module_name = name.rpartition(".")[0]
        parts = _split(config, module_name)
        if parts:
            for part, lo, hi in parts:
                put(f"{_hf(part)}.{name.rpartition('.')[2]}", param, (lo, hi))
        else:
            put(_hf(name), param)
    hf_config = config.to_hf()
    hf_config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    hf_config["quantization_config"] = {"quant_method": FORMAT, "scheme": info["scheme"], "bits": info["bits"],
                                        "group_size": info["group_size"], "include_head": info["include_head"]}
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_file(tensors, str(folder / _FILE), metadata={"format": "pt", "quantization": FORMAT})
    if tokenizer is not None:
        tokenizer.save(folder / "tokenizer.json")
    return folder


def _expected_quantized(config: ModelConfig, bits: int, group_size: int | None,
                        dtype: torch.dtype, include_head: bool) -> dict[str, dict[str, tuple]]:
    """Module name -> {field: (shape, dtype)} of every quantized layer the config implies."""
    with torch.device("meta"):
        skeleton = Transformer(config)
    expected = {}
    for name, module in quantization_targets(skeleton, include_head):
        n, k = module.out_features, module.in_features
        check_scheme(bits, group_size, k)
        groups = 1 if group_size is None else k // group_size
        fields = {"qweight": ((n, k // 2) if bits == 4 else (n, k), torch.int8 if bits == 8 else torch.uint8),
                  "scales": ((n, groups), dtype)}
        if bits != 8:
            fields["zeros"] = ((n, groups), dtype)
        if module.bias is not None:
            fields["bias"] = ((n,), dtype)
        expected[name] = fields
    return expected


_SAFETENSORS_TYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8",
                      torch.uint8: "U8"}


class _QuantizedOnRead(ReadTransform):
    """The reader's transform for a quantized checkpoint: each quantized layer is built from its stored codes,
    scales and zeros (as stored, in no other dtype), the float weights are read as the reader reads them."""

    def __init__(self, expected: dict, bits: int, group_size: int | None, kernel: str, include_head: bool):
        self.expected, self.bits, self.group_size, self.kernel = expected, bits, group_size, kernel
        self.include_head = include_head

    def replace(self, name, module, checkpoint, dtype, device):
        if name not in self.expected:
            return None
        state = {field: checkpoint.tensors[f"{name}.{field}"].read(None, device) for field in self.expected[name]}
        state.setdefault("zeros", None)
        state.setdefault("bias", None)
        return QuantizedLinear.from_state(state, self.bits, self.group_size, self.kernel)

    def local_bytes(self, model, dtype) -> int:
        return 0          # the quantized checkpoint is its own size; the float parts are a small share of it


def load_pretrained(folder: str | Path, device: str | torch.device | None = None, kernel: str = "auto",
                    load_tokenizer: bool = True) -> tuple[Transformer, Tokenizer | None]:
    """Returns (model, tokenizer) from a folder written by save_pretrained, or a GGUF file (or installed model's name)
    with its Q4_1 / Q8_0 blocks kept as they are stored, checked before building. Chapter 08.

    kernel='packed' refuses, before reading any weight, a device without the packed int4/int8 kernel;
    'auto' falls back to dequantizing on the fly there.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} must be one of {KERNELS}")
    device = resolve_device(device)
    source = model_folder(folder)
    if source.is_file():
        return _load_gguf(source, device, kernel, load_tokenizer)
    folder = source
    config_path, weights_path = folder / "config.json", folder / _FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"no {path.name} in {folder}; a quantized model folder holds config.json and "
                                    f"{_FILE} written by llminfer.quant.save_pretrained")
    hf = read_json_object(config_path)
    info = hf.get("quantization_config")
    if not isinstance(info, dict) or info.get("quant_method") != FORMAT:
        raise ValueError(f"{config_path} has no llminfer quantization_config; this is not a quantized llminfer "
                         "checkpoint. Load a float model with llminfer.load_pretrained")
    bits, group_size, include_head = info.get("bits"), info.get("group_size"), info.get("include_head", True)
    check_scheme(bits, group_size)
    dtype_name = hf.get("torch_dtype", "float32")
    if dtype_name not in _DTYPES:
        raise ValueError(f"{config_path} gives torch_dtype={dtype_name!r}; expected one of {', '.join(_DTYPES)}")
    dtype = _DTYPES[dtype_name]
    config = read_config(folder)
    expected = _expected_quantized(config, bits, group_size, dtype, include_head)
    if kernel in ("packed", "native"):                            # before any weight file is opened
        for name, fields in expected.items():
            n, k = fields["scales"][0][0], fields["qweight"][0][1] * (2 if bits == 4 else 1)
            choose_kernel(bits, group_size, k, n, device, kernel)
    checkpoint = open_checkpoint(folder)
    with torch.device("meta"):
        skeleton = Transformer(config)
    wanted = {f"{m}.{field}": spec for m, fields in expected.items() for field, spec in fields.items()}
    wanted.update({name: (tuple(p.shape), dtype) for name, p in skeleton.named_parameters()
                   if name.rpartition(".")[0] not in expected})
    if config.tie_embeddings and include_head:
        wanted.setdefault("embed_tokens.weight", ((config.vocab_size, config.dim), dtype))
    what = f"config.json and int{bits}{'' if group_size is None else f', group_size={group_size}'}"
    for name, (shape, _want) in wanted.items():                  # the messages name the quantization too
        if name not in checkpoint.tensors:
            raise ValueError(f"{weights_path.name} has no tensor {_hf(name)!r} (expected shape {shape} from {what})")
    check_layout(checkpoint, {name: shape for name, (shape, _) in wanted.items()},
                 stored_types=lambda name: (_SAFETENSORS_TYPES[wanted[name][1]],))
    model = read_model(checkpoint, _QuantizedOnRead(expected, bits, group_size, kernel, include_head), device, dtype)
    model.quantization = {"scheme": f"int{bits}", "bits": bits, "group_size": group_size,
                          "include_head": include_head}
    model._rope_cache = None
    tokenizer = None
    if load_tokenizer and (folder / "tokenizer.json").is_file():
        tokenizer = checkpoint.load_tokenizer()
    return model, tokenizer


class KeepQuantized(ReadTransform):
    """The reader's transform for a GGUF file kept quantized: each Q4_1 linear becomes int4 with group 32 and its
    scale and minimum, each Q8_0 one int8 with group 32, from the file's blocks (values exactly the dequantized
    file's); other tensors are dequantized to the model's dtype. Chapter 08."""

    def __init__(self, kernel: str = "auto"):
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r} must be one of {KERNELS}")
        self.kernel = kernel

    def check(self, checkpoint, device) -> None:
        self.checkpoint = checkpoint
        if checkpoint.format != "gguf":
            raise ValueError(f"keep_quantized keeps the blocks of a GGUF file; {checkpoint.source} is a "
                             f"{checkpoint.format} checkpoint. Quantize a float model with llminfer.quant.quantize")
        for name, entry in checkpoint.tensors.items():           # every kernel check before any tensor is read
            if entry.stored in QUANTIZED_BLOCKS and len(entry.shape) == 2 and name != "embed_tokens.weight":
                bits, group = QUANTIZED_BLOCKS[entry.stored]
                choose_kernel(bits, group, entry.shape[1], entry.shape[0], device, self.kernel)

    def replace(self, name, module, checkpoint, dtype, device):
        if not isinstance(module, nn.Linear):    # a tied head reads the embedding's Q8_0 blocks as its own layer
            return None
        entry = checkpoint.tensors[checkpoint.source_name(name + ".weight")]
        if entry.stored not in QUANTIZED_BLOCKS:
            return None
        bits, group = QUANTIZED_BLOCKS[entry.stored]
        codes, scales, minimums = read_gguf_blocks(entry.path, entry.gguf, entry.rope_heads)
        codes, scales = codes.to(device), scales.to(device=device, dtype=dtype)
        minimums = None if minimums is None else minimums.to(device=device, dtype=dtype)
        return QuantizedLinear(module.in_features, module.out_features, bits, group, codes, scales, None,
                               kernel=self.kernel, offsets=minimums)

    def local_bytes(self, model, dtype) -> int:
        """The model's bytes once read: block layers at one byte a code plus a scale (and minimum) per 32, the rest
        in dtype (a tied embedding both ways: a float table and the head's codes)."""
        total = 0
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                entry = self.checkpoint.tensors[self.checkpoint.source_name(name + ".weight")]
                if entry.stored in QUANTIZED_BLOCKS:
                    total += module.weight.numel() * (1 + 2 * dtype_bytes(dtype) / 32)
                    continue
            for param_name, param in module.named_parameters(recurse=False):
                if not (isinstance(module, nn.Linear) and param is getattr(model.embed_tokens, "weight", None)):
                    total += param.numel() * dtype_bytes(dtype)
        return int(total)


def keep_quantized(kernel: str = "auto") -> KeepQuantized:
    """The transform for llminfer.load_pretrained(gguf_file, transform=keep_quantized()). Chapter 08."""
    return KeepQuantized(kernel)


def _load_gguf(path: Path, device, kernel: str, load_tokenizer: bool):
    from ..checkpoint import load_pretrained as load

    model, tokenizer = load(path, device, torch.float32, load_tokenizer, transform=KeepQuantized(kernel))
    kinds = {"Q4_1" if m.bits == 4 else "Q8_0" for m in quantized_modules(model).values()}
    model.quantization = {"scheme": "gguf:" + "+".join(sorted(kinds)), "bits": 4 if "Q4_1" in kinds else 8,
                          "group_size": 32, "include_head": True}
    model._rope_cache = None
    return model, tokenizer
