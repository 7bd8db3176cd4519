"""The chapter 13 figure of the sampling pipeline's stages: the table it draws by hand, and the figure's panels."""
from __future__ import annotations

import math

import pytest
import torch

from llminfer.sampling import STAGES, SamplerSettings, stages
from llminfer.widgets.sampling import stage_table, stages_figure


def test_the_table_by_hand():
    logits = torch.tensor([math.log(x) for x in (0.5, 0.3, 0.15, 0.05)])
    probs = stages(logits, SamplerSettings(temperature=1.0, top_k=2))
    table = stage_table(probs, top_n=3)
    assert table.token_ids == (0, 1, 2)                                  # the model's order
    assert table.probs["model"] == pytest.approx((0.5, 0.3, 0.15))
    assert table.probs["top-k"] == pytest.approx((0.625, 0.375, 0.0))   # 0.5 and 0.3, renormalised
    assert table.left == {name: 4 for name in STAGES[:6]} | {"top-k": 2, "top-p": 2, "min-p": 2}
    with pytest.raises(ValueError, match="top_n must be at least 1"):
        stage_table(probs, top_n=0)


def test_a_token_a_stage_promotes_is_shown():
    """A token outside the model's top n that a stage makes likely (a penalty on the others) is shown too."""
    probs = {"model": torch.tensor([0.6, 0.3, 0.1, 0.0]), "later": torch.tensor([0.0, 0.1, 0.1, 0.8])}
    assert stage_table(probs, top_n=3).token_ids == (0, 1, 3)


def test_the_figure_has_a_panel_per_stage():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 2
    probs = stages(logits, SamplerSettings(temperature=0.7, top_k=10, top_p=0.8, min_p=0.1))
    fig = stages_figure(probs, top_n=6)
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title().split("\n")[0] for ax in shown] == list(STAGES)
    left = stage_table(probs, top_n=6).left
    assert all(ax.get_title().endswith(f"{left[name]:,} token{'s' * (left[name] != 1)} left")
               for ax, name in zip(shown, STAGES))
    heights = [bar.get_height() for bar in shown[-1].patches]
    assert heights == pytest.approx(stage_table(probs, top_n=6).probs["min-p"])


def test_the_widget_redraws_what_the_sliders_leave():
    from llminfer.widgets.sampling import build_sampling_widget

    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])        # probabilities at T = 1: .64 .24 .09 .03 ...
    box = build_sampling_widget(logits, settings=SamplerSettings(temperature=1.0, top_k=3))
    controls = {c._dom_classes[0].removeprefix("llminfer-sampling-"): c for c in box.children}
    assert "→ 3 tokens left · most likely 0 at 0.665" in controls["summary"].value     # e^4 / (e^4 + e^3 + e^2)
    first = controls["chart"].value
    controls["top-k"].value = 0                                   # off: all six
    assert "top-k off" in controls["summary"].value and "→ 6 tokens left" in controls["summary"].value
    controls["top-p"].value = 0.85                                # .64 + .24 = .88 reaches .85: two
    assert "→ 2 tokens left" in controls["summary"].value
    controls["min-p"].value = 0.4                                 # .24 / .64 < .4 after the nucleus: one
    assert "→ 1 token left · most likely 0 at 1.000" in controls["summary"].value
    assert controls["chart"].value != first and controls["chart"].value[:4] == b"\x89PNG"
