"""Percentiles only where the sample holds them; vLLM's request goodput and DistServe's rate goodput."""
import math

import pytest

from llminfer.engine import latency
from llminfer.engine.latency import SLO, max_rate_meeting, percentile, percentiles, request_goodput, samples_needed


def test_a_tail_percentile_needs_values_beyond_it():
    # chapter 01's rule: 20 values give a median and a p90 (two values above it), not a p99
    assert [samples_needed(q) for q in (0, 50, 90, 99)] == [1, 1, 20, 200]
    twenty = list(range(20))
    assert percentile(twenty, 50) == 9.5
    assert percentile(twenty, 90) == pytest.approx(17.1)
    assert math.isnan(percentile(twenty, 99))
    assert percentile(list(range(200)), 99) == pytest.approx(197.01)
    assert math.isnan(percentile([1.0] * 19, 90))


def test_percentiles_skip_non_finite_values_and_report_the_mean():
    values = [1.0, 2.0, float("nan"), None, 3.0, float("inf")]
    out = percentiles(values)
    assert out["mean"] == 2.0 and out["p50"] == 2.0
    assert math.isnan(out["p90"]) and math.isnan(out["p99"])
    assert all(math.isnan(v) for v in percentiles([]).values())


@pytest.mark.parametrize("q", [-1, 100, 150])
def test_a_percentile_outside_its_range_is_refused(q):
    with pytest.raises(ValueError, match=f"got {q}"):
        samples_needed(q)


def test_request_goodput_counts_requests_that_met_every_stated_target():
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    requests = [(0.1, 0.01, 1.0, 10),      # good
                (0.6, 0.01, 1.0, 10),      # TTFT too slow
                (0.1, 0.09, 1.0, 10),      # TPOT too slow
                (0.1, float("nan"), 0.1, 1),   # one token: no TPOT to judge, TTFT met
                (0.1, float("nan"), 1.0, 5)]   # a TPOT that could not be measured fails
    assert request_goodput(requests, 2.0, slo) == (2, 1.0)
    assert request_goodput(requests, 2.0, SLO(e2e_s=0.5)) == (1, 0.5)
    assert request_goodput(requests, 2.0, SLO()) == (5, 2.5), "no target: every finished request is good"


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "1"])
def test_an_slo_target_must_be_seconds_at_least_zero(bad):
    with pytest.raises(ValueError, match="must be a number of seconds >= 0"):
        SLO(ttft_s=bad)


def test_distserve_goodput_is_the_highest_rate_that_meets_the_attainment_target():
    rates = [1, 2, 4, 8]
    attained = [1.0, 0.95, 0.92, 0.4]
    assert max_rate_meeting(rates, attained, target=0.9) == 4
    assert max_rate_meeting(rates, attained, target=0.99) == 1
    assert math.isnan(max_rate_meeting(rates, [0.1] * 4, target=0.9))
    with pytest.raises(ValueError, match="pair up"):
        max_rate_meeting(rates, attained[:3])
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        max_rate_meeting(rates, attained, target=90)


def test_the_engine_and_the_load_generator_share_the_one_definition():
    from llminfer.engine import workload
    from llminfer.serve import bench
    assert workload.percentile is latency.percentile
    assert bench.percentiles is latency.percentiles
