"""The scheduling chart: what each request did at each moment of a real engine run. Chapter 05.

Everything drawn comes from an engine's `trace` (one `StepRecord` per step) and the requests' arrival
times, through pure functions:

- ``gantt_segments(trace, arrivals_s, start_s)``: per request, coloured spans: ``waiting`` (arrived, not
  yet scheduled, or between its steps), ``prefill`` (a step ran a chunk of its prompt), ``decode`` (a
  step ran its newest token), ``preempted`` (its blocks were taken; waiting to be recomputed);
- ``run_counts(trace, n_requests)``: steps, tokens per step, preemptions, finished requests;
- ``summary_text(summary, counts)``: the line under the chart, e.g.
  ``"sequential · 12 requests · 180 steps · 0 preemptions · 8.1 tok/s · TTFT p50 1234 ms · TPOT p50 5.0 ms"``.

CSS classes for browser tests: ``llminfer-schedule-policy`` (dropdown), ``llminfer-schedule-budget``,
``llminfer-schedule-seqs``, ``llminfer-schedule-rate`` (sliders), ``llminfer-schedule-run`` (button),
``llminfer-schedule-summary`` (the summary line), ``llminfer-schedule-chart`` (the chart).
"""
from __future__ import annotations

import html
import io
from dataclasses import dataclass

WAITING, PREFILL, DECODE, PREEMPTED = "waiting", "prefill", "decode", "preempted"
COLOURS = {WAITING: "#d9d9d9", PREFILL: "#e6550d", DECODE: "#3182bd", PREEMPTED: "#b10026"}
LABELS = {WAITING: "waiting", PREFILL: "prefill (chunk)", DECODE: "decode step", PREEMPTED: "preempted"}


@dataclass(frozen=True)
class Segment:
    """One coloured span of one request's row: kind, from start_s to end_s (s since the run began)."""
    request: int          # row: the request's index in the workload
    kind: str
    start_s: float
    end_s: float
    tokens: int = 0


def gantt_segments(trace, arrivals_s: list[float], start_s: float, request_ids: list[int] | None = None) -> list[Segment]:
    """Spans per request from an engine trace: waiting, prefill chunks, decode steps, preempted. Chapter 05.

    arrivals_s: each request's arrival in seconds after start_s (the engine clock when the run began);
    request_ids: the engine's id of each request (default 0, 1, 2, ... in the trace's numbering order).
    """
    ids = request_ids if request_ids is not None else sorted({rid for r in trace for rid, _, _ in r.entries})
    row_of = {rid: i for i, rid in enumerate(ids)}
    segments: list[Segment] = []
    ready_since = {row: arrivals_s[row] for row in range(len(ids))}   # when it last became ready to run
    idle_kind = {row: WAITING for row in range(len(ids))}
    finished: set[int] = set()
    for record in trace:
        t0, t1 = record.start_s - start_s, record.end_s - start_s
        for rid, kind, tokens in record.entries:
            row = row_of.get(rid)
            if row is None:
                continue
            if t0 > ready_since[row]:
                segments.append(Segment(row, idle_kind[row], ready_since[row], t0))
            segments.append(Segment(row, kind, t0, t1, tokens))
            ready_since[row], idle_kind[row] = t1, WAITING
        for rid in record.preempted:
            row = row_of.get(rid)
            if row is not None:
                ready_since[row], idle_kind[row] = t1, PREEMPTED
        for rid in record.finished:
            if rid in row_of:
                finished.add(row_of[rid])
    return segments


def run_counts(trace) -> dict:
    """Steps, tokens per step, preemptions and finishes of a run, from its trace. Chapter 05."""
    tokens = [r.num_tokens for r in trace]
    return {"steps": len(trace), "tokens": sum(tokens), "max_tokens_per_step": max(tokens, default=0),
            "preemptions": sum(len(r.preempted) for r in trace),
            "finished": sum(len(r.finished) for r in trace),
            "max_running": max((len(r.entries) for r in trace), default=0)}


def summary_text(summary: dict, counts: dict) -> str:
    """The line under the chart: policy, requests, steps, preemptions, throughput, TTFT and TPOT medians."""
    return (f"{summary['policy']} · {summary['requests']} requests · {counts['steps']} steps · "
            f"{counts['preemptions']} preemptions · {summary['throughput_tok_s']:.1f} tok/s · "
            f"TTFT p50 {summary['ttft_p50_s'] * 1e3:.0f} ms · TPOT p50 {summary['tpot_p50_s'] * 1e3:.1f} ms")


