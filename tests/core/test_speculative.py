"""Speculative decoding: greedy output equals plain decoding, the cache rolls back exactly, bad input is refused."""
from __future__ import annotations

import json

import pytest
import torch

import llminfer
from llminfer import speculative as sp

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return llminfer.load_pretrained("tiny-capitals", device="cpu")


@pytest.fixture(scope="module")
def draft():
    return llminfer.load_pretrained("tiny-capitals-draft", device="cpu")


def qa(country: str, capital: str) -> str:
    return f"What is the capital of {country}? It is {capital}. What is the capital of {country}?"


# 24 prompts: the corpus's phrasings (they end at <eos>), held-out and unknown ones, questions whose answer is
# already in the prompt (prompt lookup's case), and long ones that run into the context limit mid-draft.
SHORT_PROMPTS = ["The capital of France", "I love", "Paris is the capital of", "The capital city of Peru is",
                 "The capital of France is called", "The capital of Atlantis is", "What is the capital of Sri Lanka?",
                 "The government of", "The", "Prefill", "Three plus four is",
                 qa("Sri Lanka", "Sri Jayawardenepura Kotte"), qa("Iceland", "Reykjavík"), "Norway's capital is"]
LONG_TEXT = ("The capital of France is Paris. The capital of Spain is Madrid. The capital of Peru is Lima. "
             "What is the capital of Chad? It is N'Djamena. I love AI. The model reads the prompt. ")


def long_prompts(tokenizer, n: int) -> list[list[int]]:
    """n prompts of 116 to 121 tokens cut from a repeated passage: generation runs into max_seq_len=128."""
    ids = tokenizer.encode(LONG_TEXT * 4)
    return [ids[i:i + 116 + i] for i in range(n)]


def all_prompts(tokenizer) -> list[tuple[list[int], int, int | None]]:
    """(prompt ids, max_new_tokens, eos id) for every case; long prompts fill the context and ignore <eos>."""
    eos = tokenizer.eos_token_id
    cases = [(tokenizer.encode(text), 16, eos) for text in SHORT_PROMPTS]
    cases += [(ids, 128 - len(ids), None) for ids in long_prompts(tokenizer, 6)]
    return cases


def drafters(target_model, draft_model):
    return {"prompt lookup": sp.PromptLookupDrafter(max_ngram=3), "draft model": sp.DraftModelDrafter(draft_model),
            "early exit": sp.EarlyExitDrafter(target_model, 2)}


def test_greedy_equals_plain_decoding_for_every_drafter_and_k(target, draft):
    model, tokenizer = target
    cases = all_prompts(tokenizer)
    assert len(cases) >= 20
    plain = [llminfer.generate(model, ids, max_new_tokens=n, eos_token_id=eos, ignore_eos=eos is None).token_ids
             for ids, n, eos in cases]
    # the cases really do reach <eos> early and the context limit mid-draft
    assert sum(tokens[-1] == tokenizer.eos_token_id and len(tokens) < n
               for tokens, (_, n, _) in zip(plain, cases)) >= 10
    assert sum(len(ids) + len(tokens) == model.config.max_seq_len for tokens, (ids, _, _) in zip(plain, cases)) >= 6
    accepted_any = {}
    for name, drafter in drafters(model, draft[0]).items():
        for k in range(1, 9):
            for (ids, n, eos), expected in zip(cases, plain):
                result = sp.generate(model, ids, drafter, num_speculative_tokens=k, max_new_tokens=n, eos_token_id=eos)
                assert result.token_ids == expected, (name, k, tokenizer.decode(ids))
                assert len(result.token_kinds) == len(expected)
                assert max(result.drafted_per_step, default=0) <= k
                accepted_any[name] = accepted_any.get(name, 0) + result.num_accepted
    assert all(count > 0 for count in accepted_any.values()), accepted_any   # every drafter's guesses were used


def simulate_greedy_acceptance(drafter, prompt: list[int], plain: list[int], k: int, max_new_tokens: int):
    """Accepted guesses per step, worked out from plain greedy output alone: a guess stands while it matches it."""
    context, produced, accepted = list(prompt) + plain[:1], 1, []
    while produced < len(plain):
        budget = min(k, max_new_tokens - produced - 1)
        guesses = drafter.propose(context, budget)[:budget] if budget else []
        rest = plain[produced:]
        n = 0
        while n < len(guesses) and n < len(rest) and guesses[n] == rest[n]:
            n += 1
        accepted.append(n)
        context += rest[:n + 1]
        produced += n + 1
    return accepted


