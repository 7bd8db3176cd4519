"""The engine protocol: LLMEngine and the disaggregated pair both speak it, and the server refuses what does not."""
from __future__ import annotations

import pytest

import llminfer
from llminfer.engine import Engine, EngineStats, LLMEngine, RequestOutput, SamplingParams
from llminfer.engine.protocol import ENGINE_MEMBERS, protocol_gaps
from llminfer.serve.async_engine import EngineLoop
from llminfer.serve.disagg import DisaggregatedEngine, ModelSpec


@pytest.fixture(scope="module")
def engines():
    model, _ = llminfer.load_pretrained("tiny-capitals")
    pair = DisaggregatedEngine(ModelSpec(name="tiny-capitals"), dict(num_blocks=32))     # not started: no processes
    return LLMEngine(model, num_blocks=32), pair


def test_both_engines_speak_the_whole_protocol(engines):
    for engine in engines:
        assert protocol_gaps(engine) == [], type(engine).__name__
        assert isinstance(engine, Engine)
        assert isinstance(engine.stats, EngineStats)
    assert set(ENGINE_MEMBERS) >= {"add_request", "add_prefilled", "step", "abort", "stats", "clock"}


def test_the_pair_reports_its_pool_before_it_starts(engines):
    stats = engines[1].stats
    assert (stats.num_blocks, stats.blocks_used, stats.num_waiting, stats.num_running) == (32, 0, 0, 0)


class _Partial:
    """A stand-in that copies every member of an engine except those named in `drop`."""

    def __init__(self, engine, drop=(), narrow=()):
        for name in ENGINE_MEMBERS:
            if name in drop or name == "stats":
                continue
            value = getattr(engine, name)
            if name in narrow:
                value = lambda prompt_ids, params=None: 0                   # noqa: E731 - no arrival_time
            setattr(self, name, value)
        if "stats" not in drop:
            self.stats = engine.stats


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("member", ENGINE_MEMBERS)
def test_an_engine_lacking_any_member_is_caught(engines, index, member):
    stand_in = _Partial(engines[index], drop=(member,))
    assert protocol_gaps(stand_in) == [f"{member}: missing"]
    assert protocol_gaps(_Partial(engines[index])) == []                    # the copy itself is complete
    with pytest.raises(TypeError, match=f"{member}: missing"):
        EngineLoop(stand_in)


def test_a_method_missing_a_parameter_is_caught(engines):
    stand_in = _Partial(engines[0], narrow=("add_request",))
    assert protocol_gaps(stand_in) == ["add_request(): no parameter 'arrival_time'"]
    with pytest.raises(TypeError, match="arrival_time"):
        EngineLoop(stand_in)


# --- one request table: both engines answer the same calls the same way ------------------------------------------

def transcript(engine, tokenizer) -> list:
    """What a fixed sequence of add/abort/pop_output/output/stats calls returns on engine: values, or the error."""
    seen = []

    def call(what, *args, **kwargs):
        try:
            result = getattr(engine, what)(*args, **kwargs)
        except ValueError as exc:
            seen.append((what, "ValueError", str(exc)))
            return None
        if isinstance(result, RequestOutput):       # timings differ between the engines; what it says does not
            seen.append((what, result.request_id, result.finish_reason, result.token_ids, result.num_prompt_tokens))
        else:
            seen.append((what, result))
        return result

    def counts():
        stats = engine.stats
        seen.append(("stats", stats.num_waiting, stats.num_running, stats.num_finished))

    prompt = tokenizer.encode("The capital of France")
    counts()
    call("abort", 0)
    call("add_request", "The capital of France")
    call("add_request", [])
    call("add_request", [3, tokenizer.vocab_size])
    call("add_request", prompt, {"max_new_tokens": 3})
    call("add_request", prompt, SamplingParams(max_new_tokens=61))                    # past max_model_len=64
    call("add_request", prompt, SamplingParams(max_new_tokens=62))                    # past the pool of 4 blocks
    call("add_request", prompt, SamplingParams(max_new_tokens=3, eos_token_id=10**6))
    call("add_request", prompt, arrival_time=float("inf"))
    long_one = call("add_request", prompt, SamplingParams(max_new_tokens=40))
    short_one = call("add_request", prompt, SamplingParams(max_new_tokens=3))
    counts()
    call("pop_output", long_one)
    call("abort", long_one)
    aborted = call("pop_output", long_one)
    seen.append(("aborted", aborted.finish_reason, aborted.token_ids, aborted.prompt_token_ids))
    call("abort", long_one)
    call("abort", 7)
    call("abort", "a")
    counts()
    while engine.has_unfinished():
        engine.step()
    snapshot = engine.output(short_one)
    done = call("pop_output", short_one)
    seen.append(("done", done.finish_reason, done.token_ids, snapshot.token_ids, done.num_prompt_tokens))
    call("pop_output", short_one)
    call("output", short_one)
    counts()
    seen.append(("blocks used", engine.stats.blocks_used))
    return seen


def test_both_engines_keep_requests_alike():
    model, tokenizer = llminfer.load_pretrained("tiny-capitals")
    single = transcript(LLMEngine(model, num_blocks=4, max_model_len=64), tokenizer)
    with DisaggregatedEngine(ModelSpec(name="tiny-capitals"), dict(num_blocks=4, max_model_len=64)) as pair:
        split = transcript(pair, tokenizer)
    assert split == single
    errors = {(what, message.split(";")[0]) for what, *rest in single if rest[0] == "ValueError"
              for message in [rest[1]]}
    assert errors >= {("abort", "unknown request id 0: no request has been added"),
                      ("abort", "unknown request id 7: this engine has issued ids 0..1"),
                      ("abort", "unknown request id 'a': this engine has issued ids 0..1"),
                      ("pop_output", "request 0 has no finished output: it is still running"),
                      ("pop_output", "request 1 has no finished output: it is unknown or already popped"),
                      ("output", "request 1 is unknown or its output was already popped"),
                      ("add_request", "params must be a SamplingParams, got dict"),
                      ("add_request", "the prompt is empty"),
                      ("add_request", "a prompt of 4 tokens + max_new_tokens=61 = 65 exceeds the engine's "
                                      "max_model_len=64"),
                      ("add_request", "the request could never fit in the KV pool, even alone: 65 positions need 5 "
                                      "blocks of 16 but the pool has 4")}
    assert ("abort", True) in single and single.count(("abort", False)) == 1
    stats = [entry for entry in single if entry[0] == "stats"]
    assert stats == [("stats", 0, 0, 0), ("stats", 2, 0, 0), ("stats", 1, 0, 1), ("stats", 0, 0, 2)]
    done = next(entry for entry in single if entry[0] == "done")
    assert done[1] == "length" and tokenizer.decode(done[2]) == " is Paris." and done[3] == done[2]
    assert ("blocks used", 0) in single