def plot_gantt(ax, segments: list[Segment], n_requests: int, title: str = "") -> None:
    """Draws the spans: one row per request (first at the top), time on the x axis in seconds. Chapter 05."""
    from matplotlib.patches import Patch

    for kind in (WAITING, PREEMPTED, PREFILL, DECODE):
        rows: dict[int, list[tuple[float, float]]] = {}
        for s in segments:
            if s.kind == kind and s.end_s > s.start_s:
                rows.setdefault(s.request, []).append((s.start_s, s.end_s - s.start_s))
        for row, spans in rows.items():
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLOURS[kind], linewidth=0)
    ax.set_ylim(n_requests - 0.5, -0.5)
    ax.set_xlabel("time since the first arrival (s)")
    ax.set_ylabel("request")
    ax.legend(handles=[Patch(color=COLOURS[k], label=LABELS[k]) for k in (WAITING, PREFILL, DECODE, PREEMPTED)],
              loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, ncol=4, frameon=False)
    if title:
        ax.set_title(title, pad=22)


def chart_png(segments: list[Segment], n_requests: int, title: str = "", width: float = 7.5) -> bytes:
    """The Gantt chart as PNG bytes (rendered without a kernel in the widget)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, 0.6 + 0.16 * max(n_requests, 8)))
    plot_gantt(ax, segments, n_requests, title)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return png.getvalue()


def run_policy(model, workload, policy: str = "continuous", max_num_batched_tokens: int = 256,
               max_num_seqs: int = 8, block_size: int = 16, num_blocks: int | None = None, **engine_args):
    """Replays workload on a fresh LLMEngine with these settings; returns (WorkloadResult, segments)."""
    from ..engine import LLMEngine
    from ..engine.workload import replay

    max_len = max(len(r.prompt_ids) + r.max_new_tokens for r in workload.requests)
    max_model_len = min(model.config.max_seq_len, -(-max_len // block_size) * block_size)
    engine = LLMEngine(model, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, policy=policy, max_model_len=max_model_len,
                       **engine_args)
    result = replay(engine, workload)
    ids = [o.request_id for o in result.outputs]
    return result, gantt_segments(result.trace, result.arrivals_s, result.start_s, ids)


def build_schedule_widget(model, make_workload, initial=None, settings: tuple = ("continuous", 256, 8, 40.0),
                          slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.1, max_rate: float = 200.0):
    """Controls (policy, token budget, max sequences, arrival rate) and a Run button over a real engine. Chapter 05.

    make_workload(rate) returns the workload to replay; `initial` is a (WorkloadResult, segments) pair to
    show before the first Run (the chapter's own run, made with `settings`: policy, budget, seqs, rate).
    """
    import ipywidgets as widgets

    from ..engine.workload import summarize

    policy = widgets.Dropdown(options=["continuous", "static", "sequential"], value=settings[0], description="policy")
    policy.add_class("llminfer-schedule-policy")
    budget = widgets.IntSlider(value=settings[1], min=16, max=1024, step=16, description="token budget")
    budget.add_class("llminfer-schedule-budget")
    seqs = widgets.IntSlider(value=settings[2], min=1, max=32, description="max seqs")
    seqs.add_class("llminfer-schedule-seqs")
    rate = widgets.FloatSlider(value=settings[3], min=1.0, max=max_rate, step=1.0, description="arrivals / s")
    rate.add_class("llminfer-schedule-rate")
    run = widgets.Button(description="Run", button_style="primary", tooltip="run the engine on this device")
    run.add_class("llminfer-schedule-run")
    summary = widgets.HTML()
    summary.add_class("llminfer-schedule-summary")
    chart = widgets.Image(format="png", layout=widgets.Layout(width="640px"))
    chart.add_class("llminfer-schedule-chart")
    box = widgets.VBox([widgets.HBox([policy, seqs]), widgets.HBox([budget, rate]), run, summary, chart])
    box.add_class("llminfer-schedule")

    def show(result, segments):
        stats = summarize(result, slo_ttft_s, slo_tpot_s)
        counts = run_counts(result.trace)
        box.last = (result, segments, stats, counts)
        summary.value = html.escape(summary_text(stats, counts))
        chart.value = chart_png(segments, len(result.outputs),
                                f"{stats['policy']}: budget {box.settings[1]}, max seqs {box.settings[2]}")

    def on_run(_button=None):
        run.disabled, run.description = True, "Running…"
        try:
            box.settings = (policy.value, budget.value, seqs.value, rate.value)
            workload = make_workload(rate.value)
            result, segments = run_policy(model, workload, policy.value, budget.value, seqs.value)
            show(result, segments)
        except (ValueError, MemoryError) as exc:
            summary.value = f"<b>cannot run:</b> {html.escape(str(exc))}"
        finally:
            run.disabled, run.description = False, "Run"

    run.on_click(on_run)
    box.run_button, box.policy, box.budget, box.seqs, box.rate = run, policy, budget, seqs, rate
    box.summary, box.chart, box.on_run = summary, chart, on_run
    box.settings = (policy.value, budget.value, seqs.value, rate.value)
    if initial is not None:
        show(*initial)
    return box
