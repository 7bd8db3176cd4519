"""The chapter 02 attention widget: the pure function against hand-worked numbers, then the widget driven by .value."""

import math

import pytest

from llminfer.widgets import attention as aw

E = math.e
TOL = 1e-6  # the package runs softmax in float32


def test_state_of_the_worked_example_matches_the_hand_computation():
    state = aw.attention_state(aw.EXAMPLE_QUERY)
    assert state.scores == (1.0, 1.0, 2.0)
    # softmax(1, 1, 2) = (e, e, e²) / (2e + e²) = (1, 1, e) / (2 + e)
    expected = (1 / (2 + E), 1 / (2 + E), E / (2 + E))
    assert state.weights == pytest.approx(expected, abs=TOL)
    # 1/(2+e)·[1,0] + 1/(2+e)·[0,2] + e/(2+e)·[3,1] = [(1 + 3e)/(2+e), 1]
    assert state.output == pytest.approx(((1 + 3 * E) / (2 + E), 1.0), abs=TOL)
    assert aw.format_row(state.tokens, state.weights) == "I 0.212 · love 0.212 · AI 0.576"
    assert aw.format_vector(state.output, 2) == "[1.94, 1.00]"


def test_scaled_state_uses_one_over_sqrt_d():
    state = aw.attention_state(aw.EXAMPLE_QUERY, scaled=True)
    assert state.scale == pytest.approx(1 / math.sqrt(2))
    c = math.exp(1 / math.sqrt(2))  # exp of the scaled score gap between AI and the others
    assert state.weights == pytest.approx((1 / (2 + c), 1 / (2 + c), c / (2 + c)), abs=TOL)
    assert aw.format_row(state.tokens, state.weights, 2) == "I 0.25 · love 0.25 · AI 0.50"


def test_bad_inputs_are_refused_with_the_shape_in_the_message():
    with pytest.raises(ValueError, match=r"keys has shape \(3, 3\)"):
        aw.attention_state((1.0, 1.0), keys=[[1, 0, 0]] * 3)
    with pytest.raises(ValueError, match="not finite"):
        aw.attention_state((float("nan"), 1.0))
    with pytest.raises(ValueError, match="2 tokens but 3 numbers"):
        aw.format_row(["a", "b"], [1, 2, 3])
    with pytest.raises(ValueError, match=r"outside \[-5.0, 5.0\]"):
        aw.attention_widget(query=(9.0, 1.0))


def test_widget_starts_on_the_example_and_shows_its_state():
    box = aw.attention_widget()
    assert box.state == aw.attention_state(aw.EXAMPLE_QUERY)
    assert box.weights_html.value == "I 0.212 · love 0.212 · AI 0.576"
    assert box.scores_html.value == "I 1.000 · love 1.000 · AI 2.000"
    assert box.output_html.value == "[1.940, 1.000]"
    assert box.chart.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert "llminfer-attn-weights" in box.weights_html._dom_classes
    assert "llminfer-attn-q0" in box.query_inputs[0]._dom_classes
    assert "llminfer-attn-q1" in box.query_inputs[1]._dom_classes


def test_editing_the_query_recomputes_everything():
    box = aw.attention_widget()
    chart_before = box.chart.value
    box.query_inputs[0].value = 2.0
    box.query_inputs[1].value = 0.0
    # scores 2, 0, 2 -> weights (e², 1, e²) / (2e² + 1)
    denom = 2 * E**2 + 1
    w_i, w_love, w_ai = E**2 / denom, 1 / denom, E**2 / denom
    assert box.state.query == (2.0, 0.0)
    assert box.state.scores == (2.0, 0.0, 2.0)
    assert box.state.weights == pytest.approx((w_i, w_love, w_ai), abs=TOL)
    assert box.state.output == pytest.approx((w_i + 3 * w_ai, 2 * w_love + w_ai), abs=TOL)
    assert box.weights_html.value == aw.format_row(("I", "love", "AI"), (w_i, w_love, w_ai))
    assert box.chart.value != chart_before


def test_editing_a_key_and_the_scale_recomputes_everything():
    box = aw.attention_widget()
    box.key_inputs[1][0].value = 2.0
    box.key_inputs[1][1].value = 2.0  # love's key becomes [2, 2]: scores 1, 4, 2
    assert box.state.keys[1] == (2.0, 2.0)
    assert box.state.scores == (1.0, 4.0, 2.0)
    denom = E + E**4 + E**2
    assert box.state.weights == pytest.approx((E / denom, E**4 / denom, E**2 / denom), abs=TOL)
    box.scaled_box.value = True
    s = 1 / math.sqrt(2)
    denom = math.exp(s) + math.exp(4 * s) + math.exp(2 * s)
    assert box.state.scale == pytest.approx(s)
    assert box.state.weights[1] == pytest.approx(math.exp(4 * s) / denom, abs=TOL)
    assert box.scores_html.value == aw.format_row(("I", "love", "AI"), (s, 4 * s, 2 * s))


def test_inputs_are_bounded():
    box = aw.attention_widget()
    box.query_inputs[0].value = 100.0
    assert box.query_inputs[0].value == aw.INPUT_BOUND
    assert box.state.query[0] == aw.INPUT_BOUND


def test_a_nan_typed_into_a_box_gets_a_message_and_the_widget_recovers():
    box = aw.attention_widget()
    good = box.state
    box.query_inputs[0].value = float("nan")
    assert "not finite" in box.message.value and box.state == good     # last good result kept
    box.query_inputs[0].value = 0.5
    assert box.message.value == "" and box.state.query[0] == 0.5
