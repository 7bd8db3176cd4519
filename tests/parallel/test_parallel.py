"""Tensor and pipeline parallelism with real processes (2 gloo ranks): same logits and tokens as one process,
each rank holding and reading about half the weights, and a launcher that tears everything down."""
from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import llminfer
from llminfer import parallel
from llminfer.parallel import WorkerError, launch

launch_module = importlib.import_module("llminfer.parallel.launch")
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "The capital of Peru is", "The capital of Japan is", "The capital of Chad is"]


@pytest.fixture(scope="module")
def bundled():
    model, tokenizer = llminfer.load_pretrained("tiny-capitals")
    ids = [tokenizer.encode(text)[:5] for text in PROMPTS]          # (4, 5): one length for the batch
    return model, ids


def _reference(model, ids, new_tokens):
    result = llminfer.generate(model, ids, max_new_tokens=new_tokens, return_logits=True, ignore_eos=True)
    return result.token_ids, torch.stack(result.logits)              # (N, B, vocab)


def _random_model(folder: Path, **shape) -> Path:
    config = llminfer.ModelConfig(max_seq_len=64, **shape)
    model = llminfer.Transformer(config).init_weights(seed=3, std=0.08)
    return llminfer.save_pretrained(model, folder)


# --- tensor parallel --------------------------------------------------------------------------------------------

def test_tp2_bundled_logits_tokens_and_half_the_weights(bundled):
    model, ids = bundled
    tokens, logits = _reference(model, ids[:2], 6)
    ranks = parallel.run_tensor_parallel("tiny-capitals", ids[:2], max_new_tokens=6)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert logits.abs().max() > 1.0                                   # real logits, not a vacuous comparison
    for rank in ranks:
        assert rank["token_ids"] == tokens
        assert (rank["logits"] - logits).abs().max() < 1e-5
        assert rank["local_heads"] == 2 and rank["local_kv_heads"] == 1
        assert abs(rank["resident_bytes"] / full_bytes - 0.5) < 0.01   # norms are the only copies
        assert abs(rank["bytes_read"] / rank["checkpoint_bytes"] - 0.5) < 0.01
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])         # the collectives leave every rank alike
    assert [r["kv_head_range"] for r in ranks] == [(0, 1), (1, 2)]
    assert ranks[0]["cache_bytes"] * 2 == model.new_cache(1).nbytes   # each rank caches its own K/V heads


def test_tp2_random_gqa_logits_and_tokens(tmp_path):
    # 8 query heads sharing 2 K/V heads (4 per group): each rank gets 4 query heads and their one K/V head
    folder = _random_model(tmp_path / "gqa", vocab_size=1024, dim=128, n_layers=3, n_heads=8, n_kv_heads=2,
                           hidden_dim=384)
    model, _ = llminfer.load_pretrained(folder, load_tokenizer=False)
    ids = [[5, 99, 1000, 7, 400, 12], [8, 8, 3, 900, 1, 2]]
    tokens, logits = _reference(model, ids, 6)
    ranks = parallel.run_tensor_parallel(str(folder), ids, max_new_tokens=6)
    assert logits.std() > 0.1
    for rank in ranks:
        assert rank["token_ids"] == tokens
        assert (rank["logits"] - logits).abs().max() < 1e-5
        assert rank["local_heads"] == 4 and rank["local_kv_heads"] == 1
    assert [r["kv_head_range"] for r in ranks] == [(0, 1), (1, 2)]


