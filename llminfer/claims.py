"""Checked claims: a sentence about a measurement, printed with its figure and a ✓ or ✗ by the cell that measured it.

A chapter's prose explains; what a run measured is said here, next to the number, so prose cannot drift from its
outputs. `claim(text, holds, figure)` prints the line and, when strict, raises where the claim fails: use strict for
what must hold on any machine, and `strict=False` for what depends on the machine (it then says which case this
machine is in instead of stopping the chapter).
"""

from __future__ import annotations

from dataclasses import dataclass

MARK = {True: "✓", False: "✗"}


@dataclass(frozen=True)
class Claim:
    """One checked statement: its text, whether it held in this run, and the figure that decided it."""

    text: str
    holds: bool
    figure: str = ""
    strict: bool = True

    def line(self) -> str:
        """Return the printed form, e.g. '✓ the cache is faster at 512 tokens (3.1×)'."""
        figure = f" ({self.figure})" if self.figure else ""
        note = "" if self.holds or self.strict else " — not on this machine"
        return f"{MARK[self.holds]} {self.text}{figure}{note}"

    def __bool__(self) -> bool:
        return self.holds

    def _ipython_display_(self) -> None:
        """Shows nothing as a cell's last value: the claim has already printed its line."""


class ClaimFailed(AssertionError):
    """A strict claim that the run's own measurement contradicts."""


def claim(text: str, holds, figure: str = "", *, strict: bool = True) -> Claim:
    """Print a checked claim with its figure; return it (true where it holds). Raise ClaimFailed if strict and it fails."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a claim needs its sentence as a non-empty string, got {text!r}")
    if not isinstance(figure, str):
        raise TypeError(f"figure is printed as given: pass a formatted string such as f'{{ratio:.2f}}×', "
                        f"got {type(figure).__name__}")
    verdict = Claim(text, bool(holds), figure, strict)
    print(verdict.line())
    if strict and not verdict.holds:
        raise ClaimFailed(f"claim does not hold in this run: {text}" + (f" ({figure})" if figure else "")
                          + "; the measurement contradicts the sentence, so change the sentence, not the figure")
    return verdict


# the share of tokens a 16-bit run must keep (up to each sequence's first difference) to count as the same
HALF_PRECISION_AGREEMENT = 0.75


def tokens_agree(runs: list[list[int]], others: list[list[int]], dtype, min_share: float = HALF_PRECISION_AGREEMENT
                 ) -> tuple[bool, float]:
    """Whether two runs' token sequences agree as their dtype allows; returns (agree, share). Chapters 04 and 06.

    share is the fraction of all tokens that come before each sequence's first difference (a flipped token changes
    everything after it, so later tokens are not compared). In float32 every token must agree: two orders of the
    same sums differ far below any lead between tokens. In bfloat16 and float16 two paths (cached and recomputed,
    one batch and another) round differently by about as much as a near-tie's lead, so a flip now and then is
    rounding, not a bug: at least min_share of the tokens must agree.
    """
    import torch

    if len(runs) != len(others):
        raise ValueError(f"tokens_agree compares runs of the same requests: got {len(runs)} and {len(others)}")
    total = sum(max(len(a), len(b)) for a, b in zip(runs, others))
    kept = 0
    for a, b in zip(runs, others):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        kept += same
    share = kept / total if total else 1.0
    return (share == 1.0 if dtype == torch.float32 else share >= min_share), share
