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
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ModelConfig
from ..device import resolve_device
from ..model import Transformer
from ..tokenizer import Tokenizer
from .linear import KERNELS, QuantizedLinear, quantized_modules
from .weights import check_scheme

__all__ = ["save_pretrained", "load_pretrained", "FORMAT"]

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
    for name, module in skeleton.named_modules():
        if isinstance(module, nn.Linear) and (include_head or name != "lm_head"):
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


def load_pretrained(folder: str | Path, device: str | torch.device | None = None, kernel: str = "auto",
                    load_tokenizer: bool = True) -> tuple[Transformer, Tokenizer | None]:
    """Returns (model, tokenizer) from a folder written by save_pretrained, checked before building. Chapter 08.

    kernel='packed' refuses, before reading any weight, a device without the packed int4/int8 kernel;
    'auto' falls back to dequantizing on the fly there.
    """
    folder = Path(folder)
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} must be one of {KERNELS}")
    device = resolve_device(device)
    config_path, weights_path = folder / "config.json", folder / _FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"no {path.name} in {folder}; a quantized model folder holds config.json and "
                                    f"{_FILE} written by llminfer.quant.save_pretrained")
    hf = json.loads(config_path.read_text())
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
    config = ModelConfig.from_hf({k: v for k, v in hf.items() if k != "quantization_config"})
    expected = _expected_quantized(config, bits, group_size, dtype, include_head)
    if kernel in ("packed", "native"):                            # before any weight is read
        from .linear import _choose_kernel
        for name, fields in expected.items():
            n, k = fields["scales"][0][0], fields["qweight"][0][1] * (2 if bits == 4 else 1)
            _choose_kernel(bits, group_size, k, n, device, kernel)
    with torch.device("meta"):
        model = Transformer(config)
    float_names = {name: tuple(p.shape) for name, p in model.named_parameters()
                   if name.rpartition(".")[0] not in expected}
    with safe_open(str(weights_path), framework="pt") as f:
        stored = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}
    wanted = {f"{_hf(m)}.{field}": spec for m, fields in expected.items() for field, spec in fields.items()}
    wanted.update({_hf(n): (shape, dtype) for n, shape in float_names.items()})
    for name, (shape, want_dtype) in wanted.items():
        if name not in stored:
            raise ValueError(f"{weights_path.name} has no tensor {name!r} (expected shape {shape} from config.json "
                             f"and int{bits}{'' if group_size is None else f', group_size={group_size}'})")
        if stored[name][0] != shape:
            raise ValueError(f"tensor {name!r} has shape {stored[name][0]} in {weights_path.name} but config.json "
                             f"implies {shape}; the weights and config.json do not belong together")
    unexpected = sorted(set(stored) - set(wanted))
    if unexpected:
        raise ValueError(f"{weights_path.name} holds tensors this configuration does not use: {unexpected[:5]}; "
                         "is config.json for a different model or quantization?")

    def read(f, name: str) -> torch.Tensor:
        tensor = f.get_tensor(name)
        want = wanted[name][1]
        if tensor.dtype != want:
            raise ValueError(f"tensor {name!r} is stored as {tensor.dtype}, expected {want}")
        return tensor.to(device)

    with safe_open(str(weights_path), framework="pt") as f:
        for name, shape in float_names.items():
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            setattr(module, attr, nn.Parameter(read(f, _hf(name)), requires_grad=False))
        if config.tie_embeddings and not include_head:
            model.lm_head.weight = model.embed_tokens.weight
        for name, fields in expected.items():
            state = {field: read(f, f"{_hf(name)}.{field}") for field in fields}
            state.setdefault("zeros", None)
            state.setdefault("bias", None)
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr,
                    QuantizedLinear.from_state(state, bits, group_size, kernel))
    model.quantization = {"scheme": f"int{bits}", "bits": bits, "group_size": group_size,
                          "include_head": include_head}
    model._rope_cache = None
    tokenizer = None
    if load_tokenizer and (folder / "tokenizer.json").is_file():
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        tokenizer = Tokenizer.from_file(folder / "tokenizer.json", gen.get("bos_token_id", config.bos_token_id),
                                        gen.get("eos_token_id", config.eos_token_id))
    return model.eval(), tokenizer
