"""The logits-processor pipeline of llminfer.sampling: each processor against transformers' own on the same logits,
presence and frequency penalties against hand-worked numbers, the whole chain in its order, a mixed batch equal to
each row alone, the allowed-token mask, seeded reproducibility through generate, and bad values refused."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import llminfer
from llminfer.sampling import (STAGES, History, SamplerSettings, apply_min_p, apply_temperature, apply_top_k,
                               apply_top_p, distribution, penalise, sample, stages)

VOCAB = 300


def logits_and_history(seed: int, rows: int = 4, prompt_len: int = 12, output_len: int = 6):
    """Random logits (rows, VOCAB) spread like a model's, and random prompt and output ids per row."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    prompts = torch.randint(0, VOCAB, (rows, prompt_len), generator=g)
    outputs = torch.randint(0, VOCAB, (rows, output_len), generator=g)
    return logits, prompts, outputs


def kept(scores: torch.Tensor) -> torch.Tensor:
    """Which tokens a filter left (a finite score)."""
    return torch.isfinite(scores)


# --- each processor against transformers' ----------------------------------------------------------------------

@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
@pytest.mark.parametrize("seed", range(3))
def test_repetition_penalty_is_transformers(seed, penalty):
    logits, prompts, outputs = logits_and_history(seed)
    ids = torch.cat([prompts, outputs], dim=1)                          # transformers looks at prompt + output
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    history = History.of(prompts.tolist(), outputs.tolist(), VOCAB)
    got = penalise(logits, [SamplerSettings(repetition_penalty=penalty)] * 4, history)
    assert torch.equal(got, expected)
    assert not torch.equal(got, logits)                                 # it did something


def test_presence_and_frequency_penalties_by_hand():
    """OpenAI's definition: logit -= presence * [count > 0] + frequency * count, over the output tokens only."""
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5, -1.0]])
    history = History.of([[0, 4, 4]], [[1, 1, 2]], 5)                   # the prompt's tokens are not counted
    settings = SamplerSettings(presence_penalty=0.5, frequency_penalty=0.25)
    got = penalise(logits, [settings], history)
    # token 1 twice: 2 - (0.5 + 2 * 0.25) = 1.0; token 2 once: 3 - (0.5 + 0.25) = 2.25; the rest unchanged
    assert got.tolist() == [[1.0, 1.0, 2.25, 0.5, -1.0]]
    negative = penalise(logits, [SamplerSettings(presence_penalty=-1.0, frequency_penalty=-0.5)], history)
    assert negative.tolist() == [[1.0, 4.0, 4.5, 0.5, -1.0]]          # negative values encourage repeats
    both = penalise(logits, [SamplerSettings(repetition_penalty=2.0, presence_penalty=0.5)], history)
    # repetition first (tokens 0, 1, 2, 4 seen in prompt or output): 0.5, 1.0, 1.5, -2.0; then presence on 1 and 2
    assert both.tolist() == [[0.5, 0.5, 1.0, 0.5, -2.0]]


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.8])
def test_temperature_is_transformers(temperature):
    logits, _, _ = logits_and_history(1)
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone()).softmax(-1)
    got = apply_temperature(logits, torch.full((4, 1), temperature)).softmax(-1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", range(4))
def test_top_k_top_p_and_min_p_are_transformers_row_by_row(seed):
    """Each row with its own value (None: off), against transformers' warper run on that row alone."""
    logits, _, _ = logits_and_history(seed, rows=5)
    logits = logits / 0.8
    top_k, top_p, min_p = [1, 5, None, 40, VOCAB + 3], [0.5, 0.9, None, 0.99, 0.3], [0.0, 0.05, 0.2, None, 0.5]
    got_k, got_p, got_m = apply_top_k(logits, top_k), apply_top_p(logits, top_p), apply_min_p(logits, min_p)
    for row in range(5):
        one = logits[row:row + 1].clone()
        if top_k[row] is not None:
            assert torch.equal(kept(got_k[row:row + 1]), kept(TopKLogitsWarper(top_k[row])(None, one.clone())))
        if top_p[row] is not None:
            assert torch.equal(kept(got_p[row:row + 1]), kept(TopPLogitsWarper(top_p[row])(None, one.clone())))
        if min_p[row]:
            assert torch.equal(kept(got_m[row:row + 1]), kept(MinPLogitsWarper(min_p[row])(None, one.clone())))
    assert kept(got_k[0]).sum() == 1 and kept(got_k[2]).all() and kept(got_k[4]).all()
    assert kept(got_p[2]).all() and kept(got_m[3]).all() and kept(got_m[0]).all()


@pytest.mark.parametrize("seed", range(3))
def test_the_whole_chain_is_transformers_in_its_order(seed):
    """Repetition penalty, temperature, top-k, top-p, min-p: the distribution a sampled row draws from equals the
    softmax of transformers' processors applied in that order."""
    logits, prompts, outputs = logits_and_history(seed, rows=1)
    logits = logits / 3                                                 # flat enough for every cut to act
    settings = SamplerSettings(temperature=0.7, top_k=60, top_p=0.9, min_p=0.15, repetition_penalty=1.4)
    ids = torch.cat([prompts, outputs], dim=1)
    scores = RepetitionPenaltyLogitsProcessor(1.4)(ids, logits.clone())
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(60), TopPLogitsWarper(0.9), MinPLogitsWarper(0.15)):
        scores = warper(ids, scores)
    history = History.of(prompts, outputs.tolist(), VOCAB)
    got = distribution(penalise(logits, [settings], history), [settings])
    torch.testing.assert_close(got, scores.softmax(-1), rtol=1e-5, atol=1e-7)
    support = [int((p > 0).sum()) for p in stages(logits[0], settings, history).values()]
    assert support[-4] == VOCAB > support[-3] > support[-2] > support[-1] > 1     # each cut acted, in turn


