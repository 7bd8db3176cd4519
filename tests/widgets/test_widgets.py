"""Widgets of chapters 03 and 04: pure functions against closed forms and instrument counts; widgets driven by value."""
from __future__ import annotations

import pytest
import torch

import llminfer
from llminfer.widgets import latency, memory, recompute
from llminfer.widgets.recompute import CACHED, NEW, RECOMPUTED


def tiny_config(**changes):
    fields = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=64)
    fields.update(changes)
    return llminfer.ModelConfig(**fields)


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return llminfer.Transformer(tiny_config()).eval()


# ---- chapter 03: recomputation --------------------------------------------------------------

def article_counts(prompt_len, n_forwards, use_cache):
    """Positions computed per forward call, written out from the rule the chapter states."""
    if use_cache:
        return [prompt_len] + [1] * (n_forwards - 1)
    return [prompt_len + i for i in range(n_forwards)]


def test_article_table_totals():
    # "The capital of France is" -> Paris, ".", <EOS>: three forward calls over 5, 6 and 7 positions
    grid = recompute.kv_grid(article_counts(5, 3, use_cache=False), prompt_len=5)
    assert [row[0] for row in grid] == [NEW] * 5 + [recompute.ABSENT] * 2
    assert [row[1] for row in grid] == [RECOMPUTED] * 5 + [NEW, recompute.ABSENT]
    assert [row[2] for row in grid] == [RECOMPUTED] * 6 + [NEW]
    assert recompute.format_counts(recompute.kv_totals(grid, 2)) == "computed 7 · recomputed 11 · read from cache 0"
    cached = recompute.kv_grid(article_counts(5, 3, use_cache=True), prompt_len=5)
    assert recompute.format_counts(recompute.kv_totals(cached, 2)) == "computed 7 · recomputed 0 · read from cache 11"


@pytest.mark.parametrize("prompt_len, n_forwards", [(1, 1), (5, 3), (7, 20), (30, 9)])
def test_totals_match_closed_form(prompt_len, n_forwards):
    without = sum(prompt_len + i for i in range(n_forwards))
    with_cache = prompt_len + n_forwards - 1
    assert recompute.closed_form_totals(prompt_len, n_forwards) == (without, with_cache)
    last = n_forwards - 1
    plain = recompute.kv_totals(recompute.kv_grid(article_counts(prompt_len, n_forwards, False), prompt_len), last)
    cached = recompute.kv_totals(recompute.kv_grid(article_counts(prompt_len, n_forwards, True), prompt_len), last)
    assert plain[NEW] + plain[RECOMPUTED] == without and plain[CACHED] == 0
    assert cached[NEW] == with_cache and cached[RECOMPUTED] == 0
    # what the cache serves is exactly what the plain loop recomputes
    assert cached[CACHED] == plain[RECOMPUTED] == without - with_cache
    assert recompute.cumulative_computed(article_counts(prompt_len, n_forwards, False))[-1] == without


def test_split_per_forward_separates_the_prompts_reruns():
    # without a cache, call i runs the P prompt positions again and i - 1 earlier generated ones, then 1 new one
    split = recompute.split_per_forward(article_counts(37, 8, use_cache=False), prompt_len=37)
    assert split[0] == {"prompt": 0, "generated": 0, "new": 37}
    assert split[1:] == [{"prompt": 37, "generated": i - 1, "new": 1} for i in range(1, 8)]
    assert sum(s["prompt"] for s in split) == 7 * 37            # most of the rerun work is the prompt's
    cached = recompute.split_per_forward(article_counts(37, 8, use_cache=True), prompt_len=37)
    assert cached == [{"prompt": 0, "generated": 0, "new": 37}] + [{"prompt": 0, "generated": 0, "new": 1}] * 7


def test_grid_rejects_inconsistent_counts():
    with pytest.raises(ValueError, match="forward 1 computed 9 positions"):
        recompute.kv_grid([5, 9], prompt_len=5)
    with pytest.raises(ValueError, match="reads positions"):
        recompute.kv_grid([3, 1], prompt_len=5)  # the prefill never computed positions 3 and 4


def test_counts_from_instrument_match_rule(tiny_model):
    prompt = [3, 1, 4, 1, 5]
    plain, tokens_plain = recompute.count_generation(tiny_model, prompt, 6, use_cache=False)
    cached, tokens_cached = recompute.count_generation(tiny_model, prompt, 6, use_cache=True)
    assert tokens_plain == tokens_cached
    n_forwards = len(tokens_cached)
    assert plain == article_counts(5, n_forwards, use_cache=False)
    assert cached == article_counts(5, n_forwards, use_cache=True)


