"""Appendix A1's exercises: the bytes a weight the kernels read, an int4 code found in its tile, int4's largest lead."""
from __future__ import annotations

import torch

from . import as_number, as_numbers, close, exercise, not_a, run_code

ROWS, INPUTS, GROUP = 64, 576, 32                 # A1.1: a (64 x 576) weight, int4 in groups of 32


def _bytes_a_weight(bits: int) -> float:
    """Bytes a weight of the tensors the kernels read for a QuantizedLinear of `bits` (int4 in groups of 32)."""
    from ..quant import QuantizedLinear
    linear = torch.nn.Linear(INPUTS, ROWS, bias=False)
    layer = QuantizedLinear.from_linear(linear, bits, GROUP) if bits == 4 else QuantizedLinear.from_linear(linear, 8)
    tensors = [layer.qweight, layer.kernel_scale] + ([layer.kernel_offset] if bits == 4 else [])
    return sum(t.numel() * t.element_size() for t in tensors) / (ROWS * INPUTS)


@exercise("A1.1", "bytes a weight the kernels read: int4 in groups of 32, int8 with a scale a row of 576")
def bytes_a_weight(answer):
    numbers = as_numbers(answer, 2)
    if numbers is None:
        return not_a("two numbers (int4 bytes a weight, int8 bytes a weight)", answer)
    int4, int8 = numbers
    want4, want8 = _bytes_a_weight(4), _bytes_a_weight(8)
    if close(int4, 0.5) or close(int8, 1.0, rel=1e-5):
        return False, ("the codes alone: int4 also reads a scale and an offset for every 32 weights, int8 one "
                       "float32 scale for every 576 (section 7 counts them)")
    if close(int4, 0.5 + 8 / GROUP):
        return False, "the int4 terms are float16 in the kernels' copy (2 bytes each, section 6), not float32"
    if close(int4, 8 * want4) or close(int8, 8 * want8):
        return False, "those are bits a weight; the question asks for bytes (divide by 8)"
    if not close(int4, want4, rel=1e-4):
        return False, f"int4: {int4:g}; a group of 32 is 16 bytes of codes and two 2-byte terms, over 32 weights"
    if not close(int8, want8, rel=1e-4):
        return False, f"int8: {int8:g}; a row is 576 one-byte codes and one 4-byte scale, over 576 weights"
    return True, (f"int4 {want4:.3f} and int8 {want8:.4f} bytes a weight, as the kernels' tensors hold them: "
                  f"int8 reads {want8 / want4:.2f}× the bytes of int4")


def _random_codes(rows: int = 24, inputs: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major int4 codes (rows, inputs) and their tiled copy, as native_cpu.tile_int4 lays them out."""
    from ..cpu import tile_int4
    generator = torch.Generator().manual_seed(0)
    nibbles = torch.randint(0, 256, (rows, inputs // 2), dtype=torch.uint8, generator=generator)
    codes = torch.stack([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(rows, inputs)   # even input: low nibble
    terms = torch.zeros(rows, inputs // GROUP, dtype=torch.float16)
    return codes, tile_int4(nibbles, terms, terms)[0]


@exercise("A1.2", "the int4 code of row n, input k, read from the tiled layout")
def code_in_tile(answer):
    if not callable(answer):
        return not_a("a function code_at(tiles, n, k) -> the int4 code (0..15)", answer)
    codes, tiles = _random_codes()
    rows, inputs = codes.shape
    got = torch.zeros_like(codes)
    for n in range(rows):
        for k in range(inputs):
            value, error = run_code(answer, tiles, n, k)
            if error:
                return False, error
            value = as_number(value)
            if value is None or value != int(value) or not 0 <= value <= 15:
                return False, f"code_at(tiles, {n}, {k}) returned {value!r}: a code is a whole number from 0 to 15"
            got[n, k] = int(value)
    if torch.equal(got, codes):
        return True, (f"all {rows * inputs} codes of a ({rows} x {inputs}) matrix: tile n // 8, chunk k // 8, "
                      "word n % 8, byte (k % 8) // 2, the low nibble for an even k")
    swapped = codes.reshape(rows, inputs // 2, 2).flip(-1).reshape(rows, inputs)
    if torch.equal(got, swapped):
        return False, "the nibbles are swapped: the even input is the low nibble of its byte (byte & 0xF)"
    if torch.equal(got[:8, :8], codes[:8, :8]):
        return False, ("right in the first tile's first chunk only: a tile holds K/8 chunks of 32 bytes, and tiles "
                       "of 8 rows follow each other (tiles has shape (N/8, K/8, 32))")
    wrong = int((got != codes).sum())
    return False, (f"{wrong} of {rows * inputs} codes differ: row n's 4 bytes for inputs 8c..8c+7 are bytes "
                   "4(n % 8)..4(n % 8)+3 of tiles[n // 8, c] (section 6)")


@exercise("A1.3", "the most int4 can lead int8 when both stream, from this machine's rates")
def int4_lead(answer, int4_cached=None, int8_streamed=None, int4_bytes=None, int8_bytes=None):
    lead = as_number(answer)
    if lead is None:
        return not_a("a number (int4's weights a second over int8's)", answer)
    measured = {"int4_cached": int4_cached, "int8_streamed": int8_streamed, "int4_bytes": int4_bytes,
                "int8_bytes": int8_bytes}
    bad = {name: value for name, value in measured.items() if (as_number(value) or 0) <= 0}
    if bad:
        raise ValueError(f"A1.3 judges the answer against section 7's measurements; got {bad}: pass each of "
                         f"{', '.join(measured)} as a positive number (rates in weights a second, bytes a weight)")
    by_bytes = as_number(int8_bytes) / as_number(int4_bytes)
    by_loop = as_number(int4_cached) / as_number(int8_streamed)
    want = min(by_bytes, by_loop)
    limit = "its loop" if by_loop < by_bytes else "memory (its bytes)"
    if close(lead, want, rel=0.01):
        return True, (f"min(bytes {by_bytes:.2f}×, loop {by_loop:.2f}×) = {want:.2f}×: {limit} sets the cap on "
                      "this machine")
    if close(lead, max(by_bytes, by_loop), rel=0.01):
        return False, (f"{lead:.2f}× is the larger of the two limits; int4 is held by whichever comes first, so the "
                       f"cap is the smaller, {limit} here")
    if close(lead, 1 / by_bytes, rel=0.01) or close(lead, 1 / by_loop, rel=0.01):
        return False, "upside down: int4 reads fewer bytes than int8, so by bytes it leads by int8's over int4's"
    return False, (f"{lead:.2f}×: the cap is the smaller of int8's bytes a weight over int4's ({by_bytes:.2f}×) "
                   f"and int4's rate in the caches over int8's streamed rate ({by_loop:.2f}×) (section 7)")
