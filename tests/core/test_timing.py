"""Timing and measured ceilings."""
import time
from pathlib import Path

import pytest
import torch

from llminfer import timing

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_summary_of_known_times():
    result = timing.TimingResult.from_times([5.0, 1.0, 3.0, 2.0, 4.0])
    assert result.median_s == 3.0
    assert result.iqr_s == 2.0                 # quartiles 2 and 4
    assert result.times_s == [5.0, 1.0, 3.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="repeats"):
        timing.TimingResult.from_times([])


def test_time_fn_measures_a_known_duration_and_counts_calls():
    calls = []

    def sleep_10ms():
        calls.append(1)
        time.sleep(0.01)

    result = timing.time_fn(sleep_10ms, "cpu", warmup=2, repeats=5)
    assert len(calls) == 7
    assert len(result.times_s) == 5
    assert result.median_s >= 0.0095        # a sleep lasts at least as long as asked, at any load (no upper bound)


def test_time_fn_times_only_the_repeats_on_a_synthetic_clock(monkeypatch):
    now = [0.0]
    durations = iter([5.0, 7.0, 0.003, 0.001, 0.002, 0.010])       # 2 warm-up calls, then 4 timed ones

    def step():
        now[0] += next(durations)

    monkeypatch.setattr(timing, "_benchmark_clock", lambda: now[0])
    result = timing.time_fn(step, "cpu", warmup=2, repeats=4)
    assert result.times_s == pytest.approx([0.003, 0.001, 0.002, 0.010])    # the slow warm-up calls are not timed
    assert result.median_s == pytest.approx(0.0025)
    assert result.iqr_s == pytest.approx(0.00475 - 0.00175)


@pytest.mark.parametrize("warmup, repeats", [(-1, 3), (0, 0)])
def test_time_fn_rejects_bad_counts(warmup, repeats):
    with pytest.raises(ValueError, match=f"repeats={repeats}"):
        timing.time_fn(lambda: None, "cpu", warmup=warmup, repeats=repeats)


def test_cpu_ceilings_are_positive_and_count_work():
    copy = timing.measure_copy_bandwidth("cpu", torch.float32, nbytes=8 << 20, repeats=3)
    assert copy.work == 2 * (8 << 20)                     # read and written
    assert copy.rate == pytest.approx(copy.work / copy.timing.median_s)
    matvec = timing.measure_matvec_bandwidth("cpu", torch.float32, nbytes=8 << 20, repeats=3)
    assert matvec.work == 8 << 20
    matmul = timing.measure_matmul_flops("cpu", torch.float32, n=256, repeats=3)
    assert matmul.work == 2 * 256 ** 3
    for ceiling in (copy, matvec, matmul):
        assert ceiling.rate > 0 and ceiling.as_dict()["rate"] == ceiling.rate


def test_read_probe_can_read_from_huge_pages():
    """The decode benchmark's ceiling reads memory of the kind its weights are on: 2 MiB pages."""
    import mmap
    from pathlib import Path

    from llminfer import device

    probe = timing.read_probe("cpu", torch.float32, nbytes=8 << 20, huge_pages=True)
    assert probe.work == 8 << 20
    assert probe.fn().item() == (8 << 20) // 4                          # a sum of ones: every element read once
    assert probe.what.startswith("sum of 8 MiB float32")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if hasattr(mmap, "MADV_HUGEPAGE") and thp.exists() and "[never]" not in thp.read_text():
        assert probe.what.endswith(", on 2 MiB pages")
        assert device.on_huge_pages(probe.fn.__closure__[0].cell_contents)
    plain = timing.read_probe("cpu", torch.bfloat16, nbytes=1 << 20)
    assert plain.what == "sum of 1 MiB bfloat16" and plain.fn().item() == (1 << 20) // 2
    assert not device.on_huge_pages(plain.fn.__closure__[0].cell_contents)
    assert device.huge_page_empty((0,)) is None                           # nothing to map


def test_bfloat16_ceiling_counts_two_byte_elements():
    copy = timing.measure_copy_bandwidth("cpu", torch.bfloat16, nbytes=1 << 20, repeats=2)
    assert copy.work == 2 * (1 << 20)
    assert timing.dtype_bytes(torch.bfloat16) == 2


def test_too_large_a_ceiling_test_is_refused_before_allocating():
    with pytest.raises(MemoryError, match="GiB"):
        timing.measure_copy_bandwidth("cpu", torch.float32, nbytes=1 << 50)
    with pytest.raises(MemoryError, match="matmul"):
        timing.measure_matmul_flops("cpu", torch.float32, n=1 << 22)


