"""Prefill–decode disaggregation: K/V computed in one place continue decoding in another, token for token."""
from __future__ import annotations

import random

import pytest
import torch

import llminfer
from llminfer import costs
from llminfer.engine import LLMEngine, SamplingParams
from llminfer.serve.disagg import DisaggregatedEngine, ModelSpec, ShippingCache, install_prefilled

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
        now = engine.clock()
        ids.append(install_prefilled(engine, prompt, params, first, kv, now, now))
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
    assert install_prefilled(engine, list(range(3, 40)), params, 5, kv, 0.0, 0.0) is not None
    assert install_prefilled(engine, list(range(3, 40)), params, 5, kv, 0.0, 0.0) is None   # max_num_seqs reached
    with pytest.raises(ValueError, match="expected"):
        install_prefilled(engine, list(range(3, 41)), params, 5, kv, 0.0, 0.0)
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
        assert engine.generate([prompts[0]], params)[0].token_ids == colocated[0].token_ids   # still serving
    assert all(not p.is_alive() for p in engine._processes) and engine._processes == []


def test_model_specs_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        ModelSpec()
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec(name="tiny-capitals", dtype="float99")
