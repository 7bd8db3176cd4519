"""Chapter 11's exercises: goodput at an SLO, TTFT and TPOT from a stream, DistServe's goodput, samples for a p99."""
from __future__ import annotations


from . import as_number, as_numbers, as_whole, close, exercise, not_a

# 11.1: eight requests of a 4-second run, (TTFT s, TPOT s, output tokens); TPOT is nan for a one-token request
REQUESTS = ((0.20, 0.030, 40), (0.45, 0.048, 12), (0.60, 0.020, 30), (0.30, 0.070, 25),
            (0.10, float("nan"), 1), (0.35, 0.049, 64), (0.52, 0.030, 8), (0.25, 0.045, 16))
DURATION_S, SLO_TTFT_S, SLO_TPOT_S = 4.0, 0.5, 0.05
STREAM_S = (0.120, 0.135, 0.151, 0.164, 0.180)               # 11.2: when each streamed token arrived
SWEEP_RATES = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)                 # 11.3
SWEEP_ATTAINMENT = (1.0, 0.97, 0.92, 0.85, 0.91, 0.60)


@exercise("11.1", "goodput of eight requests at TTFT ≤ 500 ms and TPOT ≤ 50 ms")
def goodput(answer):
    from ..engine.latency import SLO, request_goodput
    value = as_number(answer)
    if value is None:
        return not_a("a number of requests per second", answer)
    slo = SLO(ttft_s=SLO_TTFT_S, tpot_s=SLO_TPOT_S)
    good, want = request_goodput(((ttft, tpot, 0.0, n) for ttft, tpot, n in REQUESTS), DURATION_S, slo)
    if close(value, len(REQUESTS) / DURATION_S):
        return False, "that is the throughput, every request; goodput counts only those that met both targets"
    if close(value, (good - 1) / DURATION_S):
        return False, ("the one-token request has no TPOT (no gap to average): it is judged by its TTFT alone, "
                       "as vLLM's --goodput does (section 3)")
    ttft_only = sum(1 for ttft, _, _ in REQUESTS if ttft <= SLO_TTFT_S)
    if close(value, ttft_only / DURATION_S):
        return False, "a good request meets *both* targets: check each TPOT too"
    if close(value, good):
        return False, f"{good} requests were good; goodput is a rate: divide by the run's {DURATION_S:g} s"
    if not close(value, want):
        return False, f"{value:g}: count the requests within both targets and divide by the duration"
    return True, f"{good} of {len(REQUESTS)} requests within both targets in {DURATION_S:g} s: {want:g} requests/s"


@exercise("11.2", "TTFT and TPOT from a streamed response's arrival times")
def stream_latencies(answer):
    numbers = as_numbers(answer, 2)
    if numbers is None:
        return not_a("two numbers (ttft_ms, tpot_ms)", answer)
    ttft, tpot = numbers
    want_ttft = STREAM_S[0] * 1e3
    want_tpot = (STREAM_S[-1] - STREAM_S[0]) / (len(STREAM_S) - 1) * 1e3
    if close(ttft, want_ttft / 1e3) or close(tpot, want_tpot / 1e3):
        return False, "give both in milliseconds"
    if not close(ttft, want_ttft):
        return False, "TTFT is the first token's arrival, measured from the request being sent"
    if close(tpot, STREAM_S[-1] / len(STREAM_S) * 1e3):
        return False, "TPOT leaves the first token out: (E2E − TTFT) / (tokens − 1)"
    if close(tpot, (STREAM_S[-1] - STREAM_S[0]) / len(STREAM_S) * 1e3):
        return False, f"{len(STREAM_S)} tokens have {len(STREAM_S) - 1} gaps between them"
    if not close(tpot, want_tpot):
        return False, f"{tpot:g} ms: TPOT = (E2E − TTFT) / (tokens − 1)"
    return True, f"TTFT {want_ttft:g} ms, TPOT (180 − 120) / 4 = {want_tpot:g} ms"


@exercise("11.3", "DistServe's goodput read off a sweep at 90 % attainment")
def distserve_goodput(answer):
    from ..engine.latency import max_rate_meeting
    value = as_number(answer)
    if value is None:
        return not_a("a number of requests per second", answer)
    want = max_rate_meeting(SWEEP_RATES, SWEEP_ATTAINMENT, target=0.9)
    first_miss = next(rate for rate, share in zip(SWEEP_RATES, SWEEP_ATTAINMENT) if share < 0.9)
    if close(value, first_miss) or close(value, SWEEP_RATES[-1]):
        return False, "the rate asked for is one where at least 90 % of requests met the SLO"
    if close(value, 3.0):
        return False, ("the definition used here is the highest measured rate that meets the target, even past a "
                       "dip (latency.max_rate_meeting); a noisy sweep can dip and recover, as 4/s does here")
    if not close(value, want):
        return False, f"{value:g}: the highest offered rate whose attainment is at least 0.9 (section 3)"
    return True, f"{want:g} requests/s: the highest rate with ≥ 90 % of requests in the SLO"


@exercise("11.4", "requests a load level needs before its p99 is quoted")
def samples_for_p99(answer):
    from ..engine.latency import MIN_TAIL_SAMPLES, samples_needed
    value = as_whole(answer)
    if value is None:
        return not_a("a whole number of requests", answer)
    want = samples_needed(99)
    if value == 100:
        return False, (f"with 100 values only one lies beyond the p99; the chapter quotes a tail percentile only "
                       f"with at least {MIN_TAIL_SAMPLES} beyond it")
    if value != want:
        return False, (f"{value}: a p-th percentile needs {MIN_TAIL_SAMPLES} / (1 − p/100) values "
                       "(latency.samples_needed; why section 3 shows p90 and no p99)")
    return True, (f"{MIN_TAIL_SAMPLES} / (1 − 0.99) = {want} requests; section 3's levels of 32 give a p90 "
                  f"({samples_needed(90)} needed) but no p99")
