"""The MoE bench helper: both implementations timed in one run, each case beside the bytes its routing reads; and
`python -m llminfer.bench moe`, which writes them as a report."""
from __future__ import annotations

import json

import pytest
import torch

import llminfer
from llminfer import bench
from llminfer.bench.moe import ExpertTiming, experts_bytes_read, time_experts
from llminfer.moe import MoEFeedForward

TINY = llminfer.ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=48,
                            model_type="qwen3_moe", n_experts=8, n_experts_per_tok=2, moe_hidden_dim=16)


def test_every_case_has_both_contenders_and_the_bytes_of_its_routing():
    rows = time_experts(TINY, batch_sizes=(1, 8), prompt_len=4, rounds=1, native=False)
    assert [(r.phase, r.batch_size, r.tokens) for r in rows] == [("decode", 1, 1), ("decode", 8, 8),
                                                                ("prefill", 1, 4), ("prefill", 8, 32)]
    expert = 3 * 32 * 16 * 4                                            # gate, up, down in float32
    for row in rows:
        assert isinstance(row, ExpertTiming) and set(row.seconds) == {"loop", "grouped"}
        assert all(s > 0 for s in row.seconds.values())
        assert 2 <= row.distinct_experts <= min(8, 2 * row.tokens)
        assert row.bytes_read == 8 * 32 * 4 + row.distinct_experts * expert + 2 * row.tokens * 32 * 4
    assert rows[0].distinct_experts == 2                                # one token reads its own k experts


def test_bytes_read_counts_each_chosen_expert_once_and_the_shared_expert():
    moe = MoEFeedForward(32, 8, 2, 16, softmax_before_topk=True, normalize=True, shared_expert_dim=24)
    ids = torch.tensor([[0, 3], [3, 5], [0, 5]])                        # experts 0, 3, 5: three, not six
    shared = 3 * 32 * 24 * 4
    assert experts_bytes_read(moe, ids, 3) == 8 * 32 * 4 + 3 * 3 * 32 * 16 * 4 + shared + 2 * 3 * 32 * 4


TINY_FLAGS = ["--dim", "32", "--experts", "8", "--top-k", "2", "--expert-dim", "16", "--prompt-len", "4"]


def test_the_command_writes_the_report_of_every_case(tmp_path, capsys):
    status = bench.main(["moe", *TINY_FLAGS, "--batch-sizes", "1", "8", "--rounds", "1", "--no-native",
                         "--out", str(tmp_path)])
    assert status == 0
    (json_path,) = tmp_path.glob("moe-*.json")
    assert json_path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads(json_path.read_text())
    assert report["layer"] == {"dim": 32, "n_experts": 8, "n_experts_per_tok": 2, "moe_hidden_dim": 16}
    assert json_path.name == f"moe-{report['slug']}.json" and report["machine"]["cpu_class"] == report["slug"]
    assert [(r["phase"], r["batch_size"], r["tokens"]) for r in report["rows"]] == [
        ("decode", 1, 1), ("decode", 8, 8), ("prefill", 1, 4), ("prefill", 8, 32)]
    expert = 3 * 32 * 16 * 4
    for row in report["rows"]:
        assert set(row["seconds"]) == {"loop", "grouped"}
        assert row["bytes_read"] == 8 * 32 * 4 + row["distinct_experts"] * expert + 2 * row["tokens"] * 32 * 4
        assert row["grouped_over_loop"] == pytest.approx(row["seconds"]["loop"] / row["seconds"]["grouped"])
    met = all(r["grouped_over_loop"] > 1 for r in report["rows"] if r["batch_size"] == 8)
    assert report["target"] == {"grouped faster than the loop at batch >= 8": met}
    printed = capsys.readouterr().out
    assert "loop/grouped" in printed and "grouped faster than the loop at batch >= 8: " in printed and f"wrote {json_path}" in printed


def test_the_command_refuses_a_bad_layer_before_timing(tmp_path, capsys):
    for flags, named in ((["--top-k", "9"], "n_experts_per_tok"), (["--rounds", "0"], "--rounds 0")):
        with pytest.raises(SystemExit) as stop:
            bench.main(["moe", *TINY_FLAGS, *flags, "--out", str(tmp_path)])
        assert stop.value.code == 2 and named in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
