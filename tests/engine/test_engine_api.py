"""The engine driven step by step, as a server drives it: ids, events, outputs, timings, stats, the trace."""
from __future__ import annotations

import math
import pytest

import llminfer
from llminfer.engine import LLMEngine, RequestOutput, SamplingParams, StepOutput
from llminfer.engine.workload import make_workload, percentile, replay, summarize
from small_models import SMALL_CONFIGS, random_model


@pytest.fixture(scope="module")
def model():
    return random_model(SMALL_CONFIGS["qwen2-bias-gqa"])


class FakeClock:
    """A clock the test moves by hand: every call returns the current time."""
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_step_by_step(model):
    clock = FakeClock()
    engine = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=2, max_num_batched_tokens=6, clock=clock)
    a = engine.add_request([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_new_tokens=3))
    b = engine.add_request([9, 10], SamplingParams(max_new_tokens=2), arrival_time=99.0)
    c = engine.add_request([11], SamplingParams(max_new_tokens=1))
    assert (a, b, c) == (0, 1, 2) and engine.has_unfinished()
    made: dict[int, list[int]] = {a: [], b: [], c: []}
    steps = []
    while engine.has_unfinished():
        clock.now += 1.0
        events = engine.step()
        assert all(isinstance(e, StepOutput) for e in events)
        for request_id, token_id, finished in events:
            made[request_id].append(token_id)
        steps.append(events)
    # step 1: a's first chunk of 6 (budget 6), nothing sampled; step 2: a's last 2 + b's 2 + ... (max 2 seqs)
    assert steps[0] == []
    assert [e.request_id for e in steps[1]] == [a, b]
    outputs = {i: engine.pop_output(i) for i in (a, b, c)}
    for i, out in outputs.items():
        assert isinstance(out, RequestOutput) and isinstance(out, llminfer.GenerationResult)
        assert out.token_ids == made[i] and out.finished and out.finish_reason == "length"
        assert len(out.itl_s) == len(out.token_ids) - 1
        assert out.ttft_s <= out.e2e_s
    assert outputs[a].ttft_s == 2.0 and outputs[a].itl_s == [1.0, 1.0] and outputs[a].e2e_s == 4.0
    assert outputs[a].tpot_s == pytest.approx(1.0)
    assert outputs[b].ttft_s == 3.0                     # arrived at 99.0, its first token at 102.0
    assert outputs[c].queue_s == 4.0                    # c waited for a place until b finished in step 3
    with pytest.raises(ValueError, match="has no finished output"):
        engine.pop_output(a)                            # handed over once
    trace = list(engine.trace)
    assert [r.step for r in trace] == list(range(1, len(trace) + 1))
    assert trace[0].entries == ((a, "prefill", 6),)
    assert trace[1].entries[0] == (a, "prefill", 2) and (b, "prefill", 2) in trace[1].entries
    assert any(kind == "decode" for r in trace for _, kind, _ in r.entries)
    assert all(r.num_tokens <= 6 for r in trace)       # the token budget holds every step
    assert engine.stats.steps == len(trace) and engine.stats.num_finished == 3


def test_decodes_go_first_and_prefill_chunks_fill_the_budget(model):
    engine = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=8)
    a = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=10))
    engine.step()                                       # a's prefill
    b = engine.add_request(list(range(1, 21)), SamplingParams(max_new_tokens=2))   # 20 tokens: 3 chunks
    for expected_chunk in (7, 7, 6):
        engine.step()
        record = engine.trace[-1]
        assert record.entries[0] == (a, "decode", 1)    # a's decode first
        assert record.entries[1] == (b, "prefill", expected_chunk)
    assert engine.output(b).token_ids                   # the last chunk sampled b's first token


def test_max_prefill_tokens_starts_prompts_that_arrive_together_one_after_another(model):
    engine = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=32,
                       max_prefill_tokens=6)
    a, b, c = (engine.add_request(list(range(1 + 10 * i, 6 + 10 * i)), SamplingParams(max_new_tokens=4))
               for i in range(3))                       # three prompts of 5 tokens at once
    engine.step()                                       # a alone takes its whole prompt; b gets the 1 left of 6
    assert engine.trace[-1].entries == ((a, "prefill", 5), (b, "prefill", 1))
    engine.step()                                       # a decodes; b's rest (4) and c's first 2 fill the cap
    assert engine.trace[-1].entries == ((a, "decode", 1), (b, "prefill", 4), (c, "prefill", 2))
    engine.step()
    assert engine.trace[-1].entries == ((a, "decode", 1), (b, "decode", 1), (c, "prefill", 3))
    uncapped = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=32)
    ids = [uncapped.add_request(list(range(1 + 10 * i, 6 + 10 * i)), SamplingParams(max_new_tokens=4))
           for i in range(3)]
    uncapped.step()                                     # without the cap all three prefill in one step
    assert uncapped.trace[-1].entries == tuple((i, "prefill", 5) for i in ids)
    while engine.has_unfinished():
        engine.step()
    while uncapped.has_unfinished():
        uncapped.step()
    assert [engine.pop_output(i).token_ids for i in (a, b, c)] == [uncapped.pop_output(i).token_ids for i in ids]