def test_shard_on_read_holds_and_peaks_at_about_half(tmp_path):
    # ~140 MB in float32: a rank that read the whole model before slicing it would peak above its size; one
    # that reads its slices peaks at its half, plus a few MB the first load of anything costs
    folder = _random_model(tmp_path / "wide", vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=2,
                           hidden_dim=2048)
    model, _ = llminfer.load_pretrained(folder, load_tokenizer=False)
    ids = [[5, 99, 1000, 7, 4000, 12]]
    tokens, logits = _reference(model, ids, 2)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    ranks = parallel.run_tensor_parallel(str(folder), ids, max_new_tokens=2)
    for rank in ranks:
        assert rank["token_ids"] == tokens
        # sums of 2048 float32 terms added in another order: the same relative rounding, on logits of about 5
        assert (rank["logits"] - logits).abs().max() < 1e-5 * logits.abs().max()
        assert abs(rank["resident_bytes"] / full_bytes - 0.5) < 0.01
        assert abs(rank["bytes_read"] / rank["checkpoint_bytes"] - 0.5) < 0.01
        if rank["load_peak_bytes"] is not None:                       # Linux: the peak of the load itself
            assert rank["load_peak_bytes"] < 0.75 * full_bytes, rank["load_peak_bytes"] / full_bytes


def test_tp2_random_mqa_with_bias_and_tied_head_copies_the_kv_head(tmp_path):
    # one K/V head for 4 query heads: both ranks hold a copy of it; Qwen2's q/k/v biases split with their rows
    folder = _random_model(tmp_path / "mqa", vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=1,
                           hidden_dim=128, model_type="qwen2", qkv_bias=True, tie_embeddings=True)
    model, _ = llminfer.load_pretrained(folder, load_tokenizer=False)
    ids = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]]
    tokens, logits = _reference(model, ids, 5)
    ranks = parallel.run_tensor_parallel(str(folder), ids, max_new_tokens=5)
    assert logits.std() > 0.1
    for rank in ranks:
        assert rank["token_ids"] == tokens
        assert (rank["logits"] - logits).abs().max() < 1e-5
        assert rank["kv_head_range"] == (0, 1) and rank["local_heads"] == 2


# --- pipeline parallel ------------------------------------------------------------------------------------------

def test_pp2_with_1_and_4_micro_batches(bundled):
    model, ids = bundled
    tokens, logits = _reference(model, ids, 5)
    stages = parallel.run_pipeline_parallel("tiny-capitals", ids, max_new_tokens=5, micro_batches=(1, 4))
    assert [s["layers"] for s in stages] == [(0, 2), (2, 4)]
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for stage in stages:
        assert abs(stage["resident_bytes"] / full_bytes - 0.5) < 0.01   # half the layers, one end of the vocabulary
    # one micro-batch computes exactly what one process computes on the whole batch
    assert stages[1]["runs"][1]["token_ids"] == tokens and stages[0]["runs"][1]["token_ids"] == tokens
    assert (stages[1]["runs"][1]["logits"] - logits).abs().max() < 1e-5
    # four micro-batches of one sequence compute what one process computes on each sequence alone ...
    alone = torch.cat([_reference(model, [row], 5)[1] for row in ids], dim=1)     # (N, B, vocab)
    assert stages[1]["runs"][4]["token_ids"] == tokens and stages[0]["runs"][4]["token_ids"] == tokens
    assert (stages[1]["runs"][4]["logits"] - alone).abs().max() < 1e-5
    # ... which differs from a batch of four by float32 rounding only (the matrix kernels tile other shapes)
    assert (stages[1]["runs"][4]["logits"] - logits).abs().max() < 1e-4
    for n_micro in (1, 4):
        timeline = parallel.stage_timeline(stages, n_micro, step=0)
        assert len(timeline["events"]) == 2 * n_micro                   # each stage saw each micro-batch once
        assert 0.0 < timeline["bubble"] < 1.0
    # activations crossed once per micro-batch per step: (B, T, dim) floats for the prompt, (B, 1, dim) after
    dim, (batch, prompt_len) = model.config.dim, (len(ids), len(ids[0]))
    assert stages[0]["runs"][4]["sent_bytes"] == batch * dim * 4 * (prompt_len + 4)


# --- the launcher -----------------------------------------------------------------------------------------------

def fails_on_rank_1(ctx):
    if ctx.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    torch.distributed.barrier()                                       # rank 0 waits for a peer that is gone
    return "unreachable"