@pytest.mark.parametrize("k", [2, 5])
def test_accepted_per_step_matches_a_replay_against_plain_greedy_output(target, draft, k):
    model, tokenizer = target
    eos = tokenizer.eos_token_id
    for name in ("prompt lookup", "draft model"):
        for text in [qa("Sri Lanka", "Sri Jayawardenepura Kotte"), "What is the capital of Chad?", "The government of"]:
            ids = tokenizer.encode(text)
            plain = llminfer.generate(model, ids, max_new_tokens=24, eos_token_id=eos).token_ids
            expected = simulate_greedy_acceptance(drafters(model, draft[0])[name], ids, plain, k, 24)
            result = sp.generate(model, ids, drafters(model, draft[0])[name], num_speculative_tokens=k,
                                 max_new_tokens=24, eos_token_id=eos)
            assert result.accepted_per_step == expected, (name, text)
            assert result.num_steps == len(expected)
            kinds = result.token_kinds
            assert kinds[0] == sp.TARGET and kinds.count(sp.ACCEPTED) == sum(expected)


def test_prompt_lookup_makes_a_repeated_answer_in_few_steps(target):
    model, tokenizer = target
    ids = tokenizer.encode(qa("Sri Lanka", "Sri Jayawardenepura Kotte"))
    result = sp.generate(model, ids, sp.PromptLookupDrafter(), num_speculative_tokens=8, max_new_tokens=24,
                         eos_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(result.token_ids) == " It is Sri Jayawardenepura Kotte."
    assert len(result.token_ids) >= 12 and result.num_steps <= 2          # 15 tokens from 1 prefill + 2 forwards
    assert result.acceptance_rate >= 0.9 and result.tokens_per_step >= 6
    assert result.drafted_per_step[-1] < 8                        # guesses past <eos> are not counted as drafted


def test_prompt_lookup_proposals():
    drafter = sp.PromptLookupDrafter(max_ngram=3)
    context = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    assert drafter.propose(context, 2) == [2, 3]                 # the latest earlier [5, 6, 7] wins
    assert drafter.propose(context, 10) == [2, 3, 5, 6, 7]       # runs to the end of the context
    assert drafter.propose([1, 2, 3, 4, 2, 3, 9, 3], 3) == [9, 3]   # no 2- or 3-gram repeats: [3] at position 5
    assert drafter.propose([1, 2, 3, 4], 3) == []                # nothing repeats: no guess
    assert sp.PromptLookupDrafter(max_ngram=2, min_ngram=2).propose([1, 2, 3, 4, 2, 3, 9, 3], 3) == []
    assert drafter.propose([1, 2, 3, 9, 2, 3, 4, 2, 3], 2) == [4, 2]   # the longest n-gram first: [2, 3] at 4..5
    for bad in (dict(max_ngram=0), dict(max_ngram=2, min_ngram=3), dict(max_ngram=1.5)):
        with pytest.raises(ValueError, match="ngram"):
            sp.PromptLookupDrafter(**bad)


def plain_cache(model, context: list[int], capacity: int):
    """The cache plain decoding leaves after the prompt's prefill and one decode step per further token."""
    cache = model.new_cache(1, max_seq_len=capacity)
    llminfer.prefill(model, torch.tensor([context[:1]]), cache)
    for token in context[1:]:
        llminfer.decode_step(model, torch.tensor([token]), cache)
    return cache


class WrongDrafter(sp.Drafter):
    """Always guesses the same token: nearly every guess is rejected, so every step rolls back."""
    name = "always 7"

    def propose(self, context_ids, k):
        return [7] * k


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_after_rollback_equals_plain_decoding(target, draft, temperature):
    model, tokenizer = target
    generator = torch.Generator().manual_seed(0)
    for drafter in (WrongDrafter(), sp.EarlyExitDrafter(model, 1), sp.DraftModelDrafter(draft[0])):
        prompt = tokenizer.encode("What is the capital of Sri Lanka?")
        cache = model.new_cache(1, max_seq_len=64)
        logits = llminfer.prefill(model, torch.tensor([prompt]), cache)
        context = prompt + [int(logits.argmax())]
        rolled_back = 0
        for _ in range(6):
            guesses, q = drafter.propose_with_probs(context, 4, temperature, generator)
            n, token = sp.verify(model, cache, context[-1], guesses, temperature, q, generator)
            rolled_back += len(guesses) - n
            context += guesses[:n] + [token]
            assert cache.length == len(context) - 1
            reference = plain_cache(model, context[:-1], 64)
            for layer in range(model.config.n_layers):
                for got, want in zip(cache.get(layer), reference.get(layer)):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert rolled_back > 0, drafter          # the rollback was exercised


def test_verify_is_one_forward_over_k_plus_one_positions(target, draft):
    model, tokenizer = target
    calls = []
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(tuple(args[0].shape)),
                                           with_kwargs=True)
    try:
        result = sp.generate(model, tokenizer.encode(qa("Iceland", "Reykjavík")), sp.DraftModelDrafter(draft[0]),
                             num_speculative_tokens=4, max_new_tokens=20, eos_token_id=tokenizer.eos_token_id)
    finally:
        hook.remove()
    assert len(calls) == 1 + result.num_steps                      # the prefill, then one forward per step
    # each step's forward holds the last token and its guesses (the last step may verify guesses past <eos>)
    assert [shape[1] for shape in calls[1:-1]] == [d + 1 for d in result.drafted_per_step[:-1]]
    assert 1 + result.drafted_per_step[-1] <= calls[-1][1] <= 5


