"""The exercises: each solution notebook's answers pass their checkers, and a plausible wrong answer to each is
refused with a reason.

The solutions are the notebooks in chapters/solutions/, which `make test-notebooks` also runs under nbval. Here
each notebook's code cells run in this process, in order, as a kernel would run them, and every `check(...)` a cell
ends on is collected (a kernel would display it). Its `Verdict` carries the answer and the measurements it was
judged with, so each wrong answer below is judged on the same machine's numbers. The solution code is written
once, in the notebook the reader opens, and tested from there.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import nbformat
import pytest
import torch

from llminfer.exercises import CHAPTERS, Verdict, check, ch04, exercises

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "chapters" / "solutions"


def chapter_notebook(chapter: str) -> Path:
    (path,) = (ROOT / "chapters").glob(f"{chapter}_*.ipynb")
    return path


@functools.lru_cache(maxsize=None)
def solution_verdicts(chapter: str) -> dict[str, Verdict]:
    """Runs chapter's solution notebook here and returns {exercise id: the verdict a cell ended on}."""
    path = SOLUTIONS / f"{chapter_notebook(chapter).stem}_solutions.ipynb"
    namespace: dict = {"__name__": "__solutions__"}
    verdicts = {}
    for cell in nbformat.read(path, 4).cells:
        if cell.cell_type != "code":
            continue
        tree = ast.parse(cell.source)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, f"{path.name}", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), path.name, "eval"), namespace)
            if isinstance(value, Verdict):
                verdicts[value.exercise] = value
    return verdicts


def _loop_past_eos(model, prompt_ids, max_new_tokens, eos_token_id):
    """01.3 wrong: the greedy loop that forgets to stop at end-of-sequence."""
    context, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        new.append(int(model(torch.tensor([context]))[0, -1].argmax()))
        context.append(new[-1])
    return new


def _update_without_rescaling_acc(m, l, acc, scores, v):
    """07.2 wrong: l is rescaled to the new max, acc is not."""
    m_new = torch.maximum(m, scores.amax(-1))
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * torch.exp(m - m_new) + p.sum(-1), acc + p @ v