# --- the batch -----------------------------------------------------------------------------------------------

MIXED = [SamplerSettings(),                                                          # greedy
         SamplerSettings(temperature=0.9, top_k=20),
         SamplerSettings(temperature=1.2, top_p=0.8, repetition_penalty=1.3, presence_penalty=0.4),
         SamplerSettings(repetition_penalty=2.0, frequency_penalty=1.0),                 # greedy, penalised
         SamplerSettings(temperature=0.7, min_p=0.1, frequency_penalty=-0.5),
         SamplerSettings(temperature=1.0)]


def test_a_mixed_batch_draws_what_each_row_draws_alone():
    logits, prompts, outputs = logits_and_history(7, rows=len(MIXED))
    history = History.of(prompts, outputs.tolist(), VOCAB)
    seeds = [None, 11, 12, None, 14, 15]
    for step in range(20):
        batch_gens = [None if s is None else torch.Generator().manual_seed(s + step) for s in seeds]
        batch = sample(logits, MIXED, batch_gens, history)
        for row, settings in enumerate(MIXED):
            gen = None if seeds[row] is None else torch.Generator().manual_seed(seeds[row] + step)
            alone = History(history.seen[row:row + 1], history.counts[row:row + 1])
            assert int(sample(logits[row:row + 1], [settings], [gen], alone)[0]) == int(batch[row])
        logits = torch.roll(logits, 1 + step, dims=1)
    greedy = penalise(logits, MIXED, history).argmax(-1)
    tokens = sample(logits, MIXED, [None, *[torch.Generator().manual_seed(0)] * 5], history)
    assert int(tokens[0]) == int(logits[0].argmax()) and int(tokens[3]) == int(greedy[3])
    assert int(greedy[3]) != int(logits[3].argmax()) or not history.seen[3, int(logits[3].argmax())]


def test_history_from_lists_from_a_tensor_and_appended_agree():
    _, prompts, outputs = logits_and_history(3)
    whole = History.of(prompts.tolist(), outputs.tolist(), VOCAB)
    grown = History.of(prompts, None, VOCAB)
    for column in outputs.T:
        grown.append(column)
    assert torch.equal(whole.seen, grown.seen) and torch.equal(whole.counts, grown.counts)
    assert whole.counts.sum() == outputs.numel() and whole.seen[0, int(prompts[0, 0])]


# --- the allowed-token mask ------------------------------------------------------------------------------------

def test_the_mask_keeps_every_row_inside_its_allowed_tokens():
    logits, prompts, outputs = logits_and_history(5, rows=len(MIXED))
    history = History.of(prompts, outputs.tolist(), VOCAB)
    allowed = torch.zeros(len(MIXED), VOCAB, dtype=torch.bool)
    allowed[:, 100:110] = True
    allowed[0] = True                                                   # one row unconstrained
    for step in range(30):
        tokens = sample(logits, MIXED, [None] + [torch.Generator().manual_seed(step)] * 5, history, allowed)
        assert all(100 <= int(t) < 110 for t in tokens[1:]) and int(tokens[0]) == int(logits[0].argmax())
    best = int(logits[3:4, 100:110].argmax()) + 100                     # a greedy row: the best allowed token
    assert int(sample(logits[3:4], [SamplerSettings()], None, None, allowed[3:4])[0]) == best
    # the mask comes before the filters: top_k=1 takes the best allowed token, never leaves the row empty
    assert int(sample(logits[3:4], [SamplerSettings(temperature=1.0, top_k=1)], None, None, allowed[3:4])[0]) == best


