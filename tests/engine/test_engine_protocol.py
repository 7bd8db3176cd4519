"""The engine protocol: LLMEngine and the disaggregated pair both speak it, and the server refuses what does not."""
from __future__ import annotations

import pytest

import llminfer
from llminfer.engine import Engine, EngineStats, LLMEngine
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
