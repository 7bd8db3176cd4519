"""Model shapes: `ModelConfig`, read from a Hugging Face config.json, and presets of published models. Chapter 00."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass
class ModelConfig:
    """The shape of a Llama-family decoder. Chapter 00."""

    vocab_size: int
    dim: int                      # width of the residual stream (HF: hidden_size)
    n_layers: int
    n_heads: int                  # query heads
    n_kv_heads: int               # key/value heads; < n_heads means grouped-query attention
    hidden_dim: int               # width of the SwiGLU MLP (HF: intermediate_size)
    head_dim: int | None = None   # defaults to dim // n_heads
    max_seq_len: int = 2048       # HF: max_position_embeddings
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # e.g. {"rope_type": "llama3", "factor": 32.0, ...}
    tie_embeddings: bool = False
    qkv_bias: bool = False        # Qwen2 puts a bias on q, k and v
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "llama"
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads if self.n_heads else 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that cannot describe a working model."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "head_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}; "
                "grouped-query attention shares each K/V head among n_heads // n_kv_heads query heads"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; llminfer runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.model_type == "qwen2" and not self.qkv_bias:
            raise ValueError("a qwen2 model always has a q/k/v bias (qkv_bias=True); use model_type='llama' for one without")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default", None):
                raise ValueError(f"rope_scaling of type {kind!r} is not supported; llminfer supports 'llama3'")

    @property
    def n_groups(self) -> int:
        """Query heads that share one K/V head."""
        return self.n_heads // self.n_kv_heads

    def n_params(self, include_embeddings: bool = True) -> int:
        """Number of parameters of a model of this shape."""
        q = self.dim * self.n_heads * self.head_dim + (self.n_heads * self.head_dim if self.qkv_bias else 0)
        kv = 2 * (self.dim * self.n_kv_heads * self.head_dim + (self.n_kv_heads * self.head_dim if self.qkv_bias else 0))
        o = self.n_heads * self.head_dim * self.dim
        mlp = 3 * self.dim * self.hidden_dim
        per_layer = q + kv + o + mlp + 2 * self.dim
        total = self.n_layers * per_layer + self.dim  # final norm
        if include_embeddings:
            total += self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        else:
            total += 0 if self.tie_embeddings else self.vocab_size * self.dim
        return total

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Read the fields of a Hugging Face config.json (Llama, Qwen2 or Mistral). Chapter 00."""
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json has model_type {model_type!r}; llminfer runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size") if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks the field(s) {missing}; it does not describe a decoder llminfer can run")
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_scaling = hf.get("rope_scaling") or None
        if rope_scaling is None and rope_params.get("rope_type", "default") not in ("default", None):
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            kind = rope_scaling.pop("type", None) or rope_scaling.get("rope_type")
            rope_scaling["rope_type"] = kind
            if kind == "default":
                rope_scaling = None
        rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        n_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        qkv_bias = hf.get("attention_bias", model_type == "qwen2")
        return cls(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            hidden_dim=hf["intermediate_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            max_seq_len=hf.get("max_position_embeddings", 2048),
            norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(qkv_bias),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            model_type=model_type,
        )

    def to_hf(self) -> dict:
        """The fields of a Hugging Face config.json for this shape."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[self.model_type]
        hf = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.hidden_dim,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type == "llama":
            hf["attention_bias"] = self.qkv_bias
            hf["mlp_bias"] = False
        return hf


def _llama3_scaling(factor: float, original: int = 8192) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original}


# Published shapes, copied field by field from each model's config.json on the Hugging Face hub.
PRESET_SOURCES: dict[str, str] = {
    "smollm2-135m": "https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json",
    "qwen2.5-0.5b": "https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json",
    "llama-3.2-1b": "https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json",
    "llama-2-7b": "https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json",
    "mistral-7b": "https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json",
    "qwen2.5-7b": "https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json",
    "llama-3-8b": "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json",
    "llama-3.1-8b": "https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
    "llama-3-70b": "https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json",
}

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536,
                                max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True,
                                bos_token_id=0, eos_token_id=0),
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, hidden_dim=4864,
                                max_seq_len=32768, norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=True,
                                qkv_bias=True, model_type="qwen2", bos_token_id=151643, eos_token_id=151643),
    "llama-3.2-1b": ModelConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192,
                                head_dim=64, max_seq_len=131072, rope_theta=500000.0,
                                rope_scaling=_llama3_scaling(32.0), tie_embeddings=True,
                                bos_token_id=128000, eos_token_id=128001),
    "llama-2-7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, hidden_dim=11008,
                              max_seq_len=4096, bos_token_id=1, eos_token_id=2),
    "mistral-7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                              max_seq_len=32768, model_type="mistral", bos_token_id=1, eos_token_id=2),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, hidden_dim=18944,
                              max_seq_len=131072, norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True,
                              model_type="qwen2", bos_token_id=151643, eos_token_id=151643),
    "llama-3-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                              max_seq_len=8192, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                                max_seq_len=131072, rope_theta=500000.0, rope_scaling=_llama3_scaling(8.0),
                                bos_token_id=128000, eos_token_id=128001),
    "llama-3-70b": ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden_dim=28672,
                               max_seq_len=8192, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001),
}


def get_preset(name: str) -> ModelConfig:
    """The published shape called `name` (a copy). Chapter 04."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model shape {name!r}; known shapes: {', '.join(PRESETS)}")
    return PRESETS[key].replace()
