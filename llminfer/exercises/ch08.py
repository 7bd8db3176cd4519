"""Chapter 08's exercises: bytes per weight of llama.cpp's block formats, Q4_0 by hand, SmolLM2's file read per token."""
from __future__ import annotations

import numpy as np

from . import as_number, as_numbers, close, exercise, not_a, run_code

FORMATS = ("Q4_0", "Q4_1", "Q8_0")                            # 08.1


def _bytes_per_weight(name: str) -> float:
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    return size / block


@exercise("08.1", "bytes per weight of Q4_0, Q4_1 and Q8_0 (blocks of 32 with fp16 scales)")
def bytes_per_weight(answer):
    numbers = as_numbers(answer, 3)
    if numbers is None:
        return not_a("three numbers (Q4_0, Q4_1, Q8_0 bytes per weight)", answer)
    want = [_bytes_per_weight(name) for name in FORMATS]
    if all(close(n, 8 * w) for n, w in zip(numbers, want)):
        return False, "those are bits per weight; the question asks for bytes (divide by 8)"
    if [close(n, b) for n, b in zip(numbers, (0.5, 0.5, 1.0))] == [True] * 3:
        return False, "the codes alone: each block of 32 also stores its fp16 scale (2 bytes), and Q4_1 its minimum"
    for name, n, w in zip(FORMATS, numbers, want):
        if close(n, want[0]) and name == "Q4_1":
            return False, "Q4_1 stores a minimum beside the scale (fp16, 2 more bytes per 32): it is not Q4_0's size"
        if not close(n, w):
            return False, f"{name}: {n:g} bytes per weight; count one block of 32: its codes, then its fp16 fields"
    return True, ", ".join(f"{name} {w:g} B ({8 * w:g} bits)" for name, w in zip(FORMATS, want)) + \
        " per weight, as gguf's block sizes say"


def _test_blocks() -> np.ndarray:
    generator = np.random.default_rng(0)
    blocks = generator.normal(0, 0.05, (6, 32)).astype(np.float32)
    blocks[1, 7] = -0.4                                        # the largest magnitude is negative
    blocks[2, 30] = 0.3                                        # ... and positive
    blocks[3] = 0.0                                            # all zero: scale 0
    return blocks


@exercise("08.2", "a block of 32 weights quantized to Q4_0 by hand, against llama.cpp's own quantizer")
def q4_0_block(answer):
    import gguf
    if not callable(answer):
        return not_a("a function q4_0(block) -> (scale, codes) for a block of 32 float32 weights", answer)
    blocks = _test_blocks()
    stored = gguf.quants.quantize(blocks, gguf.GGMLQuantizationType.Q4_0)      # (6, 18) bytes
    for i, block in enumerate(blocks):
        want_scale = float(stored[i, :2].view(np.float16)[0])
        packed = stored[i, 2:]
        want_codes = np.concatenate([packed & 0x0F, packed >> 4]).tolist()     # low nibbles 0..15, high 16..31
        result, error = run_code(answer, block.copy())
        if error:
            return False, error
        if not (isinstance(result, tuple) and len(result) == 2):
            return not_a("a pair (scale, codes)", result)
        scale, codes = as_number(result[0]), as_numbers(result[1], 32)
        if scale is None or codes is None:
            return not_a("a number and 32 codes", result)
        if want_scale and float(np.float16(scale)) == -want_scale:
            return False, ("the scale has the wrong sign: Q4_0 divides by the signed largest value, d = max / −8, so "
                           "that value lands on code 0 (section 4, after the drawn Q4_1 block)")
        if not close(float(np.float16(scale)), want_scale, rel=1e-3, abs_=1e-12):
            return False, (f"block {i}: scale {scale:g}, llama.cpp stores {want_scale:g}: take the weight of largest "
                           "magnitude, with its sign, and divide it by −8")
        if [int(c) for c in codes] != want_codes:
            if [int(c) + 8 for c in codes] == want_codes or min(codes) < 0:
                return False, "the codes are stored unsigned, 0..15: add 8 to the signed value x / d"
            return False, (f"block {i}: codes {[int(c) for c in codes][:8]}..., llama.cpp's {want_codes[:8]}...: "
                           "code = min(15, trunc(x / d + 8.5)), rounding to the nearest level")
    return True, f"{len(blocks)} blocks (a negative and a positive extreme, an all-zero one) match gguf's Q4_0 bytes"


def _file_bytes() -> tuple[int, int]:
    from ..bench.decode_real import file_bytes_by_type
    from ..gguf_reader import installed_gguf, read_header
    path = installed_gguf("smollm2-135m-instruct")
    values = sum(int(np.prod(t.shape)) for t in read_header(path).tensors.values())
    return values, sum(file_bytes_by_type(path).values())


@exercise("08.3", "the speed-up of SmolLM2's stored file over bfloat16, from bytes alone")
def bytes_speedup(answer):
    ratio = as_number(answer)
    if ratio is None:
        return not_a("a number (times faster than bfloat16)", answer)
    values, stored = _file_bytes()
    want = 2 * values / stored
    if close(ratio, 4 * values / stored, rel=0.01):
        return False, "that is against float32 (4 bytes per weight); bfloat16 has 2"
    if close(ratio, 2 / _bytes_per_weight("Q4_1"), rel=0.01) or close(ratio, 2 / _bytes_per_weight("Q4_0"), rel=0.01):
        return False, ("not every tensor is Q4_1: read the file's header, section 4's table: Q8_0 and F32 tensors "
                       "weigh in too")
    if not close(ratio, want, rel=0.01):
        return False, (f"{ratio:.2f}×: decode reads every weight once per token, so the ratio is bfloat16's bytes "
                       f"(2 per value) over the file's (section 1)")
    return True, (f"{2 * values / 1e6:.0f} MB as bfloat16 against {stored / 1e6:.0f} MB stored: {want:.2f}× fewer "
                  "bytes, the most a memory-bound decode can gain")
