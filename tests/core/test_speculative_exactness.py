"""Speculative sampling is exact: Monte-Carlo runs of the vectorised acceptance step reproduce the target's softmax.

The bound. With n draws from p, each count is binomial, so E|p̂_i − p_i| ≤ sqrt(p_i (1 − p_i) / n) and
E[TV(p̂, p)] ≤ ½ Σ_i sqrt(p_i (1 − p_i) / n). Changing one draw moves TV(p̂, p) by at most 1/n, so by
McDiarmid's inequality TV(p̂, p) exceeds that mean bound by more than sqrt(ln(1/δ) / (2n)) with probability
below δ. With δ = 1e-6 a correct rule fails these tests about once in a million runs (they are also seeded).
A frequency of n draws lies within sqrt(ln(2/δ) / (2n)) of its probability except with probability δ
(Hoeffding): the bound for the acceptance rate, whose probability is Σ min(p, q) = 1 − TV(p, q).
"""
from __future__ import annotations

import pytest
import torch

import llminfer
from llminfer import speculative as sp

torch.set_num_threads(1)

N_DRAWS = 200_000
DELTA = 1e-6
CONTEXT = "The capital of"          # many plausible next tokens: a wide p to compare with


@pytest.fixture(scope="module")
def distributions():
    """p of the target, q of the draft model and q of a one-layer early exit, at CONTEXT, temperature 1."""
    target, tokenizer = llminfer.load_pretrained("tiny-capitals", device="cpu")
    draft, _ = llminfer.load_pretrained("tiny-capitals-draft", device="cpu")
    early = sp.EarlyExitDrafter(target, 1).model
    ids = torch.tensor([tokenizer.encode(CONTEXT)])
    with torch.inference_mode():
        return {name: model(ids)[0, -1].softmax(-1) for name, model in
                (("target", target), ("draft model", draft), ("early exit", early))}