def _mlp_shard_summing_before_silu(x, w_gate, w_up, w_down, rank, world_size):
    """10.4 wrong: the hidden units split across the input dimension instead, so SiLU sees partial sums."""
    dim = x.shape[1]
    cols = slice(rank * dim // world_size, (rank + 1) * dim // world_size)
    h = torch.nn.functional.silu(x[:, cols] @ w_gate[:, cols].T) * (x[:, cols] @ w_up[:, cols].T)
    return h @ w_down.T


def _truncating_one_too_many(cache_class):
    """04.4 wrong: truncate(length) keeps length - 1 positions."""
    class OffByOne(cache_class):
        def truncate(self, length):
            self.length = length - 1
    return OffByOne


def _step_admits_after_decodes(running, waiting, pool, budget, max_seqs):
    """05.3 wrong: the started prompts before the decodes, but new requests admitted only after the decodes."""
    scheduled = {}

    def run(request):
        nonlocal budget
        n = min(request.remaining, budget)
        need = -(-(request.computed + n) // 16) - request.blocks
        pool["free"], request.blocks = pool["free"] - need, request.blocks + need
        scheduled[request.id], budget = n, budget - n

    for request in [r for r in running if not r.decoding] + [r for r in running if r.decoding]:
        if budget > 0:
            run(request)
    while waiting and budget > 0 and len(running) < max_seqs:
        running.append(waiting.pop(0))
        run(running[-1])
    return scheduled, []


def _accept_every_agreeing_guess(target_logits, drafts):
    """09.3 wrong: counts every guess that agrees, not the agreeing prefix."""
    best = target_logits.argmax(dim=-1).tolist()
    n_accepted = sum(d == b for d, b in zip(drafts, best))
    return n_accepted, best[n_accepted]


# A plausible wrong answer to each exercise, made from the right one and the context it was judged with.
WRONG = {
    "01.1": lambda answer, ctx: (answer[0], answer[1] + answer[0]),            # one gap too many
    "01.2": lambda answer, ctx: (answer[0] - 1, answer[1]),                    # the EOS step not counted
    "01.3": lambda answer, ctx: _loop_past_eos,
    "01.4": lambda answer, ctx: ctx["ttft_ms"] + 48 * ctx["tpot_ms"],          # one gap too many
    "02.1": lambda answer, ctx: [0.0, 1.0, 1.0],                                # the scores, not their softmax
    "02.2": lambda answer, ctx: lambda x, n_groups: x.repeat(1, n_groups, 1, 1),  # heads interleaved
    "02.3": lambda answer, ctx: answer * 3,                                     # every query head counted
    "03.1": lambda answer, ctx: 20 * 19 // 2,                                   # the prompt's re-runs forgotten
    "03.2": lambda answer, ctx: 50,                                             # N / 2
    "03.3": lambda answer, ctx: answer // 2,                                    # one FLOP per weight
    "04.1": lambda answer, ctx: answer * 7,                                     # all 28 query heads, not 4 K/V heads
    "04.2": lambda answer, ctx: 24 * 2**30 // (512 * 2**20),                    # the weights left out of the 24 GiB
    "04.3": lambda answer, ctx: ch04.flop_crossing(ctx["config"]),              # where the FLOP ratio reaches 10
    "04.4": lambda answer, ctx: _truncating_one_too_many(answer),
    "05.1": lambda answer, ctx: (64, answer[1]),                                # the decodes' tokens forgotten
    "05.2": lambda answer, ctx: (answer[0], answer[0]),                         # continuous as long as static
    "05.3": lambda answer, ctx: _step_admits_after_decodes,
    "06.1": lambda answer, ctx: (5, answer[1]),                                 # the lengths pooled, not per sequence
    "06.2": lambda answer, ctx: (answer[0], [0, 1]),                            # freed blocks reused first
    "06.3": lambda answer, ctx: lambda q, k, v, tables, lengths: answer(q, k, v, tables,   # whole last blocks
                                                                        [len(t) * k.shape[1] for t in tables]),
    "06.4": lambda answer, ctx: answer + 1,                                     # the mixed third block counted
    "07.1": lambda answer, ctx: (28, 36),                                       # the diagonal tiles left out
    "07.2": lambda answer, ctx: _update_without_rescaling_acc,
    "07.3": lambda answer, ctx: 4 * 1024 * 64 + 1024,                           # K and V read once only
    "08.1": lambda answer, ctx: (0.5, 0.5, 1.0),                                # the codes, not the scales
    "08.2": lambda answer, ctx: lambda block: (-answer(block)[0], answer(block)[1]),  # scale without its sign
    "08.3": lambda answer, ctx: answer * 2,                                     # against float32
    "09.1": lambda answer, ctx: answer - 0.8 ** 4,                              # the target's own token left out
    "09.2": lambda answer, ctx: answer * (0.4 + ctx["v"]) / 1.4,                # v = 1 assumed
    "09.3": lambda answer, ctx: _accept_every_agreeing_guess,
    "10.1": lambda answer, ctx: answer // 8,                                    # divided by the TP degree
    "10.2": lambda answer, ctx: 15 + 2**20 / 450e9 * 1e6,                       # no 2(p - 1)/p
    "10.3": lambda answer, ctx: 3 / 8,                                          # (p - 1) / m
    "10.4": lambda answer, ctx: _mlp_shard_summing_before_silu,
    "11.1": lambda answer, ctx: 8 / 4.0,                                        # throughput, not goodput
    "11.2": lambda answer, ctx: (answer[0], 180 / 5),                           # the first token in the TPOT
    "11.3": lambda answer, ctx: 3,                                              # stopped at the first dip
    "11.4": lambda answer, ctx: 100,                                            # one value beyond the p99
    "12.1": lambda answer, ctx: answer * 2,                                     # float32, not bfloat16
    "12.2": lambda answer, ctx: (answer[0] / 8, answer[1]),                     # 100 GB/s, not 100 Gb/s
    "12.3": lambda answer, ctx: answer * 4,                                     # the whole K/V over one link
    "13.1": lambda answer, ctx: 2,                                              # the first characters only
    "13.2": lambda answer, ctx: answer - 1,                                     # stopped short of p
    "13.3": lambda answer, ctx: 3,                                              # tokens matched, not whole blocks
    "14.1": lambda answer, ctx: (answer[0], [0.5, 0.5]),                        # weights not a softmax of the two
    "14.2": lambda answer, ctx: 2 * 4,                                          # k · B, repeats counted twice
    "14.3": lambda answer, ctx: answer // 2,                                    # one power of two too soon
    "14.4": lambda answer, ctx: answer * 58,                                    # one layer taken for every layer
    "A1.1": lambda answer, ctx: (0.5, 1.0),                                     # the codes without their terms
    "A1.2": lambda answer, ctx: lambda tiles, n, k: answer(tiles, n, k ^ 1),    # the two nibbles of a byte swapped
    "A1.3": lambda answer, ctx: max(ctx["int8_bytes"] / ctx["int4_bytes"],      # the larger limit, not the first
                                    ctx["int4_cached"] / ctx["int8_streamed"]),
}


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_exercise_is_in_its_chapter_and_solved(chapter):
    ids = set(exercises(chapter))
    assert len(ids) >= 3, f"chapter {chapter} has {len(ids)} exercises; the standard is 3 to 6"
    cells = nbformat.read(chapter_notebook(chapter), 4).cells
    heading = [i for i, c in enumerate(cells) if c.cell_type == "markdown" and c.source.startswith("## Exercises")]
    assert len(heading) == 1, f"chapter {chapter} needs one '## Exercises' cell"
    assert heading[0] == len(cells) - 1, "the chapter ends with its exercises: no cell after them"
    assert "llminfer.exercises import check" in cells[-2].source, "the checker is imported just before them"
    summary = [i for i, c in enumerate(cells) if re.search(r"^## (Summary|What this chapter showed)", c.source, re.M)]
    assert summary and summary[-1] < heading[0], "the summary comes before the exercises"
    exercises_cell = cells[heading[0]].source
    assert "## References" in exercises_cell, "the references close the exercises' cell"
    text = exercises_cell[: exercises_cell.index("## References")]
    assert set(re.findall(rf'check\("({chapter}\.\d+)"', text)) == ids, "the chapter shows each checker's call"
    assert set(solution_verdicts(chapter)) == ids, "the solution notebook answers every exercise"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_checkers_accept_the_solutions_and_explain_a_wrong_answer(chapter):
    for exercise_id, verdict in solution_verdicts(chapter).items():
        assert verdict, verdict
        wrong = check(exercise_id, WRONG[exercise_id](verdict.answer, verdict.context), **verdict.context)
        assert not wrong and len(wrong.text) > 20, wrong
        junk = check(exercise_id, "forty-two", **verdict.context)
        assert not junk and "expected" in junk.text, junk


def test_an_unknown_exercise_is_refused_by_name():
    with pytest.raises(ValueError, match="'99.1'"):
        check("99.1", 0)
    with pytest.raises(ValueError, match="01.9"):
        check("01.9", 0)
