"""Chapter 10 without processes: bad requests refused before anything starts, the split done by hand, the
pipeline's bubble and the α–β cost model against closed forms."""
from __future__ import annotations

import importlib
import math
import socket
import types

import psutil
import pytest
import torch
import torch.nn.functional as F

import llminfer
from llminfer import parallel
from llminfer.parallel import cost_model
from llminfer.parallel.pipeline import StageEvent

launch_module = importlib.import_module("llminfer.parallel.launch")
plan_module = importlib.import_module("llminfer.parallel.plan")


def config(**changes):
    fields = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=32)
    fields.update(changes)
    return llminfer.ModelConfig(**fields)


@pytest.fixture
def no_processes(monkeypatch):
    """Fails the test if anything tries to start a process; checks no process was left behind."""
    real_context = launch_module.process_context

    class Refusing:
        def __init__(self, context):
            self.Queue = context.Queue

        def Process(self, *args, **kwargs):
            raise AssertionError("a process was about to start")

    monkeypatch.setattr(launch_module, "process_context", lambda start_method: Refusing(real_context(start_method)))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


# --- refused before any process starts ----------------------------------------------------------------------

@pytest.mark.parametrize("changes, world_size, words", [
    (dict(), 3, ["4 attention heads", "not divisible by 3", "1, 2, 4"]),
    (dict(n_heads=12, n_kv_heads=3, dim=48), 2, ["3 K/V heads", "neither holds"]),
    (dict(hidden_dim=50), 4, ["hidden_dim=50", "not divisible by 4"]),
    (dict(vocab_size=66), 4, ["vocab_size=66", "not divisible by 4"]),
])
def test_tensor_parallel_refuses_splits_that_do_not_divide(changes, world_size, words):
    with pytest.raises(ValueError) as error:
        parallel.tensor_parallel_plan(config(**changes), world_size)
    for word in words:
        assert word in str(error.value)


