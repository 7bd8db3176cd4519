"""Checked claims: the sentence, its figure and a mark, printed by the cell that measured it."""
import pytest

from llminfer.claims import ClaimFailed, claim


def test_a_claim_that_holds_prints_a_tick_with_its_figure(capsys):
    verdict = claim("the cache is faster at 512 tokens", 3.1 > 1, "3.10×")
    assert bool(verdict) is True and verdict.figure == "3.10×"
    assert capsys.readouterr().out == "✓ the cache is faster at 512 tokens (3.10×)\n"


def test_a_strict_claim_that_fails_stops_the_cell_and_names_the_figure(capsys):
    with pytest.raises(ClaimFailed, match=r"the bubble shrinks as micro-batches grow \(0\.59 at m=8 against 0\.52"):
        claim("the bubble shrinks as micro-batches grow", 0.59 < 0.52, "0.59 at m=8 against 0.52 at m=1")
    assert capsys.readouterr().out.startswith("✗ the bubble shrinks")
    assert isinstance(ClaimFailed("x"), AssertionError), "nbval and plain asserts treat it as a failed check"


def test_a_machine_dependent_claim_says_which_case_this_machine_is_in(capsys):
    assert bool(claim("bfloat16 matmul outruns float32", False, "0.52×", strict=False)) is False
    assert capsys.readouterr().out == "✗ bfloat16 matmul outruns float32 (0.52×) — not on this machine\n"


@pytest.mark.parametrize("text, figure, error", [("", "", ValueError), ("   ", "", ValueError),
                                                 ("x is fast", 3.0, TypeError)])
def test_a_claim_without_a_sentence_or_with_an_unformatted_figure_is_refused(text, figure, error):
    with pytest.raises(error):
        claim(text, True, figure)


def test_a_claim_as_a_cells_last_value_shows_nothing_more_in_a_notebook(tmp_path):
    from nbformat.v4 import new_code_cell, new_notebook

    from llminfer import notebooks
    nb = new_notebook(cells=[new_code_cell("from llminfer.claims import claim\nclaim('one is less than two', 1 < 2, '1 < 2')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    outputs = notebooks.execute(nb, cwd=tmp_path, timeout=60).cells[0].outputs
    assert [(o.output_type, o.get("text")) for o in outputs] == [("stream", "✓ one is less than two (1 < 2)\n")]
