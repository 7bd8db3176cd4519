"""Loading and saving Hugging Face-format model folders (safetensors only), the bundled model, random presets. Chapter 00."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig, get_preset
from .model import Transformer
from .device import check_fits, dtype_bytes, resolve_device
from .tokenizer import Tokenizer

__all__ = ["load_pretrained", "save_pretrained", "load_random", "resolve_device", "bundled_models"]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_FILES = ["config.json", "generation_config.json", "tokenizer.json", "*.safetensors", "model.safetensors.index.json"]


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


def _weight_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index ({exc})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{index.name} lists the shard {f.name}, which is missing from {folder}")
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(f"{folder} holds only pickle checkpoint(s) {pickles}; llminfer reads safetensors only and "
                         "never unpickles a file (it can run arbitrary code). Convert it once where you trust it, "
                         "e.g. with transformers' save_pretrained(..., safe_serialization=True)")
    raise FileNotFoundError(f"no weights in {folder}: expected model.safetensors or model.safetensors.index.json")


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types for truncated or corrupt files
            raise ValueError(f"could not read {path}: {exc}. The file is truncated or not a safetensors file; "
                             "download or save it again") from None
    return tensors


def _hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def _fetch_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as exc:
        raise OSError(f"could not fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
                      "Without a network, download the model elsewhere and pass its local folder: "
                      "llminfer.load_pretrained('/path/to/folder')") from None


def _locate(path_or_name: str | Path) -> Path:
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_name)
    if name in bundled_models():
        return _models_dir() / name
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not path.exists():
        return _fetch_from_hub(name)
    raise FileNotFoundError(f"{name!r} is not a folder, a bundled model ({', '.join(bundled_models()) or 'none'}) "
                            "or a hub id like 'HuggingFaceTB/SmolLM2-135M'")


def load_pretrained(path_or_name: str | Path, device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None, load_tokenizer: bool = True):
    """Returns (model, tokenizer) from a HF-format folder, a bundled model's name or a hub id. Chapter 00."""
    device = resolve_device(device)
    dtype = dtype or torch.float32
    folder = _locate(path_or_name)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}; a model folder needs config.json, weights "
                                "(model.safetensors) and tokenizer.json")
    config = ModelConfig.from_hf(json.loads(config_path.read_text()))
    files = _weight_files(folder)
    tokenizer = None
    if load_tokenizer:
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}; add it, or pass load_tokenizer=False "
                                    "to load the weights alone")
        gen = folder / "generation_config.json"
        gen_cfg = json.loads(gen.read_text()) if gen.is_file() else {}
        eos = gen_cfg.get("eos_token_id", config.eos_token_id)
        tokenizer = Tokenizer.from_file(folder / "tokenizer.json", gen_cfg.get("bos_token_id", config.bos_token_id),
                                        eos[0] if isinstance(eos, list) else eos)
    check_fits(config.n_params() * dtype_bytes(dtype), device, f"the weights of {folder.name} in {dtype}")
    tensors = _read_tensors(files)
    with torch.device("meta"):
        model = Transformer(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # ties share one name
    for name, shape in expected.items():
        hf = _hf_name(name)
        if hf not in tensors:
            if name == "lm_head.weight" and config.tie_embeddings:
                continue
            raise ValueError(f"the checkpoint has no tensor {hf!r} (expected shape {shape} from config.json)")
        if tuple(tensors[hf].shape) != shape:
            raise ValueError(f"tensor {hf!r} has shape {tuple(tensors[hf].shape)} in the checkpoint but config.json "
                             f"implies {shape}; the weights and config.json do not belong together")
    known = {_hf_name(n) for n in expected} | {"lm_head.weight"}
    unexpected = sorted(n for n in tensors if n not in known and not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"the checkpoint holds tensors this architecture does not use: {unexpected[:5]}; "
                         "is config.json for a different model?")
    model = model.to_empty(device=device)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[_hf_name(name)])
    model = model.to(dtype).eval()
    return model, tokenizer


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size {size!r} is not a size like 5000000, '10MB' or '2GiB'")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(match.group(1)) * scale)


def save_pretrained(model: Transformer, folder: str | Path, tokenizer: Tokenizer | None = None,
                    max_shard_size: int | str | None = None) -> Path:
    """Write config.json and safetensors weights (sharded past max_shard_size) in Hugging Face's layout."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    hf_config = config.to_hf()
    hf_config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tensors = {}
    for name, param in model.named_parameters():  # a tied head is stored once, as the embedding
        tensors[_hf_name(name)] = param.detach().to("cpu").contiguous()
    limit = _parse_size(max_shard_size) if max_shard_size is not None else None
    if limit is None or sum(t.nbytes for t in tensors.values()) <= limit:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
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
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(folder / "tokenizer.json")
    return folder


def load_random(name_or_config: str | ModelConfig, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None, seed: int = 0, max_seq_len: int | None = None) -> Transformer:
    """A model of a published shape with random N(0, 0.02²) weights, for timing, never for text. Chapter 04."""
    config = get_preset(name_or_config) if isinstance(name_or_config, str) else name_or_config
    if max_seq_len is not None:
        config = config.replace(max_seq_len=max_seq_len)
    device = resolve_device(device)
    dtype = dtype or torch.float32
    check_fits(config.n_params() * dtype_bytes(dtype), device, f"a {config.n_params() / 1e6:.0f}M-parameter model "
               f"in {dtype}")
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.init_weights(seed).eval()