def histogram(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


@pytest.mark.parametrize("drafter", ["draft model", "early exit"])
def test_first_token_follows_the_target_and_acceptance_is_one_minus_tv(distributions, drafter):
    p, q = distributions["target"], distributions[drafter]
    generator = torch.Generator().manual_seed(1)
    tokens, accepted = sp.first_token_draws(p, q, N_DRAWS, generator)
    bound = sp.tv_bound(p, N_DRAWS, DELTA)
    tv = sp.tv_distance(histogram(tokens, p.numel()), p)
    assert tv < bound, f"TV(speculative, target) = {tv:.4f} >= bound {bound:.4f}"
    expected = 1 - sp.tv_distance(p, q)
    measured = float(accepted.double().mean())
    assert abs(measured - expected) < sp.proportion_bound(N_DRAWS, DELTA), (measured, expected)


@pytest.mark.parametrize("drafter", ["draft model", "early exit"])
def test_negative_control_accepting_every_guess_fails(distributions, drafter):
    """Accepting every guess gives q, not p; the same check must catch it, or it proves nothing."""
    p, q = distributions["target"], distributions[drafter]
    bound = sp.tv_bound(p, N_DRAWS, DELTA)
    assert sp.tv_distance(p, q) > 2 * bound            # the two differ by more than the test can resolve
    tokens, accepted = sp.first_token_draws(p, q, N_DRAWS, torch.Generator().manual_seed(1), accept_all=True)
    assert bool(accepted.all())
    assert sp.tv_distance(histogram(tokens, p.numel()), p) > bound          # the exactness check fails
    assert sp.tv_distance(histogram(tokens, p.numel()), q) < sp.tv_bound(q, N_DRAWS, DELTA)   # it samples q


def test_negative_control_resampling_from_p_instead_of_the_residual_fails(distributions):
    """The right acceptance test with the wrong correction (draw from p, not from max(p − q, 0)) is not exact."""
    p, q = distributions["target"], distributions["early exit"]
    generator = torch.Generator().manual_seed(2)
    guesses = torch.multinomial(q, N_DRAWS, replacement=True, generator=generator)
    stands = torch.rand(N_DRAWS, generator=generator) * q[guesses] < p[guesses]
    fallback = torch.multinomial(p, N_DRAWS, replacement=True, generator=generator)
    tokens = torch.where(stands, guesses, fallback)
    assert sp.tv_distance(histogram(tokens, p.numel()), p) > sp.tv_bound(p, N_DRAWS, DELTA)


def test_a_certain_drafter_prompt_lookup_style_is_exact(distributions):
    """A drafter that proposes one fixed token (q a point mass) keeps p too; it is accepted with probability p(x)."""
    p = distributions["target"]
    guess = int(p.argsort(descending=True)[3])          # a plausible token that is not the favourite
    generator = torch.Generator().manual_seed(3)
    guesses = torch.full((N_DRAWS, 1), guess)
    n_accepted, next_token = sp.acceptance_step(torch.stack([p, p])[None], guesses, None, generator)
    tokens = torch.where(n_accepted > 0, guesses[:, 0], next_token)
    assert sp.tv_distance(histogram(tokens, p.numel()), p) < sp.tv_bound(p, N_DRAWS, DELTA)
    assert abs(float((n_accepted > 0).double().mean()) - float(p[guess])) < sp.proportion_bound(N_DRAWS, DELTA)


def markov(vocab: int, seed: int, temperature: float) -> torch.Tensor:
    """A random transition matrix (vocab, vocab): row s is the next-token distribution after token s."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, vocab, generator=generator, dtype=torch.float64) / temperature).softmax(-1)


@pytest.mark.parametrize("certain", [False, True])
def test_two_tokens_jointly_follow_the_target_over_several_guesses(certain):
    """k = 3 guesses whose p depends on the guesses before them: the first two emitted tokens follow p jointly.

    Target and draft are Markov chains over 6 tokens. Each row drafts x1..x3 from the draft chain (or, when
    `certain`, takes its most likely token each time, as a deterministic drafter would), the target's p at each
    guessed position is its row for the previous token, and acceptance_step decides with a p per row. Rows
    that emit only one token take a second step from there, as the loop would.
    """
    vocab, k, start = 6, 3, 0
    P, Q = markov(vocab, 0, 1.0), markov(vocab, 1, 0.5)
    generator = torch.Generator().manual_seed(4)

    def step(previous: torch.Tensor):
        guesses, rows = [], previous
        for _ in range(k):
            rows = Q[rows].argmax(-1) if certain else torch.multinomial(Q[rows], 1, generator=generator)[:, 0]
            guesses.append(rows)
        guesses = torch.stack(guesses, dim=1)                                       # (N, k)
        before = torch.cat([previous[:, None], guesses], dim=1)                     # (N, k + 1)
        n, nxt = sp.acceptance_step(P[before], guesses, None if certain else Q[before[:, :k]], generator)
        return guesses, n, nxt

    previous = torch.full((N_DRAWS,), start)
    guesses, n, nxt = step(previous)
    first = torch.where(n > 0, guesses[:, 0], nxt)
    second = torch.where(n > 1, guesses[:, 1], torch.where(n == 1, nxt, -1))
    short = second < 0                                                               # only one token so far
    g2, n2, nxt2 = step(first[short])
    second[short] = torch.where(n2 > 0, g2[:, 0], nxt2)
    joint = P[start][:, None] * P                                                    # p(x1) p(x2 | x1)
    counts = torch.bincount(first * vocab + second, minlength=vocab * vocab).double() / N_DRAWS
    bound = sp.tv_bound(joint.flatten(), N_DRAWS, DELTA)
    assert sp.tv_distance(counts, joint.flatten()) < bound
    if not certain:
        wrong = Q[start][:, None] * Q                                                # what the draft alone gives
        assert sp.tv_distance(wrong.flatten(), joint.flatten()) > 3 * bound         # so the check has teeth
    assert bool(short.any()) and bool((n == k).any())                               # rejections and bonuses both ran


def test_tv_bound_holds_for_plain_multinomial_draws(distributions):
    """The bound itself, on draws straight from p: 20 independent runs stay under it."""
    p = distributions["target"]
    generator = torch.Generator().manual_seed(5)
    bound = sp.tv_bound(p, 20_000, DELTA)
    for _ in range(20):
        draws = torch.multinomial(p, 20_000, replacement=True, generator=generator)
        assert sp.tv_distance(histogram(draws, p.numel()), p) < bound