def test_max_prefill_tokens_leaves_a_lone_prompt_the_whole_budget_and_is_checked(model):
    engine = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=16,
                       max_prefill_tokens=4)
    a = engine.add_request(list(range(1, 21)), SamplingParams(max_new_tokens=3))     # 20 tokens, alone
    engine.step()
    assert engine.trace[-1].entries == ((a, "prefill", 16),)        # nothing else runs: the whole budget
    b = engine.add_request(list(range(31, 41)), SamplingParams(max_new_tokens=2))   # no prefix shared with a
    engine.step()                                       # a's last 4 are already the cap: b waits
    assert engine.trace[-1].entries == ((a, "prefill", 4),)
    engine.step()
    assert engine.trace[-1].entries == ((a, "decode", 1), (b, "prefill", 4))       # beside a decode: capped
    unchunked = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=16,
                          max_prefill_tokens=4, chunked_prefill=False)
    c = unchunked.add_request([1, 2, 3], SamplingParams(max_new_tokens=5))
    unchunked.step()
    d = unchunked.add_request(list(range(1, 11)), SamplingParams(max_new_tokens=1))
    unchunked.step()                                    # unchunked prompts are not capped (they could starve)
    assert unchunked.trace[-1].entries == ((c, "decode", 1), (d, "prefill", 10))
    for bad in (0, -1, True, 2.0, "8"):
        with pytest.raises(ValueError, match="max_prefill_tokens"):
            LLMEngine(model, block_size=4, num_blocks=128, max_prefill_tokens=bad)


def test_without_chunking_a_long_prompt_waits_for_a_whole_step(model):
    engine = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=24,
                       chunked_prefill=False)
    a = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=5))
    engine.step()
    b = engine.add_request(list(range(1, 24)), SamplingParams(max_new_tokens=1))  # 23 tokens + a's decode = 24
    engine.step()
    assert engine.trace[-1].entries == ((a, "decode", 1), (b, "prefill", 23))


def test_static_batches_admit_nobody_until_the_batch_is_done(model):
    engine = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=2, policy="static")
    a = engine.add_request([1, 2], SamplingParams(max_new_tokens=1))
    b = engine.add_request([3, 4], SamplingParams(max_new_tokens=6))
    c = engine.add_request([5, 6], SamplingParams(max_new_tokens=1))
    engine.step()                                       # a and b prefill; a finishes
    for _ in range(5):
        engine.step()
        assert [e[0] for e in engine.trace[-1].entries] == [b]       # a's place stays empty
    engine.step()
    assert [e[0] for e in engine.trace[-1].entries] == [c]


def test_sequential_runs_one_request_at_a_time(model):
    engine = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=8, policy="sequential")
    assert engine.max_num_seqs == 1
    ids = [engine.add_request([i + 1] * 3, SamplingParams(max_new_tokens=2)) for i in range(3)]
    while engine.has_unfinished():
        engine.step()
    assert [r.entries[0][0] for r in engine.trace] == [ids[0]] * 2 + [ids[1]] * 2 + [ids[2]] * 2


def test_eos_stops_a_request(model):
    engine = LLMEngine(model, block_size=4, num_blocks=128)
    prompt = [1, 2, 3]
    free_run = llminfer.generate(model, prompt, max_new_tokens=6).token_ids
    eos = free_run[2]
    expected = free_run[: free_run.index(eos) + 1]
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, eos_token_id=eos))
    assert out.token_ids == expected and out.finish_reason == "stop"


def test_abort_mid_run(model):
    engine = LLMEngine(model, block_size=4, num_blocks=128)
    a = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=20))
    b = engine.add_request([4, 5, 6], SamplingParams(max_new_tokens=3))
    engine.step()
    engine.step()
    assert engine.abort(a)
    partial = engine.pop_output(a)
    assert partial.finish_reason == "abort" and len(partial.token_ids) == 2
    while engine.has_unfinished():
        assert all(e.request_id == b for e in engine.step())
    assert engine.pop_output(b).finish_reason == "length" and engine.stats.blocks_used == 0


