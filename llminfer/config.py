"""Model shapes: `ModelConfig`, read from a Hugging Face config.json, and presets of published models. Chapter 00."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3_moe", "mixtral", "olmoe")
# Mixtures of experts among them (chapter 14); what the router's softmax does and how q and k are normalised
# follow from the family (llminfer.moe). Shape-only types: their presets give published shapes for the cost
# model, and no checkpoint of them loads (DeepSeek-V3's multi-head latent attention, gpt-oss's attention sinks,
# biased experts and clamped SwiGLU are not implemented).
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")
SHAPE_ONLY_MODEL_TYPES = ("deepseek_v3", "gpt_oss")
# The families that take the softmax over the k chosen logits only (the others: over all experts, then top-k).
TOPK_THEN_SOFTMAX = ("mixtral", "gpt_oss")
# How q and k are RMS-normalised before RoPE: over each head (Qwen3) or over all heads of q, of k (OLMoE).
QK_NORM = {"qwen3_moe": "head", "olmoe": "full"}
SUPPORTED_ROPE_TYPES = ("llama3",)

# The name each field has in a Hugging Face config.json, so that an error names both.
HF_NAMES = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads", "hidden_dim": "intermediate_size", "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings", "qkv_bias": "attention_bias",
    "attn_backend": "llminfer_attn_backend", "n_experts": "num_experts", "n_experts_per_tok": "num_experts_per_tok",
    "moe_hidden_dim": "moe_intermediate_size", "shared_expert_dim": "shared_expert_intermediate_size",
}

# What transformers assumes where a config.json leaves a field out (its LlamaConfig, Qwen2Config, MistralConfig).
HF_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "sliding_window": 4096, "max_window_layers": 28},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "sliding_window": 4096},
    "qwen3_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "sliding_window": 4096,
                  "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "mixtral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "sliding_window": None,
                "num_experts": 8, "num_experts_per_tok": 2},
    "olmoe": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "num_experts": 64, "num_experts_per_tok": 8},
}

# Llama 3's published long-context rescaling, used where a llama3 rope_scaling leaves a key out.
LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _label(name: str) -> str:
    """'ModelConfig.norm_eps (config.json: rms_norm_eps)': a field under both its names."""
    hf_name = HF_NAMES.get(name, name)
    return f"ModelConfig.{name}" + (f" (config.json: {hf_name})" if hf_name != name else "")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_count(label: str, value: Any) -> None:
    if not _is_count(value):
        raise ValueError(f"{label} must be a positive integer, got {value!r}; "
                         "set it to the value the model was trained with")


def _check_positive(label: str, value: Any, meaning: str) -> None:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{label} must be a finite number > 0 ({meaning}), got {value!r}")


def _parse_bool(key: str, value: Any) -> bool:
    """A config.json boolean: true/false, or the strings "true"/"false" in any case. Anything else is refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"config.json field {key!r} must be a boolean (true or false), got {value!r}; "
                     "write it as a JSON true or false")


