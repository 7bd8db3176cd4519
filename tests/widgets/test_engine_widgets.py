"""The widgets of chapters 05 and 06: pure functions against hand-made traces, widgets driven by value."""
from __future__ import annotations

import pytest

import llminfer
from llminfer.engine import LLMEngine, StepRecord
from llminfer.engine.workload import make_workload
from llminfer.widgets import block_pool, schedule
from small_models import SMALL_CONFIGS, random_model


@pytest.fixture(scope="module")
def model():
    return random_model(SMALL_CONFIGS["llama-gqa-tied"])


def record(step, start, end, entries, preempted=(), finished=()):
    return StepRecord(step, start, end, tuple(entries), tuple(preempted), tuple(finished))


def test_gantt_segments_from_a_hand_made_trace():
    # request 0 arrives at 0, request 1 at 0.5; 1 waits, 0 is preempted after step 2 and recomputed in step 4
    trace = [record(1, 10.0, 11.0, [(0, "prefill", 5)]),
             record(2, 11.0, 12.0, [(0, "decode", 1), (1, "prefill", 3)], preempted=[0]),
             record(3, 12.0, 13.0, [(1, "decode", 1)]),
             record(4, 13.5, 14.0, [(0, "prefill", 7), (1, "decode", 1)], finished=[1])]
    segments = schedule.gantt_segments(trace, [0.0, 0.5], start_s=10.0, request_ids=[0, 1])
    rows = {r: [(s.kind, s.start_s, s.end_s) for s in segments if s.request == r] for r in (0, 1)}
    assert rows[0] == [("prefill", 0.0, 1.0), ("decode", 1.0, 2.0), ("preempted", 2.0, 3.5), ("prefill", 3.5, 4.0)]
    assert rows[1] == [("waiting", 0.5, 1.0), ("prefill", 1.0, 2.0), ("decode", 2.0, 3.0),
                       ("waiting", 3.0, 3.5), ("decode", 3.5, 4.0)]
    counts = schedule.run_counts(trace)
    assert counts == {"steps": 4, "tokens": 18, "max_tokens_per_step": 8, "preemptions": 1, "finished": 1,
                      "max_running": 2}
    text = schedule.summary_text({"policy": "continuous", "requests": 2, "throughput_tok_s": 12.345,
                                  "ttft_p50_s": 0.5, "tpot_p50_s": 0.0123}, counts)
    assert text == ("continuous · 2 requests · 4 steps · 1 preemptions · 12.3 tok/s · TTFT p50 500 ms · "
                    "TPOT p50 12.3 ms")


def test_segments_of_a_real_run_cover_every_token(model):
    workload = make_workload(n_requests=8, rate=float("inf"), vocab_size=model.config.vocab_size, seed=2,
                             prompt_median=12, max_prompt=40, output_median=5, max_output=12)
    result, segments = schedule.run_policy(model, workload, "continuous", max_num_batched_tokens=32, max_num_seqs=4)
    decode_tokens = sum(s.tokens for s in segments if s.kind == "decode")
    prefill_tokens = sum(s.tokens for s in segments if s.kind == "prefill")
    assert decode_tokens + len(workload) == sum(workload.output_lens)     # the first token comes from a prefill
    assert prefill_tokens == sum(workload.prompt_lens)                     # every prompt token, in chunks
    assert all(s.end_s >= s.start_s >= 0 for s in segments)
    assert schedule.chart_png(segments, len(workload))[:8] == b"\x89PNG\r\n\x1a\n"


MICRO = llminfer.ModelConfig(vocab_size=61, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32,
                             max_seq_len=96)


