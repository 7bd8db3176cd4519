"""A Constraint on SmolLM2-135M-Instruct's tokenizer (mask, advance, EOS, forced text) and generate(constraint=...)
on the real model: outputs parse and validate, jump-forward runs fewer forwards, a constrained row batches with a
free one, and bad combinations are refused before compute."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from llminfer.checkpoint import load_pretrained
from llminfer.generate import generate
from llminfer.structured import Constraint

pytestmark = pytest.mark.timeout(600)

SMOLLM2 = "smollm2-135m-instruct"
CAPITAL = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 20},
                                            "capital": {"type": "string", "maxLength": 20}},
           "required": ["country", "capital"], "additionalProperties": False}


@pytest.fixture(scope="module")
def real():
    return load_pretrained(SMOLLM2)


@pytest.fixture(scope="module")
def prompt(real):
    _, tokenizer = real
    return tokenizer.apply_chat_template([{"role": "user", "content": "Give me the capital of France as JSON."}])


def jump_forward(model, prompt, constraint):
    """generate(jump_forward=True) with at most 40 new tokens; returns its result and the model's forward count."""
    calls = []
    hook = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        return generate(model, prompt, max_new_tokens=40, constraint=constraint, jump_forward=True), len(calls)
    finally:
        hook.remove()


def test_constraint_walk(real):
    _, tokenizer = real
    constraint = Constraint.from_schema(CAPITAL, tokenizer)
    forced = constraint.forced_tokens()
    assert forced.text == '{"country": "' and tokenizer.decode(forced.token_ids) == forced.text
    for token_id in forced.token_ids:
        assert constraint.allowed_mask()[token_id]
        constraint.advance(token_id)
    eos = tokenizer.eos_token_id
    assert not constraint.allowed_mask()[eos] and not constraint.is_accepting
    with pytest.raises(ValueError, match="EOS"):
        constraint.advance(eos)
    with pytest.raises(ValueError, match="leaves the pattern"):
        constraint.advance(tokenizer.encode("\n")[0])
    for token_id in tokenizer.encode('France", "capital": "Paris"}'):
        constraint.advance(token_id)
    assert constraint.is_accepting and constraint.allowed_token_ids().tolist() == [eos]
    assert constraint.forced_tokens().token_ids == []
    constraint.advance(eos)
    assert constraint.finished


def test_forced_text_stops_at_a_choice(real):
    _, tokenizer = real
    constraint = Constraint.from_regex(r"(Paris|Parma) is (nice|big)", tokenizer)
    assert constraint.forced_tokens().text == "Par"            # then a choice: 'i' or 'm'
    for token_id in tokenizer.encode("Parma"):
        constraint.advance(token_id)
    assert constraint.forced_tokens().text == " is "


def test_generate_constrained_parses_and_validates(real, prompt):
    model, tokenizer = real
    free = generate(model, prompt, max_new_tokens=40)
    plain = generate(model, prompt, max_new_tokens=40, constraint=Constraint.from_schema(CAPITAL, tokenizer))
    assert plain.token_ids[-1] == tokenizer.eos_token_id
    document = json.loads(tokenizer.decode(plain.token_ids))
    jsonschema.validate(document, CAPITAL)
    assert tokenizer.decode(free.token_ids) != tokenizer.decode(plain.token_ids)

    jumped, forwards = jump_forward(model, prompt, Constraint.from_schema(CAPITAL, tokenizer))
    jsonschema.validate(json.loads(tokenizer.decode(jumped.token_ids)), CAPITAL)
    assert forwards < len(jumped.token_ids) - 5          # the forced keys and quotes took no step each

    # a constrained row beside a free one: each is what it is alone
    batch = torch.tensor([prompt, prompt])
    both = generate(model, batch, max_new_tokens=40,
                    constraint=[Constraint.from_schema(CAPITAL, tokenizer), None])
    assert both.token_ids[0] == plain.token_ids
    assert both.token_ids[1] == free.token_ids