def _normalise_rope_scaling(scaling: Any) -> Any:
    """rope_scaling with its kind under "rope_type" (the legacy "type" read too) and llama3's defaults filled in."""
    if not isinstance(scaling, dict):
        return scaling                                   # None, or something validate() refuses
    kind = scaling.get("rope_type", scaling.get("type"))
    rest = {k: v for k, v in scaling.items() if k not in ("type", "rope_type", "rope_theta")}
    if kind == "default" or (kind is None and not rest):
        return None                                      # plain RoPE; transformers ignores any other keys here
    if kind == "llama3":
        rest = {**LLAMA3_ROPE_DEFAULTS, **rest}
    return {"rope_type": kind, **rest}


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
    attn_backend: str = "sdpa"    # the attention backend the model runs, by its registered name
    # A mixture of experts (chapter 14; n_experts=0: every layer's feed-forward is the dense SwiGLU of hidden_dim)
    n_experts: int = 0            # experts of an MoE layer (HF: num_experts, Mixtral's num_local_experts)
    n_experts_per_tok: int = 0    # experts each token goes to, k (HF: num_experts_per_tok)
    moe_hidden_dim: int | None = None  # width of each expert's SwiGLU (HF: moe_intermediate_size; Mixtral and
    #                               OLMoE: intermediate_size); defaults to hidden_dim
    norm_topk_prob: bool = False  # renormalise the k chosen probabilities to sum to one (Qwen3-MoE, DeepSeek-V3)
    shared_expert_dim: int = 0    # width of a dense SwiGLU every token goes through as well (0: none)
    shared_expert_gate: bool = False   # scale the shared expert by sigmoid(x · w) (Qwen2-MoE), not by 1 (DeepSeek)
    mlp_only_layers: tuple = ()   # layers whose feed-forward stays dense (HF: mlp_only_layers; DeepSeek-V3's
    #                               first_k_dense_replace=3 is (0, 1, 2))
    decoder_sparse_step: int = 1  # every step-th layer is MoE (HF: decoder_sparse_step)
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling)
        if self.head_dim is None:
            _check_count(_label("dim"), self.dim)
            _check_count(_label("n_heads"), self.n_heads)
            if self.dim % self.n_heads != 0:
                raise ValueError(
                    f"{_label('dim')}={self.dim} is not divisible by {_label('n_heads')}={self.n_heads}, so "
                    "head_dim cannot be derived as dim // n_heads; choose n_heads dividing dim, or give head_dim "
                    "explicitly (config.json: head_dim)")
            self.head_dim = self.dim // self.n_heads
        if self.moe_hidden_dim is None and self.n_experts:
            self.moe_hidden_dim = self.hidden_dim
        if isinstance(self.mlp_only_layers, list):
            self.mlp_only_layers = tuple(self.mlp_only_layers)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that cannot describe a working model."""
        if self.model_type not in SUPPORTED_MODEL_TYPES + SHAPE_ONLY_MODEL_TYPES:
            raise ValueError(
                f"ModelConfig.model_type {self.model_type!r} is not supported; llminfer runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "head_dim", "max_seq_len"):
            _check_count(_label(name), getattr(self, name))
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"{_label('n_heads')}={self.n_heads} is not a multiple of {_label('n_kv_heads')}={self.n_kv_heads}; "
                "grouped-query attention shares each K/V head among n_heads // n_kv_heads query heads, so n_kv_heads "
                "must divide n_heads")
        if self.head_dim % 2 != 0:
            raise ValueError(f"{_label('head_dim')}={self.head_dim} must be even: rotary embeddings turn "
                             "dimensions in pairs")
        _check_positive(_label("norm_eps"), self.norm_eps, "RMSNorm adds it to the mean square before the square root")
        _check_positive(_label("rope_theta"), self.rope_theta, "the base of the rotary frequencies")
        for name in ("tie_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{_label(name)} must be True or False, got {getattr(self, name)!r}")
        if self.qkv_bias != (self.model_type == "qwen2") and self.model_type not in SHAPE_ONLY_MODEL_TYPES:
            if self.model_type == "qwen2":
                raise ValueError("ModelConfig.qkv_bias is False but a qwen2 model always has a q/k/v bias; "
                                 "set qkv_bias=True, or use model_type='llama' for a model without one")
            raise ValueError(
                f"ModelConfig.qkv_bias is True for model_type={self.model_type!r}: a {self.model_type} checkpoint "
                "has no q/k/v-only bias (Llama's attention_bias also puts one on o_proj, which llminfer does not "
                "implement; Mistral has none); use model_type='qwen2' for q/k/v biases")
        self._validate_rope_scaling()
        self._validate_experts()
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value < self.vocab_size):
                raise ValueError(f"ModelConfig.{name} must be None or a token id in 0..{self.vocab_size - 1} "
                                 f"(vocab_size={self.vocab_size}), got {value!r}")
        if not isinstance(self.attn_backend, str) or not self.attn_backend.strip():
            raise ValueError(f"{_label('attn_backend')} must name an attention backend such as 'sdpa' or "
                             f"'explicit', got {self.attn_backend!r}")

    def _validate_experts(self) -> None:
        """The mixture-of-experts fields: all zero for a dense model; for an MoE family, 1 <= k <= E and the rest
        consistent. Raises ValueError naming the field, its value, the limit and the fix."""
        moe = self.model_type in MOE_MODEL_TYPES
        if not moe:
            used = [name for name in ("n_experts", "n_experts_per_tok", "shared_expert_dim")
                    if getattr(self, name)] + (["mlp_only_layers"] if self.mlp_only_layers else [])
            if used:
                raise ValueError(f"{', '.join(_label(n) for n in used)} set for model_type={self.model_type!r}, a "
                                 f"dense family; use an MoE model_type ({', '.join(MOE_MODEL_TYPES)}) for experts, "
                                 "or leave them at 0")
            return
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) or self.n_experts < 1:
            raise ValueError(f"{_label('n_experts')} is {self.n_experts!r}, but a {self.model_type} model routes "
                             "every token to experts and needs at least one; set it to the checkpoint's number of "
                             "experts (Mixtral-8x7B: 8, Qwen3-30B-A3B: 128)")
        k = self.n_experts_per_tok
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.n_experts:
            raise ValueError(f"{_label('n_experts_per_tok')} is {k!r}, outside 1..{self.n_experts} "
                             f"({_label('n_experts')}={self.n_experts}): each token goes to that many different "
                             f"experts; set it to at most {self.n_experts}, or add experts")
        _check_count(_label("moe_hidden_dim"), self.moe_hidden_dim)
        for name in ("shared_expert_dim", "decoder_sparse_step"):
            value = getattr(self, name)
            low = 0 if name == "shared_expert_dim" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{_label(name)} must be an integer >= {low}, got {value!r}")
        for name in ("norm_topk_prob", "shared_expert_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{_label(name)} must be True or False, got {getattr(self, name)!r}")
        if self.shared_expert_gate and not self.shared_expert_dim:
            raise ValueError(f"ModelConfig.shared_expert_gate is True but {_label('shared_expert_dim')} is 0: there "
                             "is no shared expert to gate; give its width, or set shared_expert_gate=False")
        bad = [i for i in self.mlp_only_layers
               if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers]
        if not isinstance(self.mlp_only_layers, tuple) or bad:
            raise ValueError(f"ModelConfig.mlp_only_layers must be a tuple of layer indices in 0..{self.n_layers - 1}"
                             f" (n_layers={self.n_layers}), got {self.mlp_only_layers!r}")

    @property
    def is_moe(self) -> bool:
        """Whether any layer's feed-forward is a mixture of experts. Chapter 14."""
        return bool(self.moe_layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose feed-forward is a mixture of experts (the others run the dense SwiGLU of hidden_dim),
        as transformers places them: not in mlp_only_layers, and every decoder_sparse_step-th. Chapter 14."""
        if not self.n_experts:
            return ()
        return tuple(i for i in range(self.n_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def softmax_before_topk(self) -> bool:
        """The router's order (llminfer.moe.route): a softmax over all experts, then top-k (Qwen, OLMoE,
        DeepSeek's sigmoid alike), or top-k of the logits, then a softmax over those k (Mixtral, gpt-oss)."""
        return self.model_type not in TOPK_THEN_SOFTMAX

    @property
    def qk_norm(self) -> str | None:
        """'head' (an RMSNorm over each head of q and k, Qwen3), 'full' (over all of q, all of k, OLMoE) or None."""
        return QK_NORM.get(self.model_type)

    def _validate_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise ValueError(f"ModelConfig.rope_scaling must be None or a dict like "
                             f"{{'rope_type': 'llama3', 'factor': 32.0}}, got {scaling!r}")
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling of type {kind!r} is not supported; llminfer supports "
                             f"{', '.join(map(repr, SUPPORTED_ROPE_TYPES))} (or no rope_scaling for plain RoPE)")
        params = {**LLAMA3_ROPE_DEFAULTS, **scaling}
        if "factor" not in scaling:
            raise ValueError("rope_scaling['factor'] is missing from a llama3 rope_scaling; it is how many times "
                             "longer than original_max_position_embeddings the context was stretched (32.0 for "
                             "Llama 3.2, 8.0 for Llama 3.1)")
        _check_positive("rope_scaling['factor']", params["factor"], "the context stretch of llama3 rope scaling")
        _check_positive("rope_scaling['low_freq_factor']", params["low_freq_factor"],
                        "wavelengths above original_max_position_embeddings / low_freq_factor are slowed down")
        _check_positive("rope_scaling['high_freq_factor']", params["high_freq_factor"],
                        "wavelengths below original_max_position_embeddings / high_freq_factor are kept")
        if params["high_freq_factor"] <= params["low_freq_factor"]:
            raise ValueError(
                f"rope_scaling['high_freq_factor']={params['high_freq_factor']} must exceed "
                f"rope_scaling['low_freq_factor']={params['low_freq_factor']}: llama3 rope scaling blends "
                "frequencies between the two, dividing by their difference (Llama 3 uses 4.0 and 1.0)")
        _check_count("rope_scaling['original_max_position_embeddings']", params["original_max_position_embeddings"])

    @property
    def n_groups(self) -> int:
        """Query heads that share one K/V head."""
        return self.n_heads // self.n_kv_heads

    def n_params(self, include_embeddings: bool = True, active: bool = False) -> int:
        """Number of parameters of a model of this shape; active=True counts those one token uses (the router and
        its k experts of each MoE layer, not the other E - k). Chapters 00, 14."""
        q = self.dim * self.n_heads * self.head_dim + (self.n_heads * self.head_dim if self.qkv_bias else 0)
        kv = 2 * (self.dim * self.n_kv_heads * self.head_dim + (self.n_kv_heads * self.head_dim if self.qkv_bias else 0))
        o = self.n_heads * self.head_dim * self.dim
        qk_norm = {"head": 2 * self.head_dim, "full": (self.n_heads + self.n_kv_heads) * self.head_dim}.get(
            self.qk_norm, 0)
        mlp = 3 * self.dim * self.hidden_dim
        per_layer = q + kv + o + qk_norm + 2 * self.dim
        moe_layers = len(self.moe_layers)
        total = self.n_layers * per_layer + (self.n_layers - moe_layers) * mlp + self.dim  # final norm
        if moe_layers:
            experts = self.n_experts_per_tok if active else self.n_experts
            shared = 3 * self.dim * self.shared_expert_dim + (self.dim if self.shared_expert_gate else 0)
            total += moe_layers * (self.dim * self.n_experts + experts * 3 * self.dim * self.moe_hidden_dim + shared)
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
        """Read the fields of a Hugging Face config.json (Llama, Qwen2 or Mistral), refusing what llminfer cannot run. Chapter 00."""
        if not isinstance(hf, dict):
            raise ValueError(f"ModelConfig.from_hf takes the dict parsed from a config.json, got "
                             f"{type(hf).__name__}; read it with json.loads(Path('config.json').read_text())")
        model_type = hf.get("model_type", "llama")
        if model_type in SHAPE_ONLY_MODEL_TYPES:
            raise ValueError(
                f"config.json has model_type {model_type!r}, whose published shape llminfer knows for its cost model "
                f"(get_preset) but whose checkpoints it cannot run (DeepSeek-V3's multi-head latent attention, "
                f"gpt-oss's attention sinks and biased experts); llminfer runs {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json has model_type {model_type!r}; llminfer runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size") if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks the field(s) {missing}; it does not describe a decoder llminfer can run")
        defaults = HF_DEFAULTS[model_type]

        hidden_act = hf.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config.json field 'hidden_act' is {hidden_act!r}; llminfer's MLP is SwiGLU and "
                             "supports only 'silu'")
        if _parse_bool("mlp_bias", hf.get("mlp_bias", False)):
            raise ValueError("config.json field 'mlp_bias' is true: the MLP's gate/up/down projections carry biases, "
                             "which llminfer's MLP does not have; models with mlp_bias=false run")
        attention_bias = _parse_bool("attention_bias", hf.get("attention_bias", False))
        if model_type in ("llama", "qwen3_moe", "olmoe") and attention_bias:
            raise ValueError(f"config.json field 'attention_bias' is true for a {model_type} model: that puts a bias "
                             "on q_proj, k_proj, v_proj and o_proj, and llminfer has no o_proj bias; models with "
                             "attention_bias=false (or Qwen2, whose bias is on q, k and v only) run")
        if hf.get("clip_qkv") is not None:
            raise ValueError(f"config.json field 'clip_qkv' is {hf['clip_qkv']!r}: OLMoE would clamp q, k and v to "
                             "that range, which llminfer does not; models with clip_qkv null run")
        # transformers reads attention_bias for Llama only: Qwen2 always has q/k/v biases, Mistral never does.
        qkv_bias = model_type == "qwen2"
        tie_embeddings = _parse_bool("tie_word_embeddings", hf.get("tie_word_embeddings", False))

        n_heads = hf["num_attention_heads"]
        _check_count("config.json field 'num_attention_heads'", n_heads)
        n_kv_heads = hf.get("num_key_value_heads")
        if n_kv_heads is None:
            n_kv_heads = n_heads                         # no GQA: one K/V head per query head
        max_seq_len = hf.get("max_position_embeddings", defaults["max_position_embeddings"])
        _check_count("config.json field 'max_position_embeddings'", max_seq_len)
        _refuse_sliding_window(hf, model_type, max_seq_len)

        rope_params = hf.get("rope_parameters") or {}
        if not isinstance(rope_params, dict):
            raise ValueError(f"config.json field 'rope_parameters' must be an object, got {rope_params!r}")
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") not in ("default", None):
            rope_scaling = rope_params
        rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        norm_eps = hf.get("rms_norm_eps", defaults["rms_norm_eps"])
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(**_moe_fields(hf, model_type),
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            hidden_dim=hf["intermediate_size"],
            head_dim=hf.get("head_dim"),                 # None: derived as hidden_size // num_attention_heads
            max_seq_len=max_seq_len,
            norm_eps=float(norm_eps) if _is_number(norm_eps) else norm_eps,
            rope_theta=float(rope_theta) if _is_number(rope_theta) else rope_theta,
            rope_scaling=rope_scaling,
            tie_embeddings=tie_embeddings,
            qkv_bias=qkv_bias,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            model_type=model_type,
            attn_backend=hf.get("llminfer_attn_backend", "sdpa"),
        )

    def to_hf(self) -> dict:
        """The fields of a Hugging Face config.json for this shape."""
        if self.model_type in SHAPE_ONLY_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is a published shape for the cost model only; llminfer "
                             "writes no checkpoint of it")
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                "olmoe": "OlmoeForCausalLM"}[self.model_type]
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
        if self.model_type in ("llama", "qwen3_moe", "olmoe"):
            hf["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = False
        elif self.model_type != "olmoe":
            hf["sliding_window"] = None                  # every layer attends over the whole prefix
        if self.model_type in ("qwen2", "qwen3_moe"):
            hf["use_sliding_window"] = False
        unsaved = [name for name, kept in (("shared_expert_dim", not self.shared_expert_dim),
                                           ("mlp_only_layers", self.model_type == "qwen3_moe" or not self.mlp_only_layers),
                                           ("decoder_sparse_step", self.model_type == "qwen3_moe"
                                            or self.decoder_sparse_step == 1)) if not kept]
        if unsaved:
            raise ValueError(f"a {self.model_type} config.json cannot hold {', '.join(unsaved)} (transformers' "
                             f"{arch} has no such field); such a model runs here but has no Hugging Face form")
        if self.is_moe:
            hf.update({"num_experts": self.n_experts, "num_experts_per_tok": self.n_experts_per_tok})
        if self.model_type == "qwen3_moe":
            hf.update({"moe_intermediate_size": self.moe_hidden_dim, "norm_topk_prob": self.norm_topk_prob,
                       "decoder_sparse_step": self.decoder_sparse_step, "mlp_only_layers": list(self.mlp_only_layers)})
        elif self.model_type in ("mixtral", "olmoe"):
            hf["intermediate_size"] = self.moe_hidden_dim   # these families' one width is the experts'
        if self.model_type == "olmoe":
            hf.update({"norm_topk_prob": self.norm_topk_prob, "clip_qkv": None})
        return hf


def _moe_fields(hf: dict, model_type: str) -> dict:
    """ModelConfig's mixture-of-experts fields from a config.json (none for a dense family), with transformers'
    defaults; the values are checked by ModelConfig.validate, which names each field. Chapter 14."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    defaults = HF_DEFAULTS[model_type]
    counts = {key: hf[key] for key in ("num_experts", "num_local_experts") if key in hf}
    if len(set(map(repr, counts.values()))) > 1:
        raise ValueError(f"config.json gives num_experts={counts['num_experts']!r} and num_local_experts="
                         f"{counts['num_local_experts']!r}, two names transformers reads as one field; keep one")
    fields = {"n_experts": next(iter(counts.values()), defaults["num_experts"]),
              "n_experts_per_tok": hf.get("num_experts_per_tok", defaults["num_experts_per_tok"])}
    if model_type == "mixtral":
        fields["moe_hidden_dim"] = hf["intermediate_size"]
        return fields
    fields["norm_topk_prob"] = _parse_bool("norm_topk_prob", hf.get("norm_topk_prob", False))
    if model_type == "olmoe":
        fields["moe_hidden_dim"] = hf["intermediate_size"]
        return fields
    fields["moe_hidden_dim"] = hf.get("moe_intermediate_size", defaults["moe_intermediate_size"])
    fields["decoder_sparse_step"] = hf.get("decoder_sparse_step", 1)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list):
        raise ValueError(f"config.json field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
    fields["mlp_only_layers"] = tuple(only)
    return fields


def _refuse_sliding_window(hf: dict, model_type: str, max_seq_len: int) -> None:
    """Raise ValueError if config.json makes any layer attend over a sliding window (transformers' reading of it)."""
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or any(kind != "full_attention" for kind in layer_types):
            raise ValueError(f"config.json field 'layer_types' is {layer_types!r}; llminfer attends over the "
                             "whole causal prefix in every layer, so every entry must be 'full_attention'")
    if model_type in ("llama", "olmoe"):
        return                                           # no sliding window; transformers ignores the key
    window = hf.get("sliding_window", HF_DEFAULTS[model_type]["sliding_window"])
    if model_type in ("qwen2", "qwen3_moe"):
        in_use = _parse_bool("use_sliding_window", hf.get("use_sliding_window", False))
        where = "use_sliding_window is true"
    else:
        in_use = True
        where = f"{model_type.capitalize()} applies it whenever it is not null"
    if not in_use or window is None:
        return
    if not _is_count(window):
        raise ValueError(f"config.json field 'sliding_window' must be null or a positive integer, got {window!r}")
    if window >= max_seq_len:
        return                                           # a window as long as the context never cuts anything off
    if model_type == "qwen2":
        n_layers = hf["num_hidden_layers"]
        first = hf.get("max_window_layers", HF_DEFAULTS["qwen2"]["max_window_layers"])
        if _is_count(n_layers) and isinstance(first, int) and first >= n_layers:
            return                                       # Qwen2 slides only layers >= max_window_layers: none here
        where += f" and max_window_layers={first!r} < num_hidden_layers={n_layers!r}"
    raise ValueError(
        f"config.json field 'sliding_window' is {window} and {where}, so layers attend only to their last {window} "
        f"positions; llminfer attends over the whole causal prefix in every layer and would compute different "
        f"logits past position {window}. Sliding-window attention is not supported: use a config with "
        f"sliding_window null (or use_sliding_window false), or cap max_position_embeddings at {window}")


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
    "mixtral-8x7b": "https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json",
    "qwen3-30b-a3b": "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
    # Its MoE shape as published (256 routed experts, 8 a token, one shared expert, three dense layers first).
    # Multi-head latent attention is approximated: 128 query heads of 128 and 2 K/V heads, so a token caches 512
    # numbers a layer (MLA: 576, a 512-wide latent and a 64-wide RoPE key) and the attention weights are 238M a
    # layer (MLA: 187M). Its sigmoid router with group-limited choice and its yarn RoPE scaling are left out.
    "deepseek-v3": "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json",
    # Its shape as published; its attention sinks, alternate 128-token sliding windows, o_proj and expert biases,
    # clamped SwiGLU and yarn RoPE scaling are left out (the biases are 0.04% of its weights).
    "gpt-oss-20b": "https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json",
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
    "mixtral-8x7b": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                                max_seq_len=32768, rope_theta=1000000.0, model_type="mixtral", n_experts=8,
                                n_experts_per_tok=2, bos_token_id=1, eos_token_id=2),
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144,
                                 head_dim=128, max_seq_len=40960, norm_eps=1e-6, rope_theta=1000000.0,
                                 model_type="qwen3_moe", n_experts=128, n_experts_per_tok=8, moe_hidden_dim=768,
                                 norm_topk_prob=True, bos_token_id=151643, eos_token_id=151645),
    "deepseek-v3": ModelConfig(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=2, hidden_dim=18432,
                               head_dim=128, max_seq_len=163840, norm_eps=1e-6, model_type="deepseek_v3",
                               n_experts=256, n_experts_per_tok=8, moe_hidden_dim=2048, norm_topk_prob=True,
                               shared_expert_dim=2048, mlp_only_layers=(0, 1, 2), bos_token_id=0, eos_token_id=1),
    "gpt-oss-20b": ModelConfig(vocab_size=201088, dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, hidden_dim=2880,
                               head_dim=64, max_seq_len=131072, rope_theta=150000.0, qkv_bias=True,
                               model_type="gpt_oss", n_experts=32, n_experts_per_tok=4, eos_token_id=200002),
}


def get_preset(name: str) -> ModelConfig:
    """The published shape called `name` (a copy). Chapter 04."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model shape {name!r}; known shapes: {', '.join(PRESETS)}")
    return PRESETS[key].replace()
