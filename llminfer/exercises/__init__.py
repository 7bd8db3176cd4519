"""The chapters' exercises, checked: `check("03.1", answer)` says whether an answer is right, and if not, why not.

Every chapter ends with a few exercises; each has an id ("03.1" is chapter 03's first), a worked solution in
chapters/solutions/, and a checker registered here by the chapter's module (ch01.py, ch02.py, ...). A checker
never raises for a wrong answer: it returns a false `Verdict` whose text says what is wrong and where in the
chapter to look. Where an answer depends on the reader's machine (a measured time, a fitted line), the checker
takes the chapter's own measurements as keyword arguments and judges the answer against them, never against a
number recorded somewhere else.

    from llminfer.exercises import check
    check("01.1", (15.0, 600.0))   # ✗ 01.1: E2E 600 ms counts one gap too many: 32 tokens have 31 gaps ...
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Verdict", "check", "exercise", "exercises", "CHAPTERS"]

# The chapters that have exercises, by number (A1: the appendix); each has a module chNN.py that registers its
# checkers.
CHAPTERS = ("01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12", "13", "14", "A1")

_CHECKERS: dict[str, tuple[str, Callable]] = {}    # id -> (one-line title, checker)


@dataclass(frozen=True)
class Verdict:
    """A checker's answer: true when the answer is right; its text explains either way. Prints as ✓ or ✗."""

    exercise: str
    ok: bool
    text: str
    answer: Any = field(default=None, repr=False, compare=False)          # what was judged
    context: dict = field(default_factory=dict, repr=False, compare=False)  # the measurements it was judged against

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"{'✓' if self.ok else '✗'} {self.exercise}: {self.text}"

    __str__ = __repr__


def exercise(exercise_id: str, title: str):
    """Registers a checker under an id: the checker takes (answer, **context) and returns (ok, explanation)."""
    def register(checker: Callable) -> Callable:
        if exercise_id in _CHECKERS:
            raise ValueError(f"exercise {exercise_id} is registered twice")
        _CHECKERS[exercise_id] = (title, checker)
        return checker
    return register


def _load(chapter: str | None = None) -> None:
    for number in CHAPTERS if chapter is None else (chapter,):
        importlib.import_module(f"{__name__}.ch{number}")


def exercises(chapter: str | None = None) -> dict[str, str]:
    """Returns {id: title} of every exercise, or of one chapter's ("03")."""
    if chapter is not None and chapter not in CHAPTERS:
        raise ValueError(f"chapter {chapter!r} has no exercises; chapters with exercises: {', '.join(CHAPTERS)}")
    _load(chapter)
    return {key: title for key, (title, _) in sorted(_CHECKERS.items())
            if chapter is None or key.split(".")[0] == chapter}


def check(exercise_id: str, answer: Any, **context) -> Verdict:
    """Judges an answer to one exercise; the Verdict is true if it is right and explains itself either way."""
    chapter = str(exercise_id).split(".")[0]
    if chapter not in CHAPTERS:
        raise ValueError(f"no exercise {exercise_id!r}: ids look like '03.1' (chapter 03, exercise 1); chapters "
                         f"with exercises: {', '.join(CHAPTERS)}")
    _load(chapter)
    if exercise_id not in _CHECKERS:
        raise ValueError(f"no exercise {exercise_id!r}; chapter {chapter} has {', '.join(exercises(chapter))}")
    ok, text = _CHECKERS[exercise_id][1](answer, **context)
    return Verdict(exercise_id, bool(ok), text, answer, dict(context))


# --- helpers the chapters' checkers share ----------------------------------------------------------------------

def as_number(value) -> float | None:
    """Returns value as a float (ints, floats, numpy and one-element torch values), or None if it is not one."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return number if math.isfinite(number) else None


def as_numbers(value, count: int) -> list[float] | None:
    """Returns value as a list of count floats (a tuple, list, array or tensor), or None if it is not that."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or len(value) != count:
        return None
    numbers = [as_number(v) for v in value]
    return None if any(n is None for n in numbers) else numbers


def as_whole(value) -> int | None:
    """Returns value as an int if it is a whole number (5, 5.0, a tensor holding 5), else None."""
    number = as_number(value)
    return int(number) if number is not None and number == int(number) else None


def as_wholes(value, count: int) -> list[int] | None:
    """Returns value as a list of count ints, or None if it is not count whole numbers."""
    numbers = as_numbers(value, count)
    return None if numbers is None or any(n != int(n) for n in numbers) else [int(n) for n in numbers]


def run_code(function: Callable, *args) -> tuple[Any, str | None]:
    """Runs the reader's function: (its result, None), or (None, what it raised), never raising itself."""
    try:
        return function(*args), None
    except Exception as error:
        return None, f"your function raised {type(error).__name__}: {error}"


def close(value: float, expected: float, rel: float = 1e-3, abs_: float = 1e-9) -> bool:
    """True when value is expected to within rel (relative) or abs_ (absolute)."""
    return math.isclose(value, expected, rel_tol=rel, abs_tol=abs_)


def not_a(kind: str, answer) -> tuple[bool, str]:
    """The verdict on an answer of the wrong shape: what was expected, what came."""
    shown = repr(answer)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return False, f"expected {kind}, got {shown} ({type(answer).__name__})"