def test_recompute_widget_driven(tiny_model):
    class Tokens:  # the smallest tokenizer the builder needs
        def encode(self, text):
            return [int(ch) for ch in text]

        def tokens(self, ids):
            return [f"t{i}" for i in ids]

    box = recompute.recompute_widget(tiny_model, Tokens(), prompt="31415", max_new_tokens=4)
    assert box.step_slider.max == 3  # four generated tokens need four forward calls
    box.step_slider.value = 2
    box.cache_toggle.value = False
    assert box.state.counts_text == "computed 7 · recomputed 11 · read from cache 0"
    assert box.counts_view.value == box.state.counts_text
    box.cache_toggle.value = True
    assert box.state.totals == {NEW: 7, RECOMPUTED: 0, CACHED: 11}
    box.step_slider.value = 0
    assert box.state.counts_text == "computed 5 · recomputed 0 · read from cache 0"
    assert box.grid_view.value.count("kv-new") == 5
    assert "llminfer-recompute-step" in box.step_slider._dom_classes
    assert "llminfer-recompute-cache" in box.cache_toggle._dom_classes
    assert "llminfer-recompute-counts" in box.counts_view._dom_classes


# ---- chapter 04: memory calculator ----------------------------------------------------------

def test_memory_estimate_against_hand_count():
    cfg = llminfer.get_preset("llama-3-8b")  # 32 layers, 8 K/V heads of width 128
    est = memory.memory_estimate(cfg, context_len=8192, batch_size=4, dtype=torch.float16)
    assert est.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert est.kv_bytes == 131072 * 8192 * 4
    assert est.weight_bytes == cfg.n_params() * 2
    assert est.total_bytes == est.kv_bytes + est.weight_bytes


def test_memory_estimate_matches_allocated_cache(tiny_model):
    cfg = tiny_model.config
    est = memory.memory_estimate(cfg, context_len=cfg.max_seq_len, batch_size=3, dtype=tiny_model.dtype)
    cache = tiny_model.new_cache(batch_size=3)
    allocated = sum(t.untyped_storage().nbytes() for t in list(cache.k) + list(cache.v))
    assert est.kv_bytes == allocated
    params = sum(p.numel() * p.element_size() for p in tiny_model.parameters())
    assert est.weight_bytes == params


def test_memory_widget_driven():
    box = memory.build_memory_widget(default="llama-3-8b")
    box.dtype_pick.value = "float16"
    box.batch.value = 4
    box.context.value = 8192
    assert box.state.kv_bytes == 2 * 32 * 8 * 128 * 2 * 8192 * 4
    assert "4 GiB" in box.result.value  # 4 * 8192 * 128 KiB
    box.dtype_pick.value = "float32"
    assert box.state.kv_bytes == 2 * 32 * 8 * 128 * 4 * 8192 * 4
    small = min(llminfer.PRESETS, key=lambda name: llminfer.PRESETS[name].max_seq_len)
    box.model_pick.value = small
    assert box.context.max == llminfer.PRESETS[small].max_seq_len
    assert box.context.value <= box.context.max


# ---- chapter 04: timing widget --------------------------------------------------------------