def test_more_kv_heads_copies_than_splits_is_allowed():
    plan = parallel.tensor_parallel_plan(config(n_heads=8, n_kv_heads=2), 4)   # 4 ranks, 2 K/V heads
    assert plan.kv_replicas == 2 and plan.local_kv_heads == 1
    assert [plan.kv_head_range(r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # each rank's query heads read exactly the K/V head it holds (GQA groups of n_heads // n_kv_heads = 4)
    for rank in range(4):
        start, stop = plan.head_range(rank)
        assert {head // 4 for head in range(start, stop)} == set(range(*plan.kv_head_range(rank)))


def test_runs_refuse_bad_splits_before_starting_processes(no_processes):
    with pytest.raises(ValueError, match="not divisible by 3"):
        parallel.run_tensor_parallel("tiny-capitals", [[1, 2, 3]], world_size=3)
    with pytest.raises(ValueError, match="5 stages needs at least 5 layers.*n_layers=4"):
        parallel.run_pipeline_parallel("tiny-capitals", [[1, 2, 3]], n_stages=5)
    with pytest.raises(ValueError, match="4 micro-batches need at least 4 sequences"):
        parallel.run_pipeline_parallel("tiny-capitals", [[1, 2, 3]] * 2, micro_batches=(1, 4))
    with pytest.raises(ValueError, match="max_seq_len=128"):
        parallel.run_tensor_parallel("tiny-capitals", [[1] * 120], max_new_tokens=20)
    with pytest.raises(ValueError, match="outside the vocabulary of 1024"):
        parallel.run_tensor_parallel("tiny-capitals", [[1, 5000]])


def test_a_port_in_use_is_refused_before_starting(no_processes):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is already in use.*port=None"):
            parallel.run_tensor_parallel("tiny-capitals", [[1, 2]], port=port)
    with pytest.raises(ValueError, match="0..65535"):
        parallel.launch(parallel.workers.comm_worker, port=70000)


def test_nccl_without_gpus_is_refused(monkeypatch, no_processes):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'nccl' needs CUDA GPUs.*backend='gloo'"):
        parallel.run_tensor_parallel("tiny-capitals", [[1, 2]], backend="nccl")
    assert plan_module.default_backend(2) == "gloo"
    # one GPU cannot hold two NCCL ranks: the CPU path is the one to take
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    with pytest.raises(ValueError, match="2 processes need 2 GPUs, but this machine has 1"):
        parallel.check_backend("nccl", 2)
    assert plan_module.default_backend(2) == "gloo"
    with pytest.raises(ValueError, match="'gloo' \\(CPU\\) or 'nccl'"):
        parallel.check_backend("mpi", 2)


def _local_worker():
    def inner(ctx):
        return ctx.rank
    return inner


def test_workers_must_be_importable_and_arguments_sendable(no_processes):
    main_worker = types.FunctionType((lambda ctx: 0).__code__, {}, "from_a_notebook")
    main_worker.__module__, main_worker.__qualname__ = "__main__", "from_a_notebook"
    for worker, where in ((main_worker, "in a notebook"), (_local_worker(), "inside another function"),
                          (lambda ctx: 0, "as a lambda")):
        with pytest.raises(ValueError, match=where):
            parallel.launch(worker)
    with pytest.raises(ValueError, match="cannot be sent to another process"):
        parallel.launch(parallel.workers.comm_worker, args=(lambda: 0,))
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        parallel.launch(parallel.workers.comm_worker, world_size=0)


@pytest.mark.parametrize("threads", [0, -2, 1.5, "4", True])
def test_bad_thread_counts_are_refused_before_starting(no_processes, threads):
    with pytest.raises(ValueError, match=r"threads must be an integer >= 1, got"):
        parallel.launch(parallel.workers.comm_worker, threads=threads)


def test_fork_is_refused_as_a_start_method(monkeypatch):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="'fork' is refused"):
        parallel.launch(parallel.workers.comm_worker, start_method="fork")
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


# --- the split, by hand -------------------------------------------------------------------------------------

def test_shards_partition_every_weight():
    cfg = config(n_heads=8, n_kv_heads=2, qkv_bias=True, model_type="qwen2", tie_embeddings=True)
    full = llminfer.Transformer(cfg).init_weights(seed=1)
    full_params = sum(p.numel() for p in full.parameters())
    norms = sum(p.numel() for n, p in full.named_parameters() if "norm" in n)
    for world_size in (2, 4):
        total = 0
        for rank in range(world_size):
            shard = llminfer.Transformer(cfg).init_weights(seed=1)
            parallel.tensor_parallel(shard, rank=rank, world_size=world_size)
            total += sum(p.numel() for p in shard.parameters())
            attn = shard.layers[0].self_attn
            assert (attn.n_heads, attn.n_kv_heads) == (8 // world_size, max(1, 2 // world_size))
            assert shard.lm_head.weight is shard.embed_tokens.weight          # a tied head stays tied
            q0, q1 = shard.parallel.plan.head_range(rank)
            assert torch.equal(attn.q_proj.weight, full.layers[0].self_attn.q_proj.weight[q0 * 4:q1 * 4])
            assert torch.equal(attn.q_proj.bias, full.layers[0].self_attn.q_proj.bias[q0 * 4:q1 * 4])
        # every split weight is cut into pieces that add up to it; norms are held by every rank; with more ranks
        # than K/V heads, each K/V projection is held by world_size // n_kv_heads ranks
        kv_full = cfg.n_layers * 2 * (cfg.dim + 1) * cfg.n_kv_heads * cfg.head_dim    # k and v, weights and biases
        replicas = max(1, world_size // cfg.n_kv_heads)
        assert total == full_params + (world_size - 1) * norms + (replicas - 1) * kv_full


def test_mlp_partial_sums_add_up_to_the_full_output():
    cfg = config()
    full = llminfer.Transformer(cfg).init_weights(seed=2, std=0.2)
    x = torch.randn(1, 3, cfg.dim, generator=torch.Generator().manual_seed(0))
    partials = []
    for rank in range(2):
        shard = parallel.tensor_parallel(llminfer.Transformer(cfg).init_weights(seed=2, std=0.2), rank=rank,
                                         world_size=2)
        mlp = shard.layers[0].mlp
        hidden = F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)                   # (1, 3, hidden / 2): no communication
        partials.append(F.linear(hidden, mlp.down_proj.weight))             # (1, 3, dim): this rank's share
    assert torch.allclose(partials[0] + partials[1], full.layers[0].mlp(x), atol=1e-6)
    assert not torch.allclose(partials[0], full.layers[0].mlp(x), atol=1e-3)   # one share alone is not it


def test_a_split_model_without_a_group_says_how_to_run_it():
    shard = parallel.tensor_parallel(llminfer.Transformer(config()).init_weights(), rank=0, world_size=2)
    with pytest.raises(RuntimeError, match="no process group is initialised.*launch"):
        shard(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="already split"):
        parallel.tensor_parallel(shard, rank=0, world_size=2)


def test_one_rank_is_the_whole_model():
    cfg = config()
    full = llminfer.Transformer(cfg).init_weights(seed=4)
    alone = parallel.tensor_parallel(llminfer.Transformer(cfg).init_weights(seed=4))   # world of 1, no group
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(alone(ids), full(ids))


# --- pipeline ----------------------------------------------------------------------------------------------

def test_layers_split_as_evenly_as_possible():
    assert parallel.pipeline_plan(config(n_layers=7), 3).ranges() == [(0, 3), (3, 5), (5, 7)]
    assert parallel.split_micro_batches(10, 4) == [3, 3, 2, 2]


def gpipe_events(n_stages, n_micro, seconds=1.0):
    """The schedule of equal stages and free sends: stage s runs micro-batch m from (s + m) to (s + m + 1)."""
    return [StageEvent(s, 0, m, (s + m) * seconds, (s + m + 1) * seconds)
            for s in range(n_stages) for m in range(n_micro)]


@pytest.mark.parametrize("n_stages, n_micro", [(2, 1), (2, 4), (4, 8), (3, 3)])
def test_bubble_of_an_ideal_schedule_is_the_formula(n_stages, n_micro):
    measured = parallel.bubble_fraction(gpipe_events(n_stages, n_micro), n_stages)
    assert math.isclose(measured, parallel.ideal_bubble_fraction(n_stages, n_micro), rel_tol=1e-12)
    assert parallel.ideal_bubble_fraction(n_stages, n_micro) == (n_stages - 1) / (n_micro + n_stages - 1)


# --- the cost model ----------------------------------------------------------------------------------------

def test_fit_recovers_alpha_and_beta():
    alpha, beta = 40e-6, 3e9
    sizes = [4 * 4 ** i for i in range(13)]
    noise = [1.0, 1.04, 0.97, 1.02, 0.99, 1.01, 0.98, 1.03, 1.0, 0.96, 1.02, 1.0, 0.99]
    fit = cost_model.fit_alpha_beta(sizes, [(alpha + n / beta) * k for n, k in zip(sizes, noise)])
    assert abs(fit.alpha_s / alpha - 1) < 0.05 and abs(fit.bytes_per_s / beta - 1) < 0.05
    with pytest.raises(ValueError, match="at least two"):
        cost_model.fit_alpha_beta([4], [1e-5])


def test_allreduce_model_closed_form():
    link = cost_model.Link("test", 5e-6, 100e9, "node", "")
    assert cost_model.allreduce_seconds(1e6, 1, link) == 0.0
    assert math.isclose(cost_model.allreduce_seconds(1e6, 2, link), 5e-6 + 1e6 / 100e9)
    assert math.isclose(cost_model.allreduce_seconds(1e6, 8, link), 3 * 5e-6 + 2 * 7 / 8 * 1e6 / 100e9)


def test_tp_bytes_per_token_by_hand():
    llama70 = cost_model.SHAPES["llama-3-70b"]
    # 80 layers × 2 all-reduces × 8192 values × 2 bytes = 2.5 MiB per token at batch 1
    assert cost_model.tp_bytes_per_token(llama70, batch_size=1, dtype_bytes=2) == 80 * 2 * 8192 * 2
    kinds = {kind: (count, nbytes) for kind, count, nbytes in cost_model.tp_collectives(llama70, 8, 4, 1, 2)}
    assert kinds["all-reduce (attention, MLP)"] == (160, 4 * 8192 * 2)
    assert kinds["logits all-gather"] == (1, 4 * 128256 // 8 * 2)


def test_device_memory_against_the_parameter_count():
    shape = cost_model.SHAPES["llama-3-70b"]
    one = cost_model.device_memory(shape, 1, 1, dtype_bytes=2)
    assert one.weight_bytes == shape.n_params() * 2                     # unsplit: the whole model
    tp8 = cost_model.device_memory(shape, 8, 1, context_len=8192, batch_size=1, dtype_bytes=2)
    assert abs(tp8.weight_bytes / (shape.n_params() * 2 / 8) - 1) < 0.001   # an eighth, norms aside
    assert tp8.kv_bytes == llminfer.kv_cache_bytes(shape, 8192, 2, 1) / 8   # one K/V head each
    tp16 = cost_model.device_memory(shape, 16, 1, context_len=8192, dtype_bytes=2)
    assert tp16.kv_bytes == tp8.kv_bytes                                  # 8 K/V heads: copies past TP 8


def test_which_layouts_fit_published_shapes():
    shapes = cost_model.SHAPES
    h100 = cost_model.ACCELERATORS["h100-sxm"].memory_bytes
    assert cost_model.fitting_layouts(shapes["llama-3-8b"], h100, 8192, 1, 2)[0] == (1, 1)
    # 141 GB of bf16 weights: two 80 GB devices hold them and one 8k sequence, not eight sequences
    assert min(tp * pp for tp, pp in cost_model.fitting_layouts(shapes["llama-3-70b"], h100, 8192, 1, 2)) == 2
    assert min(tp * pp for tp, pp in cost_model.fitting_layouts(shapes["llama-3-70b"], h100, 8192, 8, 2)) == 4
    layouts_405b = cost_model.fitting_layouts(shapes["llama-3.1-405b"], h100, 8192, 1, 2)
    assert min(tp * pp for tp, pp in layouts_405b) == 16                  # 810 GB of bf16 weights: two nodes
    layouts_405b_fp8 = cost_model.fitting_layouts(shapes["llama-3.1-405b"], h100, 8192, 1, 1)
    assert min(tp * pp for tp, pp in layouts_405b_fp8) == 8               # in fp8, one node of eight


def test_prediction_keeps_tp_in_the_node():
    shape, gpu = cost_model.SHAPES["llama-3-70b"], cost_model.ACCELERATORS["h100-sxm"]
    nvlink, ib = cost_model.LINKS["nvlink4"], cost_model.LINKS["ib-ndr"]
    steps = {tp: cost_model.predict_decode_step(shape, tp, 1, gpu, nvlink, ib) for tp in (2, 4, 8, 16)}
    assert steps[2].total_s > steps[4].total_s > steps[8].total_s                 # in the node, more TP helps
    assert steps[16].tp_comm_s > 1.5 * steps[8].tp_comm_s                        # across nodes it costs
    tp8_pp2 = cost_model.predict_decode_step(shape, 8, 2, gpu, nvlink, ib)
    assert tp8_pp2.pp_comm_s < steps[16].tp_comm_s / 100                         # PP crosses nodes cheaply


def test_collective_waits_split_each_rank_into_waiting_and_moving():
    # one step, two collectives; rank 1 enters the first 0.6 s late, rank 0 enters the second 0.2 s late
    rank0 = [[(0.0, 1.0), (2.2, 2.5)]]
    rank1 = [[(0.6, 1.0), (2.0, 2.5)]]
    waits = parallel.collective_waits([rank0, rank1])
    assert [w["rank"] for w in waits] == [0, 1]
    assert waits[0]["wait_s"] == pytest.approx(0.6) and waits[0]["transfer_s"] == pytest.approx(0.4 + 0.3)
    assert waits[1]["wait_s"] == pytest.approx(0.2) and waits[1]["transfer_s"] == pytest.approx(0.4 + 0.3)
    # the median over steps, per rank
    three = parallel.collective_waits([[[(0, 1)], [(0, 1)], [(0, 1)]], [[(0.5, 1)], [(0.9, 1)], [(0.1, 1)]]])
    assert three[0]["wait_s"] == pytest.approx(0.5) and three[1]["wait_s"] == 0.0


def test_collective_waits_refuse_ranks_that_disagree():
    with pytest.raises(ValueError, match="same number of steps"):
        parallel.collective_waits([[[(0, 1)]], []])
    with pytest.raises(ValueError, match="different numbers of collectives"):
        parallel.collective_waits([[[(0, 1)]], [[(0, 1), (1, 2)]]])


def test_an_nccl_rank_sets_its_device_before_joining_the_group_and_names_it(monkeypatch):
    """NCCL binds a communicator to the current CUDA device: set_device first, then init with device_id."""
    import torch

    calls = []
    monkeypatch.setattr(launch_module.dist, "TCPStore", lambda *args, **kwargs: "store")
    monkeypatch.setattr(launch_module.torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(launch_module.dist, "init_process_group",
                        lambda backend, **kwargs: calls.append(("init", backend, kwargs.get("device_id"))))
    ctx = launch_module.join_group(1, 2, "nccl", 29500, timeout_s=5, threads=None)
    assert calls == [("set_device", 1), ("init", "nccl", torch.device("cuda", 1))]
    assert ctx.device == torch.device("cuda", 1)
    calls.clear()
    ctx = launch_module.join_group(0, 2, "gloo", 29500, timeout_s=5, threads=None)
    assert calls == [("init", "gloo", None)] and ctx.device.type == "cpu"     # gloo: no device to bind


@pytest.mark.parametrize("option, value", [("repeats", 0), ("rounds", 0), ("warmup", -1), ("rounds", 1.5)])
def test_measuring_communication_refuses_bad_counts_before_starting(no_processes, option, value):
    with pytest.raises(ValueError, match=f"{option} must be an integer of at least"):
        parallel.measure_communication([4, 64], **{option: value})


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="CPU affinity is Linux-only")
def test_a_rank_is_pinned_to_its_own_core_and_unpinned_after():
    import os
    from llminfer.parallel.workers import pinned_to_core
    allowed = sorted(os.sched_getaffinity(0))
    for rank in range(len(allowed) + 1):                   # one past the last core wraps around to the first
        with pinned_to_core(rank) as core:
            assert os.sched_getaffinity(0) == {core} and core == allowed[rank % len(allowed)]
        assert sorted(os.sched_getaffinity(0)) == allowed