def test_stats_while_running(model):
    engine = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=1)
    engine.add_request([1] * 9, SamplingParams(max_new_tokens=4))
    engine.add_request([2] * 3, SamplingParams(max_new_tokens=4))
    engine.step()
    stats = engine.stats
    assert (stats.num_running, stats.num_waiting, stats.steps) == (1, 1, 1)
    assert stats.blocks_used == 3 and stats.blocks_free == 125 and stats.usage == pytest.approx(3 / 128)
    assert stats.tokens_computed == 9 and stats.kv_pool_bytes == engine.cache.nbytes


def test_workload_is_reproducible_and_shaped_as_asked():
    a = make_workload(n_requests=400, rate=20.0, vocab_size=100, seed=5, prompt_median=40, output_median=10)
    b = make_workload(n_requests=400, rate=20.0, vocab_size=100, seed=5, prompt_median=40, output_median=10)
    assert a == b and a != make_workload(n_requests=400, rate=20.0, vocab_size=100, seed=6)
    gaps = [y - x for x, y in zip(a.arrivals_s, a.arrivals_s[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.15)          # Poisson at 20 requests/s
    assert percentile(a.prompt_lens, 50) == pytest.approx(40, rel=0.15)       # log-normal around the median
    assert percentile(a.output_lens, 50) == pytest.approx(10, rel=0.2)
    assert max(a.prompt_lens) > 3 * 40                                        # a heavy right tail
    assert all(3 <= t < 100 for r in a.requests for t in r.prompt_ids)
    bursty = make_workload(n_requests=400, rate=20.0, vocab_size=100, seed=5, burstiness=0.25)
    bursty_gaps = [y - x for x, y in zip(bursty.arrivals_s, bursty.arrivals_s[1:])]
    cv = lambda g: (sum((x - sum(g) / len(g)) ** 2 for x in g) / len(g)) ** 0.5 / (sum(g) / len(g))   # noqa: E731
    assert cv(bursty_gaps) > 1.5 * cv(gaps)                                    # gamma k < 1: burstier
    at_once = make_workload(n_requests=5, rate=float("inf"), seed=0)
    assert at_once.arrivals_s == [0.0] * 5
    prefixed = make_workload(n_requests=3, shared_prefix=[7, 8, 9], seed=0)
    assert all(r.prompt_ids[:3] == (7, 8, 9) for r in prefixed.requests)
    with pytest.raises(ValueError, match="rate must be > 0"):
        make_workload(rate=0)


def test_replay_and_summary(model):
    workload = make_workload(n_requests=6, rate=float("inf"), vocab_size=model.config.vocab_size, seed=1,
                             prompt_median=6, max_prompt=20, output_median=4, max_output=8)
    engine = LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=4)
    result = replay(engine, workload)
    assert [len(o.token_ids) for o in result.outputs] == workload.output_lens
    for request, out in zip(workload.requests, result.outputs):
        assert out.token_ids == llminfer.generate(model, list(request.prompt_ids),
                                                  max_new_tokens=request.max_new_tokens).token_ids
    # every setting of params reaches each request, penalties too (max_new_tokens comes from the workload)
    penalties = dict(repetition_penalty=2.0, frequency_penalty=0.5)
    penalised = replay(LLMEngine(model, block_size=4, num_blocks=128, max_num_seqs=4), workload,
                       SamplingParams(**penalties))
    changed = 0
    for request, out, plain in zip(workload.requests, penalised.outputs, result.outputs):
        assert out.token_ids == llminfer.generate(model, list(request.prompt_ids), max_new_tokens=request.max_new_tokens,
                                                  **penalties).token_ids
        changed += out.token_ids != plain.token_ids
    assert changed, "the penalties changed no output: this check would not see them dropped"
    summary = summarize(result, slo_ttft_s=1e9, slo_tpot_s=1e9)
    assert summary["output_tokens"] == sum(workload.output_lens)
    assert summary["throughput_tok_s"] == pytest.approx(summary["output_tokens"] / result.duration_s)
    assert summary["goodput_req_s"] == pytest.approx(6 / result.duration_s)      # everything meets a lax target
    assert summarize(result, slo_ttft_s=0.0, slo_tpot_s=1e9)["goodput_req_s"] == 0.0
    ttfts = sorted(o.ttft_s for o in result.outputs)
    assert summary["ttft_p50_s"] == pytest.approx((ttfts[2] + ttfts[3]) / 2)
    assert summary["ttft_p50_s"] <= ttfts[-1]
    # six requests hold a median, not a tail: p90 and p99 are not made up from them
    assert math.isnan(summary["ttft_p90_s"]) and math.isnan(summary["ttft_p99_s"])
    assert summary["itl_p90_s"] <= summary["itl_p99_s"] or math.isnan(summary["itl_p99_s"])
    assert summary["steps"] == len(result.trace) > 0