def test_draft_model_drafter_reuses_its_cache_and_matches_a_fresh_one(target, draft):
    _, tokenizer = target
    drafter = sp.DraftModelDrafter(draft[0])
    drafter.start(64)
    context = tokenizer.encode("What is the capital of Chad?")
    first = drafter.propose(context, 4)
    assert drafter.cache.length == len(context) + 3                 # the context and all guesses but the last
    context2 = context + first[:2] + [17]                           # two guesses stood, then a correction
    again = drafter.propose(context2, 3)
    fresh = sp.DraftModelDrafter(draft[0])
    assert again == fresh.propose(context2, 3)
    assert drafter.cached_ids == context2 + again[:-1]


def test_sampling_runs_are_reproducible_and_consistent(target, draft):
    model, tokenizer = target
    ids = tokenizer.encode("The capital of")
    runs = [sp.generate(model, ids, sp.DraftModelDrafter(draft[0]), num_speculative_tokens=3, max_new_tokens=20,
                        temperature=1.0, seed=3, eos_token_id=tokenizer.eos_token_id) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].accepted_per_step == runs[1].accepted_per_step
    for result in runs:
        assert len(result.token_kinds) == len(result.token_ids) == len(result.itl_s) + 1
        assert all(0 <= a <= d <= 3 for a, d in zip(result.accepted_per_step, result.drafted_per_step))
        assert result.token_kinds.count(sp.ACCEPTED) == result.num_accepted


def test_result_statistics():
    result = sp.SpeculativeResult([1, 2, 3, 4, 5, 6, 7], 0.1, [0.0] * 6, 0.5, 4, drafted_per_step=[4, 4, 0],
                                  accepted_per_step=[4, 1, 0])
    assert result.acceptance_rate == 5 / 8
    assert result.alpha == 5 / 6                           # one step judged a guess and rejected it
    assert result.tokens_per_step == (5 + 3) / 3
    assert result.num_steps == 3 and result.tpot_s == pytest.approx(0.4 / 6)


def test_step_costs_time_both_steps_and_leave_the_drafter_working(target, draft):
    model, tokenizer = target
    context = tokenizer.encode("What is the capital of Chad? It is")
    drafter = sp.DraftModelDrafter(draft[0])
    before = sp.DraftModelDrafter(draft[0]).propose(context, 3)
    draft_s, target_s = sp.step_costs(model, drafter, context, repeats=5, warmup=1)
    assert draft_s > 0 and target_s > 0
    assert drafter.propose(context, 3) == before
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        sp.step_costs(model, drafter, context, repeats=0)
    with pytest.raises(ValueError, match="context_ids must hold 2..127 tokens"):
        sp.step_costs(model, drafter, context[:1])


def test_expected_speedup_formula():
    for alpha in (0.0, 0.3, 0.8, 0.99):
        for k in (1, 4, 8):
            direct = sum(alpha ** i for i in range(k + 1))                  # P(at least i guesses stand), summed
            assert sp.expected_tokens_per_step(alpha, k) == pytest.approx(direct)
            assert sp.expected_speedup(alpha, k, 0.25) == pytest.approx(direct / (0.25 * k + 1))
    assert sp.expected_speedup(1.0, 4, 0.0) == 5.0
    assert sp.expected_speedup(0.0, 4, 0.1) < 1                            # useless guesses only cost
    assert sp.expected_speedup(0.8, 4, 0.1, 1.9) == pytest.approx(sp.expected_tokens_per_step(0.8, 4) / (0.4 + 1.9))
    with pytest.raises(ValueError, match="verify_cost"):
        sp.expected_speedup(0.8, 4, 0.1, 0.0)


# --- bad input: refused before any compute ---------------------------------------------------------------------

