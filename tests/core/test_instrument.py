"""Counting K/V computations: the numbers chapter 03 is built on."""
from __future__ import annotations

import llminfer
from small_models import SMALL_CONFIGS, random_model
from llminfer import instrument


def test_counts_follow_the_article_table():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    prompt = [4, 8, 15, 16, 23]
    with instrument.count_kv(model) as without_cache:
        llminfer.generate(model, prompt, max_new_tokens=4, use_cache=False)
    with instrument.count_kv(model) as with_cache:
        llminfer.generate(model, prompt, max_new_tokens=4, use_cache=True)
    assert without_cache.per_forward == [5, 6, 7, 8]        # every step recomputes the whole context
    assert with_cache.per_forward == [5, 1, 1, 1]           # prefill once, then one new position a step
    assert without_cache.total == 26 and with_cache.total == 8
    assert without_cache.cumulative == [5, 11, 18, 26]
    n_layers = model.config.n_layers
    assert without_cache.per_layer[1] == [6] * n_layers
    assert without_cache.total_all_layers == 26 * n_layers


def test_counts_scale_with_batch_and_stop_outside_the_block():
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    import torch
    with instrument.count_kv(model) as counts:
        model(torch.zeros(3, 4, dtype=torch.long))
    model(torch.zeros(1, 4, dtype=torch.long))             # after the block: not counted
    assert counts.per_forward == [12]