def test_length_stops_inside_the_structure(real, prompt):
    model, tokenizer = real
    out = generate(model, prompt, max_new_tokens=5, constraint=Constraint.from_schema(CAPITAL, tokenizer))
    assert len(out.token_ids) == 5 and tokenizer.eos_token_id not in out.token_ids
    assert tokenizer.decode(out.token_ids).startswith('{"country": "')


NOTE = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"],
        "additionalProperties": False}                      # a string with no length limit: it can run on


def test_distances_count_the_fewest_bytes_to_a_match(real):
    _, tokenizer = real
    index = Constraint.from_regex("ab(c|de)f*", tokenizer).index
    walks = (b"", b"a", b"ab", b"abd", b"abc", b"abcff", b"abde")
    assert [int(index.distances[index.dfa.walk(text)]) for text in walks] == [3, 2, 1, 1, 0, 0, 0]


def test_closing_tokens_are_exactly_those_that_bring_the_end_nearer(real):
    _, tokenizer = real
    constraint = Constraint.from_schema(NOTE, tokenizer)
    index = constraint.index
    state = index.dfa.walk(b'{"note": "Par')
    here = index.distances[state]
    assert here == len('"}')
    expected = []
    for token_id, data in enumerate(index.vocab.token_bytes):
        if data and token_id != index.eos_token_id:
            end = index.dfa.walk(data, state)
            if end != -1 and index.distances[end] < here:
                expected.append(token_id)
    closing = index.closing_tokens(state).tolist()
    assert closing == expected and tokenizer.encode('"}')[0] in closing
    assert set(closing) < set(index.allowed_tokens(state).tolist())


def test_a_free_string_is_closed_within_max_tokens(real):
    model, tokenizer = real
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a long note about Paris as JSON."}])
    lengths = []
    for seed in range(6):                                  # hot sampling: the note would run past 16 tokens
        out = generate(model, prompt, max_new_tokens=16, temperature=1.5, seed=seed,
                       constraint=Constraint.from_schema(NOTE, tokenizer))
        assert out.token_ids[-1] == tokenizer.eos_token_id, tokenizer.decode(out.token_ids)
        jsonschema.validate(json.loads(tokenizer.decode(out.token_ids[:-1])), NOTE)
        lengths.append(len(out.token_ids))
    assert max(lengths) == 16, lengths                      # the budget bound, and the document still closed


def test_an_adversary_cannot_push_the_end_past_the_budget(real):
    """At every step this sampler takes, of the tokens the mask allows, one that leaves the text furthest from a
    match (the first byte of a four-byte emoji inside a string, where it can): the document still closes in time."""
    _, tokenizer = real
    schema = {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 24},
                                               "items": {"type": "array", "items": {"type": "string"}}},
              "required": ["topic", "items"]}
    for budget in (30, 41, 64):
        constraint = Constraint.from_schema(schema, tokenizer).finish_within(budget)
        index, made = constraint.index, []
        while not constraint.finished:
            assert len(made) < budget, tokenizer.decode(made)
            allowed = constraint.allowed_token_ids()
            ends = [index.dfa.walk(index.vocab.token_bytes[t], constraint.state) if t != index.eos_token_id else -1
                    for t in allowed.tolist()]
            token = int(allowed[max(range(len(allowed)), key=lambda i: index.distances[ends[i]] if ends[i] >= 0
                                    else -1)])
            constraint.advance(token)
            made.append(token)
        assert made[-1] == tokenizer.eos_token_id and len(made) <= budget
        jsonschema.validate(json.loads(tokenizer.decode(made[:-1])), schema)