def test_a_mask_that_allows_nothing_names_the_request():
    logits = torch.randn(3, VOCAB)
    allowed = torch.ones(3, VOCAB, dtype=torch.bool)
    allowed[1] = False
    with pytest.raises(ValueError, match="allowed-token mask of request 42 allows no token"):
        sample(logits, SamplerSettings(), None, None, allowed, names=["request 7", "request 42", "request 9"])
    with pytest.raises(ValueError, match="mask of row 1 allows no token"):
        sample(logits, SamplerSettings(), None, None, allowed)
    with pytest.raises(ValueError, match=r"allowed must be a bool tensor of the logits' shape \(3, 300\)"):
        sample(logits, SamplerSettings(), None, None, allowed.float())
    with pytest.raises(ValueError, match="penalties need the History"):
        sample(logits, SamplerSettings(presence_penalty=1.0))
    with pytest.raises(ValueError, match="2 settings for 3 rows"):
        sample(logits, [SamplerSettings()] * 2)


# --- the figure's helper ---------------------------------------------------------------------------------------

def test_stages_show_what_each_stage_does():
    logits, prompts, outputs = logits_and_history(2, rows=1)
    history = History.of(prompts, outputs.tolist(), VOCAB)
    neutral = stages(logits[0], SamplerSettings(temperature=1.0))
    assert list(neutral) == list(STAGES)
    assert all(torch.allclose(p, neutral["model"]) for p in neutral.values())
    settings = SamplerSettings(temperature=0.5, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.5,
                               presence_penalty=1.0)
    seen = stages(logits[0], settings, history)
    support = [int((seen[name] > 0).sum()) for name in STAGES]
    assert support[:5] == [VOCAB] * 5 and 50 >= support[5] >= support[6] >= support[7] >= 1
    torch.testing.assert_close(seen["min-p"], distribution(penalise(logits, [settings], history), [settings])[0])
    assert not torch.allclose(seen["repetition penalty"], seen["model"])
    greedy = stages(logits[0], SamplerSettings())
    assert float(greedy["min-p"].max()) == 1.0 and int(greedy["top-k"].argmax()) == int(logits[0].argmax())


# --- through generate, on the bundled model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def capitals():
    return llminfer.load_pretrained("tiny-capitals")


def test_generate_with_penalties_is_seeded_and_follows_transformers_step_by_step(capitals):
    model, tokenizer = capitals
    prompt = tokenizer.encode("The capital of France")
    settings = dict(temperature=1.0, top_k=40, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.5,
                    frequency_penalty=0.3)
    first = llminfer.generate(model, prompt, max_new_tokens=10, seed=3, ignore_eos=True, **settings)
    assert first.token_ids == llminfer.generate(model, prompt, max_new_tokens=10, seed=3, ignore_eos=True,
                                                **settings).token_ids
    # greedy with a strong repetition penalty: each token is the argmax of transformers' processed logits
    run = llminfer.generate(model, prompt, max_new_tokens=10, repetition_penalty=3.0, ignore_eos=True,
                            return_logits=True)
    plain = llminfer.generate(model, prompt, max_new_tokens=10, ignore_eos=True)
    assert run.token_ids != plain.token_ids
    for step, logits in enumerate(run.logits):
        ids = torch.tensor([prompt + run.token_ids[:step]])
        assert int(RepetitionPenaltyLogitsProcessor(3.0)(ids, logits.clone()).argmax()) == run.token_ids[step]
    # greedy with presence and frequency: the argmax after subtracting the output's counts, by hand
    run = llminfer.generate(model, prompt, max_new_tokens=10, presence_penalty=1.5, frequency_penalty=2.0,
                            ignore_eos=True, return_logits=True)
    for step, logits in enumerate(run.logits):
        counts = torch.bincount(torch.tensor(run.token_ids[:step], dtype=torch.long), minlength=logits.shape[-1])
        expected = logits[0] - 1.5 * (counts > 0) - 2.0 * counts
        assert int(expected.argmax()) == run.token_ids[step]


@pytest.mark.parametrize("keyword,value,words", [
    ("min_p", 1.5, "min_p must lie in 0..1"), ("min_p", -0.1, "min_p must lie in 0..1"),
    ("min_p", 1e-40, "min_p=1e-40 is below 1.18e-38"), ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("repetition_penalty", -1.2, "repetition_penalty must be > 0"),
    ("repetition_penalty", math.inf, "repetition_penalty=inf is not finite"),
    ("presence_penalty", 2.5, "presence_penalty must lie in -2.0..2.0"),
    ("frequency_penalty", -3, "frequency_penalty must lie in -2.0..2.0"),
    ("frequency_penalty", float("nan"), "frequency_penalty=nan is not a number"),
    ("presence_penalty", True, "presence_penalty must be a number"),
])
def test_bad_values_are_refused_before_compute(capitals, keyword, value, words):
    model, _ = capitals
    with pytest.raises(ValueError, match=words):
        SamplerSettings(**{keyword: value})
    forwards = []
    handle = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=words):
            llminfer.generate(model, [1, 2, 3], max_new_tokens=2, **{keyword: value})
    finally:
        handle.remove()
    assert forwards == []                                               # refused before the model ran
    with pytest.raises(ValueError, match=words):
        llminfer.sample_next(torch.zeros(1, 5), 1.0, **{keyword: value})
