"""Chapter 08's drawn block: one Q4_1 block made by llama.cpp's own quantizer (the gguf package), decoded as the
chapter decodes it, and drawn: the figure must show every byte and put every weight where gguf rebuilds it."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from llminfer.widgets.quantization import plot_q4_1_block  # noqa: E402

gguf = pytest.importorskip("gguf")


def one_block():
    weights = np.random.default_rng(0).normal(0, 0.05, (1, 32)).astype(np.float32)
    raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_1)[0]           # 20 bytes
    scale, minimum = raw[0:2].view(np.float16)[0], raw[2:4].view(np.float16)[0]
    codes = np.concatenate([raw[4:] & 0x0F, raw[4:] >> 4])
    return raw, float(scale), float(minimum), codes


def test_the_drawn_block_shows_every_byte_and_the_weights_gguf_rebuilds():
    raw, scale, minimum, codes = one_block()
    fig, axes = plt.subplots(2, 1)
    plot_q4_1_block(axes, raw, scale, minimum, codes)
    top, bottom = axes
    in_boxes = [t.get_text() for t in top.texts if t.get_position()[1] == 0.5]          # the text inside each box
    assert in_boxes == [f"{b:02x}" for b in raw] and len(top.patches) == 20
    nibbles = [int(t.get_text()) for t in top.texts if t.get_position()[1] < 0 and t.get_text().isdigit()]
    assert nibbles[0::2] == codes[:16].tolist() and nibbles[1::2] == codes[16:].tolist()   # low, high per byte
    drawn = np.concatenate([c.get_offsets()[:, 1] for c in bottom.collections])
    rebuilt = gguf.quants.dequantize(raw[None], gguf.GGMLQuantizationType.Q4_1)[0]
    np.testing.assert_allclose(drawn, rebuilt, rtol=0, atol=1e-7)
    levels = sorted(line.get_ydata()[0] for line in bottom.lines)
    np.testing.assert_allclose(levels, minimum + scale * np.arange(16), atol=1e-7)
    plt.close(fig)


def test_a_block_of_the_wrong_size_is_refused_before_drawing():
    raw, scale, minimum, codes = one_block()
    fig, axes = plt.subplots(2, 1)
    with pytest.raises(ValueError, match="20 bytes holding 32 codes"):
        plot_q4_1_block(axes, raw[:18], scale, minimum, codes)
    assert not axes[0].patches
    plt.close(fig)