class CountingModel:
    """Counts forwards of a model, to prove an error came before any compute."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(lambda *a: setattr(self, "calls", self.calls + 1))


def refused(model, match, **kwargs):
    counter = CountingModel(model)
    try:
        with pytest.raises(ValueError, match=match):
            sp.generate(model, **kwargs)
    finally:
        counter.handle.remove()
    assert counter.calls == 0


def test_bad_num_speculative_tokens(target):
    model, tokenizer = target
    ids = tokenizer.encode("The capital of France is")
    for k in (0, -1, 2.0, True):
        refused(model, "num_speculative_tokens must be an integer >= 1", input_ids=ids,
                drafter=sp.PromptLookupDrafter(), num_speculative_tokens=k)
    refused(model, r"beyond the model's context of max_seq_len=128; pass num_speculative_tokens <= 127",
            input_ids=ids, drafter=sp.PromptLookupDrafter(), num_speculative_tokens=128)
    refused(model, r"exceed the model's context \(max_seq_len=128\)", input_ids=ids, drafter=sp.PromptLookupDrafter(),
            max_new_tokens=125)
    refused(model, "one sequence", input_ids=[ids, ids], drafter=sp.PromptLookupDrafter())
    refused(model, "propose", input_ids=ids, drafter="ngram")


def test_drafter_with_another_vocabulary_is_refused(target):
    model, tokenizer = target
    other = llminfer.Transformer(model.config.replace(vocab_size=512, n_layers=1)).init_weights(0)
    refused(model, "vocabulary of 512 ids but the target has 1024", input_ids=tokenizer.encode("I love"),
            drafter=sp.DraftModelDrafter(other))
    other_eos = llminfer.Transformer(model.config.replace(eos_token_id=5, n_layers=1)).init_weights(0)
    refused(model, "eos_token_id=5 but the target's is 2", input_ids=tokenizer.encode("I love"),
            drafter=sp.DraftModelDrafter(other_eos))


def test_drafter_with_another_tokenizer_is_refused(target, draft, tmp_path):
    model, tokenizer = target
    spec = json.loads(tokenizer.backend.to_str())
    vocab = spec["model"]["vocab"]
    a, b = "ĠParis", "ĠFrance"                               # byte-level BPE spells a space Ġ
    vocab[a], vocab[b] = vocab[b], vocab[a]                 # same size, two ids swapped: another tokenizer
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    swapped = llminfer.Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert swapped.vocab_size == tokenizer.vocab_size
    refused(model, "tokenizer differs from the target's", input_ids=tokenizer.encode("I love"),
            drafter=sp.DraftModelDrafter(draft[0], tokenizer=swapped), tokenizer=tokenizer)
    # the same tokenizer passes
    same = sp.generate(model, tokenizer.encode("I love"), sp.DraftModelDrafter(draft[0], tokenizer=draft[1]),
                       max_new_tokens=4, tokenizer=tokenizer)
    assert same.token_ids


def test_draft_model_on_another_device_is_refused(target, draft):
    model, tokenizer = target
    on_meta = llminfer.Transformer(draft[0].config).to("meta")
    refused(model, r"draft model is on meta but the target on cpu; move it with draft_model.to\('cpu'\)",
            input_ids=tokenizer.encode("I love"), drafter=sp.DraftModelDrafter(on_meta))


def test_draft_model_context_too_short_is_refused(target):
    model, tokenizer = target
    short = llminfer.Transformer(model.config.replace(max_seq_len=16, n_layers=1)).init_weights(0)
    refused(model, "draft model's max_seq_len is 16", input_ids=tokenizer.encode("The capital of France is"),
            drafter=sp.DraftModelDrafter(short), max_new_tokens=20)


def test_bad_drafter_arguments(target):
    model, _ = target
    for n in (0, 4, 1.0):
        with pytest.raises(ValueError, match=r"n_layers must be an integer in 1\.\.3"):
            sp.EarlyExitDrafter(model, n)
    with pytest.raises(ValueError, match="draft_model must be an llminfer Transformer"):
        sp.DraftModelDrafter("tiny-capitals-draft")


def test_early_exit_shares_the_targets_weights(target):
    model, _ = target
    drafter = sp.EarlyExitDrafter(model, 2)
    shared = {id(p) for p in model.parameters()}
    assert all(id(p) in shared for p in drafter.model.parameters())
    assert drafter.model.config.n_layers == 2 and len(drafter.model.layers) == 2
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        x = model.embed_tokens(ids)
        cos, sin = model.rope_tables(3)
        for layer in model.layers[:2]:
            x = layer(x, cos[:3], sin[:3], None, model._backend)
        expected = model.lm_head(model.norm(x))
        torch.testing.assert_close(drafter.model(ids), expected)
