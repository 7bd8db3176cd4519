"""Prefill–decode disaggregation: K/V computed in one place continue decoding in another, token for token."""
from __future__ import annotations

import random

import pytest
import torch

import llminfer
from llminfer import costs
from llminfer.engine import LLMEngine, SamplingParams
from llminfer.serve.disagg import DisaggregatedEngine, ModelSpec, ShippingCache

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def bundled():
    return llminfer.load_pretrained("tiny-capitals")


def prompts_for(tokenizer, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    texts = [tokenizer.encode(t) for t in ("The capital of France", "I love", "What is the capital of Peru?")]
    return texts + [[rng.randrange(3, tokenizer.vocab_size) for _ in range(n)] for n in (1, 16, 17, 63, 100)]


def shipped(model, prompt):
    """Runs the prefill through a ShippingCache whose 'wire' is a list; returns logits and per-layer (k, v)."""
    sent = []
    cache = ShippingCache(model.config.n_layers, model.config.max_seq_len, send=lambda t: sent.append(t.clone()))
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache, last_only=True)[:, -1]
    cache.wait()
    return logits, [(sent[2 * i], sent[2 * i + 1]) for i in range(model.config.n_layers)], cache


def test_installed_kv_continues_exactly_like_a_local_prefill(bundled):
    model, tokenizer = bundled
    params = SamplingParams(max_new_tokens=20, eos_token_id=tokenizer.eos_token_id)
    prompts = prompts_for(tokenizer)
    expected = LLMEngine(model, num_blocks=96).generate(prompts, params)
    engine = LLMEngine(model, num_blocks=96)
    ids = []
    for prompt in prompts:
        logits, kv, cache = shipped(model, prompt)
        assert cache.sent_bytes == costs.kv_cache_bytes(model.config, len(prompt), 4) \
            == 2 * 4 * 2 * 32 * len(prompt) * 4                               # 2 · layers · kv heads · head_dim · P · 4
        first = int(logits.argmax(-1))
        if first == tokenizer.eos_token_id:
            ids.append(None)
            continue
        ids.append(engine.add_prefilled(prompt, params, first, kv))
    while engine.has_unfinished():
        engine.step()
    for request_id, reference in zip(ids, expected):
        assert request_id is not None
        output = engine.pop_output(request_id)
        assert output.token_ids == reference.token_ids
    assert engine.stats.blocks_used == 0
    engine.block_manager.check_consistency([])
    # the decode engine never ran a prompt: every step it ran was a decode
    assert all(kind == "decode" for record in engine.trace for _, kind, _ in record.entries)


def test_install_waits_for_room_and_checks_shapes(bundled):
    model, tokenizer = bundled
    engine = LLMEngine(model, num_blocks=8, max_num_seqs=1)               # 8 blocks of 16 = one full context
    params = SamplingParams(max_new_tokens=4)
    _, kv, _ = shipped(model, list(range(3, 40)))
    assert engine.add_prefilled(list(range(3, 40)), params, 5, kv, 0.0, 0.0) is not None
    assert engine.add_prefilled(list(range(3, 40)), params, 5, kv, 0.0, 0.0) is None   # max_num_seqs reached
    with pytest.raises(ValueError, match="expected"):
        engine.add_prefilled(list(range(3, 41)), params, 5, kv, 0.0, 0.0)
    cfg = model.config
    assert costs.kv_cache_bytes(cfg, 1, 4) == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4


def test_workers_in_separate_processes_equal_the_colocated_engine(bundled):
    model, tokenizer = bundled
    prompts = prompts_for(tokenizer, seed=1)
    params = SamplingParams(max_new_tokens=24, eos_token_id=tokenizer.eos_token_id)
    colocated = LLMEngine(model, num_blocks=96).generate(prompts, params)
    with DisaggregatedEngine(ModelSpec(name="tiny-capitals"), dict(num_blocks=96)) as engine:
        outputs = engine.generate(prompts, params)
        assert [o.token_ids for o in outputs] == [c.token_ids for c in colocated]
        assert [tokenizer.decode(o.token_ids) for o in outputs[:2]] == [" is Paris.", " AI."]
        assert [o.finish_reason for o in outputs] == [c.finish_reason for c in colocated]
        for output, prompt in zip(outputs, prompts):
            record = engine.transfers[output.request_id]
            assert record.nbytes == costs.kv_cache_bytes(model.config, len(prompt), 4)
            assert output.ttft_s > 0 and len(output.itl_s) == len(output.token_ids) - 1
        long_running = engine.add_request(list(range(3, 20)), SamplingParams(max_new_tokens=100))
        while not engine.step(timeout_s=0.1):
            pass
        assert engine.abort(long_running)
        assert engine.pop_output(long_running).finish_reason == "abort"
        assert not engine.abort(long_running)                         # already finished: as LLMEngine answers
        with pytest.raises(ValueError, match="unknown request id 999"):
            engine.abort(999)
        assert engine.generate([prompts[0]], params)[0].token_ids == colocated[0].token_ids   # still serving
    assert all(not p.is_alive() for p in engine._processes) and engine._processes == []