def sleeps(ctx, seconds):
    time.sleep(seconds)


def listening_addresses(ctx):
    x = torch.ones(8)
    torch.distributed.all_reduce(x)
    return sorted({conn.laddr.ip for conn in psutil.Process().net_connections(kind="tcp")
                   if conn.status == psutil.CONN_LISTEN}), float(x[0])


def _workers_alive() -> list[int]:
    """Worker processes still running: children of multiprocessing's fork server (which itself outlives each
    run), or direct children of this process other than the fork server and the resource tracker."""
    alive = []
    for child in psutil.Process().children():
        try:
            command = " ".join(child.cmdline())
            below = child.children() if "forkserver" in command else [] if "resource_tracker" in command else [child]
            alive += [p.pid for p in below if p.status() != psutil.STATUS_ZOMBIE]
        except psutil.NoSuchProcess:
            continue
    return alive


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_failing_rank_raises_its_traceback_and_everything_is_torn_down():
    port = _free_port()
    with pytest.raises(WorkerError, match="rank 1 fails on purpose"):   # 'spawn': the start method without
        launch(fails_on_rank_1, world_size=2, port=port, timeout_s=60, start_method="spawn")   # a fork server
    assert _workers_alive() == []
    with socket.socket() as sock:                                     # the rendezvous port was given back
        sock.bind(("127.0.0.1", port))


def test_a_run_past_its_timeout_is_ended():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="did not finish within timeout_s=1.5"):
        launch(sleeps, (60,), world_size=2, timeout_s=1.5)
    assert time.monotonic() - start < 45          # the sleep lasts 60 s: only the timeout ends it sooner, at any load
    assert _workers_alive() == []


def test_every_socket_listens_on_loopback_only():
    ranks = launch(listening_addresses, world_size=2)
    for addresses, total in ranks:
        assert total == 2.0
        assert addresses and set(addresses) <= {"127.0.0.1", "::ffff:127.0.0.1"}, addresses


def test_communication_is_measured_at_every_size():
    sizes = [4, 1 << 16, 1 << 24]
    measured = parallel.measure_communication(sizes, repeats=2, budget_s=0.01, rounds=2)
    assert measured["sizes"] == sizes
    for key in ("allreduce_s", "sendrecv_s"):                 # each size keeps its fastest round
        assert [len(r) for r in measured["rounds"][key]] == [2, 2, 2]
        assert measured[key] == [min(r) for r in measured["rounds"][key]]
    for key in ("allreduce_s", "sendrecv_s"):
        times = measured[key]
        assert len(times) == 3 and all(t > 0 for t in times), (key, times)
        # a physical floor, whatever the load: each rank receives at least 16 MiB, and no loopback or
        # shared-memory path between two processes moves it at 200 GB/s (the fit's logic is tested on
        # synthetic timings in test_parallel_checks)
        assert times[2] > (1 << 24) / 200e9, (key, times)
    fit = parallel.cost_model.fit_alpha_beta(sizes, measured["allreduce_s"])
    assert fit.alpha_s >= 0


def test_torchrun_runs_the_same_worker():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               "-m", "llminfer.parallel", "tp", "--new-tokens", "3", "--check"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tp over 2 processes (gloo)" in done.stdout and "same tokens as one process: True" in done.stdout


def test_tp2_collective_time_is_waiting_plus_moving(bundled):
    timed = parallel.run_tensor_parallel("tiny-capitals", [[5, 6, 7, 8]], max_new_tokens=2, timing_repeats=1)
    waits = parallel.collective_waits([rank["decode"]["spans"] for rank in timed])
    for rank, split in zip(timed, waits):
        (spans,) = rank["decode"]["spans"]                # one timed step
        assert len(spans) == rank["decode"]["collectives"] == 10
        assert split["wait_s"] >= 0 and split["transfer_s"] > 0
        assert split["wait_s"] + split["transfer_s"] == pytest.approx(rank["decode"]["comm_s"], rel=1e-9, abs=1e-12)