def test_schedule_widget_runs_the_engine():
    model = random_model(MICRO)
    # every request arrives at once, so continuous batching must share steps however fast this CPU runs the
    # micro model (at 100 arrivals/s a fast CPU finished each request before the next one came)
    together = make_workload(n_requests=6, rate=float("inf"), vocab_size=model.config.vocab_size, seed=3,
                             prompt_median=8, max_prompt=24, output_median=4, max_output=8)
    rates = []

    def workload(rate):
        rates.append(rate)
        return together

    box = schedule.build_schedule_widget(model, workload, settings=("continuous", 64, 4, 100.0))
    assert box.summary.value == "" and box.chart.value == b""              # nothing drawn before Run
    box.policy.value = "sequential"
    box.on_run()
    result, _, stats, counts = box.last
    assert counts["steps"] == sum(together.output_lens)                 # sequential: one token per step
    assert box.summary.value.startswith("sequential · 6 requests · ") and len(box.chart.value) > 1000
    box.policy.value = "continuous"
    box.on_run()
    assert box.last[3]["steps"] < counts["steps"]
    box.budget.value = 16
    box.seqs.value = 1
    box.rate.value = 20.0
    box.on_run()                                                           # one at a time, small chunks
    assert box.last[2]["requests"] == 6 and rates == [100.0, 100.0, 20.0]   # the slider's rate reaches the workload


def test_pool_snapshots_of_the_vllm_example():
    tiny, _ = llminfer.load_pretrained("tiny-capitals")
    engine = LLMEngine(tiny, block_size=4, num_blocks=10, max_model_len=40)
    snapshots = block_pool.record_snapshots(engine, block_pool.vllm_example_events())
    assert len(snapshots) == len(block_pool.vllm_example_events()) + 1
    queues = [block_pool.queue_text(s) for s in snapshots]
    assert queues[0] == "free queue (evicted first → last): 0 1 2 3 4 5 6 7 8 9"
    assert queues[6] == "free queue (evicted first → last): 7 8 9 4 3 2"
    assert queues[7] == "free queue (evicted first → last): 7 8 9 4 3 2 6 5 1 0"
    assert block_pool.counts_text(snapshots[6]) == "blocks used 4 · free 6 (of which 2 still cached)"
    grid = block_pool.pool_html(snapshots[6])
    assert grid.count("class='pool-block'") == 10
    assert "data-block='0' data-ref='1'" in grid and "r1: [0, 1, 5, 6]" in grid
    assert snapshots[9].block_tables == {2: (0, 1, 2, 7, 8, 9, 4, 3)}
    box = block_pool.build_pool_widget(snapshots)
    box.step_slider.value = 7
    assert box.queue.value == queues[7] and box.snapshot is snapshots[7]
    with pytest.raises(ValueError, match="no snapshots"):
        block_pool.build_pool_widget([])


def test_table_links_of_three_requests_sharing_a_prefix():
    tiny, _ = llminfer.load_pretrained("tiny-capitals")
    engine = LLMEngine(tiny, block_size=4, num_blocks=12, max_model_len=40)
    shared = list(range(100, 110))                                  # 10 tokens: two full blocks, then half of one
    for tail in ([7, 8, 9], [20, 21, 22, 23, 24], [30]):
        engine.add_request(shared + tail, llminfer.engine.SamplingParams(max_new_tokens=2))
    engine.step()                                                   # one step: all three prefill, the last two hit
    snapshot = engine.block_manager.snapshot(engine.scheduler.running)
    links = block_pool.table_links(snapshot)
    assert len(links) == sum(len(t) for t in snapshot.block_tables.values())
    for block in snapshot.blocks:                                   # a block's ref count is the links to it
        assert block.ref_count == sum(physical == block.block_id for _, _, physical in links)
    first_two = {table[:2] for table in snapshot.block_tables.values()}
    assert len(first_two) == 1 and all(snapshot.blocks[b].ref_count == 3 for b in first_two.pop())
    thirds = [table[2] for table in snapshot.block_tables.values()]
    assert len(set(thirds)) == 3                                    # the mixed third block is each request's own
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    block_pool.plot_block_tables(ax, snapshot)
    assert len(ax.lines) == len(links) and len(ax.patches) == len(links) + len(snapshot.blocks)
    plt.close(fig)