@pytest.mark.gpu
@cuda
def test_cuda_events_time_gpu_work():
    a = torch.randn(2048, 2048, device="cuda")
    result = timing.time_fn(lambda: a @ a, "cuda", warmup=2, repeats=5)
    assert len(result.times_s) == 5 and result.median_s > 0
    copy = timing.measure_copy_bandwidth("cuda", torch.bfloat16, nbytes=64 << 20, repeats=3)
    assert copy.rate > 1e10            # any CUDA device copies faster than 10 GB/s


def test_the_machine_line_names_the_cpu_its_class_threads_and_load(monkeypatch):
    from llminfer import device as device_module
    fixture = (Path(__file__).parents[1] / "fixtures" / "cpuinfo" / "amd_zen4_avx512_bf16.txt").read_text()
    monkeypatch.setattr(timing, "cpu_capabilities", lambda: device_module.parse_cpuinfo(fixture))
    monkeypatch.setattr(timing, "load_per_core", lambda: 0.25)
    line = timing.machine_summary("cpu")
    zen4 = device_module.parse_cpuinfo(fixture)
    assert line == (f"{zen4.model} (avx512_bf16 class, {zen4.logical_cpus} CPUs) · torch threads "
                    f"{torch.get_num_threads()} · load 0.25 per core")


def test_stopwatch_waits_for_the_device_before_and_after_the_block(monkeypatch):
    events = []
    monkeypatch.setattr(timing, "synchronize", lambda device: events.append(("sync", torch.device(device).type)))
    with timing.stopwatch("cuda") as watch:
        events.append("work")
        time.sleep(0.02)
    assert events == [("sync", "cuda"), "work", ("sync", "cuda")]
    assert 0.015 < watch.seconds < 1.0


def test_bandwidth_probes_are_at_least_a_gibibyte_on_a_gpu():
    assert timing.probe_bytes("cpu", 128 << 20) == 128 << 20
    assert timing.probe_bytes("cuda", 128 << 20) == 1 << 30            # HBM streams 128 MiB in tens of µs
    assert timing.probe_bytes("cuda", 4 << 30) == 4 << 30
    assert timing.probe_bytes("cpu") == 256 << 20


# --- contenders taking turns -------------------------------------------------------------------------------------------

def test_contenders_take_turns_after_their_warm_up_which_is_discarded():
    calls = []

    def contender(name, values):
        values = iter(values)
        return lambda: calls.append(name) or next(values)

    found = timing.interleave({"a": contender("a", [100, 3, 1, 2]), "b": contender("b", [200, 30, 10, 20])},
                              rounds=3, warmup=1, between=lambda: calls.append("|"))
    assert calls == ["a", "b", "a", "|", "b", "|", "a", "|", "b", "|", "a", "|", "b", "|"]
    assert found == {"a": [3, 1, 2], "b": [30, 10, 20]}                 # the warm-up's 100 and 200 are gone
    assert timing.medians(found) == {"a": 2, "b": 20}
    assert timing.medians({"x": [{"s": 4.0}, {"s": 1.0}]}, lambda r: r["s"]) == {"x": 2.5}


def test_alternating_rounds_reverse_the_order_in_odd_rounds():
    calls = []
    timing.interleave({name: (lambda n=name: calls.append(n)) for name in "abc"}, rounds=2, warmup=0,
                      alternate=True)
    assert calls == ["a", "b", "c", "c", "b", "a"]
    assert timing.round_order(("x", "y"), 3, alternate=True) == [["x", "y"], ["y", "x"], ["x", "y"]]
    assert timing.round_order(["x", "y"], 2) == [["x", "y"], ["x", "y"]]


@pytest.mark.parametrize("call, message", [
    (lambda: timing.round_order(("a", "b"), 0), "rounds must be a positive integer"),
    (lambda: timing.round_order(("a", "b"), True), "rounds must be a positive integer"),
    (lambda: timing.round_order((), 2), "no contenders"),
    (lambda: timing.interleave({}, 2), "no contenders"),
    (lambda: timing.interleave({"a": lambda: 1}, 2, warmup=-1), "warmup must be a non-negative integer"),
    (lambda: timing.interleave({"a": lambda: 1}, 1.5), "rounds must be a positive integer"),
    (lambda: timing.medians({"a": []}), "no results for ['a']"),
])
def test_bad_interleaving_is_refused_before_any_call(call, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call()