def test_time_generation_makes_the_tokens_generate_makes(tiny_model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = llminfer.generate(tiny_model, prompt, max_new_tokens=6).token_ids
    for use_cache in (True, False):
        run = latency.time_generation(tiny_model, prompt, 6, use_cache=use_cache)
        assert isinstance(run, llminfer.GenerationResult) and run.token_ids == reference
        steps = latency.step_times(run)
        assert len(steps) == 6 and all(s > 0 for s in steps)
        assert run.tpot_s == pytest.approx(sum(steps[1:]) / 5)   # (E2E - TTFT) / (tokens - 1)


def test_context_sweep_shapes(tiny_model):
    sweep = latency.context_sweep(tiny_model, [1, 8, 32], repeats=2, progress=False)
    assert sweep["context_len"] == [1, 8, 32]
    assert len(sweep["cached_s"]) == len(sweep["recomputed_s"]) == 3
    assert all(s > 0 for s in sweep["cached_s"] + sweep["recomputed_s"])
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        latency.context_sweep(tiny_model, [65], progress=False)


@pytest.fixture
def small_machine(monkeypatch):
    """A machine reporting 16 GiB free, whatever the test host has: refusals must not depend on its RAM."""
    monkeypatch.setattr(llminfer.device, "free_memory_bytes", lambda device: 16 * 2**30)


def test_plan_run_refuses_before_allocating(small_machine):
    cfg = llminfer.get_preset("llama-3-70b")
    needed = latency.estimate_run_bytes(cfg, 128, 16, torch.float32)
    assert needed > cfg.n_params() * 4  # weights alone are 4 bytes a parameter
    with pytest.raises((MemoryError, ValueError), match="needs .* GiB"):
        latency.plan_run(cfg, 128, 16, "cpu", torch.float32)
    with pytest.raises(ValueError, match="max_seq_len=64"):
        latency.plan_run(tiny_config(), 60, 10, "cpu", torch.float32)


def test_latency_widget_run_and_refusals(monkeypatch, small_machine):
    shapes = {"tiny": tiny_config(), "llama-3-70b": llminfer.get_preset("llama-3-70b")}
    box = latency.build_latency_widget(shapes, default="tiny")
    assert box.prompt_len.max + box.new_tokens.value <= 64  # bounded by the model's max_seq_len
    box.prompt_len.value, box.new_tokens.value = 12, 5
    box.device_pick.value = "cpu"
    box.run_button.click()
    runs, summary = box.state.runs, box.state.summary
    assert runs["cached"].token_ids == runs["recomputed"].token_ids
    assert len(latency.step_times(runs["cached"])) == len(latency.step_times(runs["recomputed"])) == 5
    assert summary["total_speedup"] == pytest.approx(runs["recomputed"].e2e_s / runs["cached"].e2e_s)
    # FLOP prediction: without a cache step i redoes the whole 12 + i token context, so it must exceed 1
    assert summary["predicted_speedup"] > 1
    assert "TTFT" in box.summary_view.value and "llminfer-latency-run" in box.run_button._dom_classes

    box.model_pick.value = "llama-3-70b"  # 70 B parameters in float32 cannot fit in this machine's memory
    assert box.prompt_len.max == 1024     # on a CPU the prompt slider stops at 1024 tokens
    box.run_button.click()
    assert box.state.runs is None and "needs" in box.state.message and "GiB" in box.state.message

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    box.model_pick.value = "tiny"
    box.device_pick.value = "cuda"
    box.run_button.click()
    assert box.state.runs is None and "no CUDA GPU" in box.state.message
    assert "no CUDA GPU" in box.summary_view.value


def test_reference_results_read_from_bench_reports(tmp_path):
    import json

    gpu = {"schema": 1, "device_name": "some-gpu", "machine": {"gpu": "Some GPU"}, "shape": {"name": "llama-3.2-1b"},
           "dtype": "bfloat16", "scaling": [{"context_len": 255, "cached_s": 0.002, "recompute_s": 0.004},
                                            {"context_len": 127, "cached_s": 0.002, "recompute_s": 0.003}]}
    cpu = {**gpu, "device_name": "cpu-x", "machine": {"cpu": "x"}}
    (tmp_path / "some-gpu.json").write_text(json.dumps(gpu))
    (tmp_path / "cpu-x.json").write_text(json.dumps(cpu))
    (tmp_path / "broken.json").write_text("{not json")
    refs = latency.load_reference_results(tmp_path)
    assert [r["name"] for r in refs] == ["Some GPU, llama-3.2-1b, bfloat16"]
    assert refs[0]["context_len"] == [128, 256] and refs[0]["recomputed_s"] == [0.003, 0.004]
    assert len(latency.load_reference_results(tmp_path, gpu_only=False)) == 2


def test_memory_widget_on_a_missing_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    box = memory.build_memory_widget(device="cuda", default="llama-3-8b")
    assert "CUDA is not available" in box.message.value
    box.batch.value = 2
    assert box.state.kv_bytes == 2 * 32 * 8 * 128 * 2 * box.context.value * 2    # the estimate still works
    assert "free" not in box.result.value


def test_recompute_widget_refuses_no_new_tokens_in_the_widget(tiny_model):
    from small_models import word_tokenizer

    tokenizer = word_tokenizer(64)
    for bad in (0, -2, True):
        box = recompute.recompute_widget(tiny_model, tokenizer, "t1 t2 t3", max_new_tokens=bad)
        assert "at least one new token" in box.message.value and box.state is None
    box = recompute.recompute_widget(tiny_model, tokenizer, "", max_new_tokens=3)
    assert "holds no tokens" in box.message.value
    box = recompute.recompute_widget(tiny_model, tokenizer, "t1 t2 t3", max_new_tokens=62)
    assert "max_seq_len=64" in box.message.value
