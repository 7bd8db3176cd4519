"""The same weights for llama.cpp: a GGUF file written with the `gguf` package, and a timed llama.cpp run. Chapter 08.

llama.cpp is the strongest CPU peer for decode. To compare like with like it must run the very weights
llminfer runs, so `write_gguf(model, path, "F32" | "BF16" | "F16" | "Q8_0" | "Q4_0")` writes them in
llama.cpp's format: its tensor names, its rotary layout (q and k rows permuted from Hugging Face's
half-split pairs to llama.cpp's interleaved pairs, as its own converter does), and a placeholder
vocabulary (token ids are fed directly; no text is tokenized). Q8_0 and Q4_0 quantize in blocks of 32
with one scale each (Q4_0 symmetric), llama.cpp's own formats, computed by the `gguf` package.

`llama_cpp_generate` times greedy decoding with llama-cpp-python (`make peer-llama-cpp` builds it from source
at its best for this CPU) and returns a GenerationResult like every other loop in the package; the benchmarks
call it in a process of its own (`bench.llama_peer`).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from ..generate import GenerationResult

__all__ = ["GGUF_TYPES", "write_gguf", "llama_cpp_available", "load_llama_cpp", "llama_cpp_generate"]

GGUF_TYPES = ("F32", "BF16", "F16", "Q8_0", "Q4_0")


def _permute_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a q or k projection from half-split rotary pairs (i, i + d/2) to interleaved (2i, 2i + 1)."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tensors(model) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) of every weight, in llama.cpp's names and layout."""
    config = model.config
    if config.qkv_bias or config.model_type != "llama":
        raise ValueError(f"write_gguf writes the llama architecture; this model is {config.model_type!r}"
                         f"{' with q/k/v biases' if config.qkv_bias else ''}")

    def array(tensor) -> np.ndarray:
        return tensor.detach().float().cpu().numpy()

    out = [("token_embd.weight", array(model.embed_tokens.weight))]
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
        out += [(f"blk.{i}.attn_norm.weight", array(layer.input_layernorm.weight)),
                (f"blk.{i}.attn_q.weight", _permute_rope(array(q), config.n_heads)),
                (f"blk.{i}.attn_k.weight", _permute_rope(array(k), config.n_kv_heads)),
                (f"blk.{i}.attn_v.weight", array(v)),
                (f"blk.{i}.attn_output.weight", array(attn.o_proj.weight)),
                (f"blk.{i}.ffn_norm.weight", array(layer.post_attention_layernorm.weight)),
                (f"blk.{i}.ffn_gate.weight", array(mlp.gate_proj.weight)),
                (f"blk.{i}.ffn_up.weight", array(mlp.up_proj.weight)),
                (f"blk.{i}.ffn_down.weight", array(mlp.down_proj.weight))]
    out.append(("output_norm.weight", array(model.norm.weight)))
    if not config.tie_embeddings:
        out.append(("output.weight", array(model.lm_head.weight)))
    return out


def write_gguf(model, path: str | Path, weight_type: str = "F32") -> Path:
    """Writes model's float weights as a llama-architecture GGUF file; returns its path. Chapter 08.

    weight_type applies to the 2-D matrices (norms stay F32, as llama.cpp keeps them).
    """
    import gguf

    if weight_type not in GGUF_TYPES:
        raise ValueError(f"weight_type={weight_type!r} is not one of {GGUF_TYPES}")
    if any(type(m).__name__ in ("QuantizedLinear", "FusedAttention", "FusedMLP") for m in model.modules()):
        raise ValueError("write_gguf reads a float, unfused model: write the GGUF before quantize() or "
                         "fuse_projections(), and let llama.cpp quantize with weight_type='Q8_0' or 'Q4_0'")
    config = model.config
    qtype = getattr(gguf.GGMLQuantizationType, weight_type)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("llminfer random weights")
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.dim)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.hidden_dim)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                 "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[weight_type]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # a placeholder vocabulary: llama.cpp needs one, the benchmark feeds token ids directly
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>".encode() for i in range(config.vocab_size)])
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_types([gguf.TokenType.NORMAL] * config.vocab_size)
    bos = config.bos_token_id if config.bos_token_id is not None else 0
    eos = config.eos_token_id if config.eos_token_id is not None else 0
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    for name, data in _tensors(model):
        kind = qtype if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        if kind in (gguf.GGMLQuantizationType.F32,):
            writer.add_tensor(name, data.astype(np.float32))
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python can be imported here (the optional peer). Chapter 08."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def load_llama_cpp(path: str | Path, n_ctx: int, threads: int, logits_all: bool = False, extra_buffers: bool = True):
    """A llama_cpp.Llama on the GGUF file, batch size n_ctx, `threads` threads for prompt and decode; extra_buffers
    lets it keep weights in its extra buffer types (the repacked Q4_0/Q8_0 layouts; `bench.llama_peer` says when
    they must stay off); logits_all keeps every position's logits (`llm.scores`), not only the last. The
    benchmarks run it in a process of its own (`bench.llama_peer.LlamaCppProcess`)."""
    import llama_cpp
    import llama_cpp.llama as wrapper

    defaults = wrapper.llama_cpp.llama_model_default_params

    def params():                   # the wrapper takes its model parameters from this function and has no switch
        found = defaults()
        found.use_extra_bufts = extra_buffers
        return found

    wrapper.llama_cpp.llama_model_default_params = params
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                               n_threads_batch=threads, verbose=False, logits_all=logits_all)
    finally:
        wrapper.llama_cpp.llama_model_default_params = defaults


def llama_cpp_generate(llm, ids: list[int], new_tokens: int) -> GenerationResult:
    """Greedy decoding of new_tokens after ids with llama.cpp, timed per token. Chapter 08."""
    llm.reset()
    stamps = []
    start = time.perf_counter()
    llm.eval(ids)                                             # the prefill
    made = []
    for step in range(new_tokens):
        token = int(_last_logits(llm).argmax())
        made.append(token)
        stamps.append(time.perf_counter())
        if step + 1 < new_tokens:
            llm.eval([token])                                 # one decode step
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return GenerationResult(made, stamps[0] - start, itl, stamps[-1] - start, len(ids))


def _last_logits(llm) -> np.ndarray:
    """A view of the logits (vocab,) of the last token llama.cpp evaluated."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def first_logits(llm, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits (vocab,) after a forward over ids: for checking it runs the same model."""
    llm.reset()
    llm.eval(ids)
    return torch.from_numpy(_last_logits(llm).copy())