def test_bad_combinations_refused(real, prompt):
    model, tokenizer = real
    constraint = Constraint.from_regex("[0-9]+", tokenizer)
    with pytest.raises(ValueError, match="ignore_eos"):
        generate(model, prompt, constraint=constraint, ignore_eos=True)
    with pytest.raises(ValueError, match="2 constraints for a batch of 1"):
        generate(model, prompt, constraint=[constraint, None])
    with pytest.raises(ValueError, match="jump_forward=True needs a constraint"):
        generate(model, prompt, jump_forward=True)
    with pytest.raises(ValueError, match="batch of 1"):
        generate(model, torch.tensor([prompt, prompt]), constraint=[constraint, None], jump_forward=True)
    with pytest.raises(ValueError, match="is a str"):
        generate(model, prompt, constraint=["[0-9]+"])


def test_engine_batches_a_constrained_request_with_free_ones(real, prompt):
    from llminfer.engine import LLMEngine, SamplingParams

    model, tokenizer = real
    eos = tokenizer.eos_token_id
    engine = LLMEngine(model, block_size=16, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=256,
                       max_model_len=512)
    free = engine.add_request(prompt, SamplingParams(max_new_tokens=8, eos_token_id=eos))
    constrained = engine.add_request(prompt, SamplingParams(max_new_tokens=40, eos_token_id=eos),
                                     constraint=Constraint.from_schema(CAPITAL, tokenizer))
    cut = engine.add_request(prompt, SamplingParams(max_new_tokens=4, eos_token_id=eos),
                             constraint=Constraint.from_schema(CAPITAL, tokenizer))
    while engine.has_unfinished():
        engine.step()
    outputs = {rid: engine.output(rid) for rid in (free, constrained, cut)}
    alone = generate(model, prompt, max_new_tokens=40, constraint=Constraint.from_schema(CAPITAL, tokenizer))
    assert outputs[constrained].token_ids == alone.token_ids and outputs[constrained].finish_reason == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(outputs[constrained].token_ids)), CAPITAL)
    assert outputs[free].token_ids == generate(model, prompt, max_new_tokens=8).token_ids
    assert outputs[cut].finish_reason == "length" and tokenizer.decode(outputs[cut].token_ids).startswith('{"')
    with pytest.raises(ValueError, match="ends with token 2"):
        engine.add_request(prompt, SamplingParams(max_new_tokens=4), constraint=Constraint.from_regex("a", tokenizer))


def test_jump_forward_retokenizes_the_sampled_token_with_the_forced_text(real):
    from llminfer.structured.constraint import jump_tokens

    _, tokenizer = real
    pattern = r"(P|L)aris is nice\."
    conservative = Constraint.from_regex(pattern, tokenizer)
    [p] = tokenizer.encode("P")
    conservative.advance(p)
    assert jump_tokens(conservative, p, budget=10, retokenize=False) == [p] + tokenizer.encode("aris is nice.")
    sglang = Constraint.from_regex(pattern, tokenizer)
    sglang.advance(p)
    run = jump_tokens(sglang, p, budget=10)
    assert run == tokenizer.encode("Paris is nice.") != [p] + tokenizer.encode("aris is nice.")   # one cut, as trained
    assert sglang.state == conservative.state and sglang.is_accepting     # the same bytes: the same state
    short = Constraint.from_regex(pattern, tokenizer)
    short.advance(p)
    assert jump_tokens(short, p, budget=1) == [p] + tokenizer.encode("aris is nice.")[:1]   # no room: cut as before


def test_jump_forward_with_retokenized_boundaries_stays_in_the_pattern(real, prompt):
    model, tokenizer = real
    for pattern in (r"(P|L)aris is (nice|big)\.", r'\{"city": "(Paris|Lima)", "population_in_millions": [0-9]\}'):
        out, forwards = jump_forward(model, prompt, Constraint.from_regex(pattern, tokenizer))
        assert out.token_ids[-1] == tokenizer.eos_token_id
        assert re.fullmatch(pattern, tokenizer.decode(out.token_ids[:-1])), tokenizer.decode(out.token_ids)
        assert forwards < len(out.token_ids) - 2                # forced runs took one forward each
