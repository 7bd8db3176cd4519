"""Quantization: weight-only int8/int4 as a module transform, quantized checkpoints, an int8 KV cache. Chapter 08.

    model = llminfer.quant.quantize(model, "int4", group_size=32)   # nn.Linear -> QuantizedLinear, in place
    llminfer.quant.save_pretrained(model, "folder")                  # codes + scales in safetensors
    model, tokenizer = llminfer.quant.load_pretrained("folder")
    model, tokenizer = llminfer.load_pretrained("x.gguf", transform=llminfer.quant.keep_quantized())  # Q4_1 as stored
    cache = llminfer.quant.Int8KVCache.for_model(model)              # K per channel, V per token
"""
from .checkpoint import KeepQuantized, keep_quantized, load_pretrained, save_pretrained
from .kv_cache import Int8KVCache, int8_roundtrip
from .linear import KERNELS, SCHEMES, QuantizedLinear, has_kernel, quantize, quantized_modules, quantized_weight_bytes
from .weights import QuantizedTensor, dequantize, qrange, quantize_tensor

__all__ = ["quantize", "QuantizedLinear", "has_kernel", "quantized_modules", "quantized_weight_bytes", "SCHEMES",
           "KERNELS", "QuantizedTensor", "quantize_tensor", "dequantize", "qrange", "save_pretrained",
           "load_pretrained", "keep_quantized", "KeepQuantized", "Int8KVCache", "int8_roundtrip"]
