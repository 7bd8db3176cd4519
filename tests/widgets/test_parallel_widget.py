"""Chapter 10's widget: the projection against the cost model, bad layouts shown in the widget, and Run
running the real 2-process TP and PP here."""
from __future__ import annotations

import re

import pytest

from llminfer.parallel import cost_model
from llminfer.widgets import parallel as widget


def test_projection_is_the_cost_model():
    shape = cost_model.SHAPES["llama-3-70b"]
    link, gpu = cost_model.LINKS["nvlink4"], cost_model.ACCELERATORS["h100-sxm"]
    projection = widget.project(shape, 8, 1, link, gpu, batch_size=4, context_len=8192, dtype_bytes=2)
    memory = cost_model.device_memory(shape, 8, 1, 8192, 4, 2)
    assert (projection.weight_bytes, projection.kv_bytes) == (memory.weight_bytes, memory.kv_bytes)
    assert projection.tp_bytes_per_token == 2 * 80 * 8192 * 4 * 2 and projection.pp_bytes_per_token == 0
    assert projection.step == cost_model.predict_decode_step(shape, 8, 1, gpu, link, link, 8, 4, 8192, 2)
    with pytest.raises(ValueError, match="not divisible by 3"):
        widget.project(shape, 3, 1, link, gpu)


def test_widget_driven_by_value():
    box = widget.build_parallel_widget(default="llama-3-70b")
    box.tp_pick.value, box.pp_pick.value, box.batch.value, box.context.value = 8, 1, 1, 8192
    assert "fits" in box.projection_view.value and box.state.fits
    one_gpu = box.state
    box.tp_pick.value = 1
    assert "does NOT fit" in box.projection_view.value                   # 141 GB of bf16 weights on one GPU
    box.dtype_pick.value = "fp8"
    assert box.state.weight_bytes == pytest.approx(one_gpu.weight_bytes * 8 / 2, rel=1e-3)   # TP 8 → 1, 2 B → 1 B
    box.shape_pick.value = "qwen2.5-0.5b"                                # 14 heads, 2 K/V heads
    box.tp_pick.value = 4
    assert box.state is None and "not divisible by 4" in box.projection_view.value
    assert box.context.max == cost_model.SHAPES["qwen2.5-0.5b"].max_seq_len
    for css in ("shape", "tp", "pp", "link", "gpu", "batch", "context", "dtype", "projection", "run", "result"):
        assert any(f"llminfer-parallel-{css}" in w._dom_classes for w in _all(box)), css


def _all(widget_box):
    found = [widget_box]
    for child in getattr(widget_box, "children", ()):
        found += _all(child)
    return found


def test_run_shows_measured_beside_predicted():
    link = cost_model.AlphaBeta(100e-6, 1e9).as_link()
    box = widget.build_parallel_widget(measured_link=link, repeats=3)
    assert box.link_pick.options[-1] == widget.MACHINE
    box.mode_pick.value = "tp"
    box.run_button.click()
    result = box.measurement
    assert result is not None, box.result_view.value
    assert result["measured_s"] > 0 and result["single_s"] > 0 and result["collectives"] == 10   # 2 × 4 layers + 2
    # one decode step: 9 all-reduces of one float32 row of dim 128, and an all-gather of 512 logits per rank
    payloads = [128 * 4] * 9 + [1024 // 2 * 4]
    assert result["predicted_comm_s"] == pytest.approx(sum(link.alpha_s + n / link.bytes_per_s for n in payloads))
    numbers = re.findall(r"measured ([\d.e+-]+) ms.*predicted ([\d.e+-]+) ms", box.result_view.value)
    assert numbers, box.result_view.value
    box.mode_pick.value = "pp"
    box.run_button.click()
    assert set(box.measurement["runs"]) == {1, 4}
    assert "bubble measured" in box.result_view.value and "ideal 0.50" in box.result_view.value


def test_a_failed_run_is_shown_not_raised():
    class Broken:
        def run_tensor_parallel(self, *args, **kwargs):
            raise RuntimeError("no processes today")

    box = widget.build_parallel_widget(measured_link=cost_model.LINKS["pcie5"], runner=Broken())
    box.run_button.click()
    assert box.measurement is None and "no processes today" in box.result_view.value