def test_model_specs_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        ModelSpec()
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec(name="tiny-capitals", dtype="float99")


# --- the pair behind the OpenAI server ------------------------------------------------------------------------

SERVED = ["The capital of France", "What is the capital of Peru?", "I love", "The capital of Japan"]


def test_the_server_fronts_the_pair_with_the_single_engines_greedy_text(bundled):
    import httpx
    import openai

    from llminfer.serve.process import ServerProcess
    model, tokenizer = bundled
    params = SamplingParams(max_new_tokens=12, eos_token_id=tokenizer.eos_token_id)
    single = LLMEngine(model, num_blocks=64).generate([tokenizer.encode(t) for t in SERVED], params)
    expected = [tokenizer.decode(o.token_ids) for o in single]
    argv = ["--disaggregated", "--model", "tiny-capitals", "--threads", "1", "--num-blocks", "64"]
    with ServerProcess(argv) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
        plain = [client.completions.create(model="tiny-capitals", prompt=t, max_tokens=12, temperature=0)
                 for t in SERVED]
        assert [r.choices[0].text for r in plain] == expected
        assert [r.usage.completion_tokens for r in plain] == [len(o.token_ids) for o in single]
        assert [r.choices[0].finish_reason for r in plain] == [o.finish_reason for o in single]
        for text, want in zip(SERVED, expected):
            chunks = list(client.completions.create(model="tiny-capitals", prompt=text, max_tokens=12, temperature=0,
                                                    stream=True))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        messages = [{"role": "user", "content": SERVED[0]}]
        chunks = list(client.chat.completions.create(model="tiny-capitals", messages=messages, temperature=0,
                                                     max_tokens=12, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected[0]
        metrics = httpx.get(server.url + "/metrics").text            # the pair's real stats behind the gauges
        assert "llminfer_kv_blocks_total 64.0" in metrics and "llminfer_kv_blocks_used 0.0" in metrics
        assert "DisaggregatedEngine" in server.log()
    assert server.process.returncode == 0                            # SIGINT: the workers were stopped too


def test_the_pair_reports_real_stats(bundled):
    model, tokenizer = bundled
    prompts = [tokenizer.encode(t) for t in SERVED]
    params = SamplingParams(max_new_tokens=6)                        # no eos: 6 tokens each
    with DisaggregatedEngine(ModelSpec(name="tiny-capitals"), dict(num_blocks=48)) as engine:
        before = engine.stats
        assert (before.num_blocks, before.blocks_used, before.steps, before.num_finished) == (48, 0, 0, 0)
        ids = [engine.add_request(p, params) for p in prompts]
        assert engine.stats.num_waiting == len(prompts) and engine.stats.num_running == 0
        seen_running = 0
        while engine.has_unfinished():
            engine.step(timeout_s=0.05)
            seen_running = max(seen_running, engine.stats.num_running)
            assert engine.stats.blocks_used <= 48
        outputs = [engine.pop_output(i) for i in ids]
        stats = engine.stats
        assert seen_running >= 1
        assert stats.num_finished == len(prompts) and stats.num_waiting == stats.num_running == 0
        assert stats.blocks_used == 0 and stats.steps >= 5                # 5 decode steps at least, on the worker
        # prompts on the prefill worker, then one position per decode step (the first token's comes at the first)
        assert stats.tokens_computed == sum(len(p) for p in prompts) + sum(len(o.token_ids) - 1 for o in outputs)
        # a request prefilled elsewhere goes straight to the decode worker
        logits, kv, _ = shipped(model, prompts[0])
        first = int(logits.argmax(-1))
        request_id = engine.add_prefilled(prompts[0], params, first, kv)
        assert engine.stats.num_waiting == 1
        while engine.has_unfinished():
            engine.step(timeout_s=0.05)
        output = engine.pop_output(request_id)
        assert output.token_ids == outputs[0].token_ids and request_id not in engine.transfers
        assert engine.stats.num_finished == len(prompts) + 1
        with pytest.raises(ValueError, match="kv must hold 4"):
            engine.add_prefilled(prompts[0], params, first, kv[:2])


def test_the_flag_is_checked():
    from llminfer.serve.__main__ import parse_args
    assert parse_args(["--disaggregated"]).disaggregated and not parse_args([]).disaggregated
    with pytest.raises(SystemExit):
        parse_args(["--disaggregated", "--device", "cuda"])


def test_make_serve_passes_its_args_on():
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    lines = subprocess.run(["make", "-n", "serve", "ARGS=--disaggregated --threads 2"], cwd=root, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    serve = [line for line in lines if "-m llminfer.serve" in line]
    assert len(serve) == 1 and serve[0].endswith("--port 8000 --disaggregated --threads 2")
    plain = subprocess.run(["make", "-n", "serve"], cwd=root, capture_output=True, text=True, check=True).stdout
    assert [line for line in plain.splitlines() if "-m llminfer.serve" in line][0].rstrip().endswith("--port 8000")
