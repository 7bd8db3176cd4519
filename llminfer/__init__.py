"""llminfer: the code behind an executable handbook of LLM inference.

    model, tokenizer = llminfer.load_pretrained("tiny-capitals")
    ids = tokenizer.encode("The capital of France")
    result = llminfer.generate(model, ids, max_new_tokens=8, eos_token_id=tokenizer.eos_token_id)
    tokenizer.decode(result.token_ids), result.ttft_s, result.itl_s, result.tpot_s
"""
from . import attention, instrument
from .checkpoint import bundled_models, load_pretrained, load_random, save_pretrained
from .device import resolve_device
from .config import PRESET_SOURCES, PRESETS, ModelConfig, get_preset
from .generate import GenerationResult, TokenTimer, decode_step, generate, prefill, sample_next
from .costs import kv_cache_bytes
from .kv_cache import Cache, KVCache
from .model import Transformer
from .device import free_memory_bytes
from .tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "attention", "instrument", "Cache", "TokenTimer", "ModelConfig", "PRESETS", "PRESET_SOURCES", "get_preset", "Transformer", "KVCache",
    "kv_cache_bytes", "prefill", "decode_step", "generate", "sample_next", "GenerationResult", "Tokenizer",
    "load_pretrained", "save_pretrained", "load_random", "resolve_device", "bundled_models", "free_memory_bytes",
]
