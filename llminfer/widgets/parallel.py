"""Chapter 10's widget: a TP × PP layout projected onto GPUs, and a Run button for the real thing here.

``project`` is the pure function: for a model shape, TP and PP degrees, an interconnect, a GPU, a batch, a
context and a dtype it returns the memory on the busiest device, the bytes each decode token sends and the
α–β model's step time. ``measure_here`` runs the real 2-process TP or PP of the bundled model on this machine
and returns its measured times beside what the same model predicts for them.

CSS classes for browser tests: ``llminfer-parallel-shape``, ``-tp``, ``-pp``, ``-link``, ``-gpu``, ``-batch``,
``-context``, ``-dtype`` (inputs), ``llminfer-parallel-projection`` (the table), ``llminfer-parallel-mode``,
``llminfer-parallel-run`` (the Run button) and ``llminfer-parallel-result`` (measured beside predicted).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..parallel import cost_model
from ..parallel.plan import tensor_parallel_plan

__all__ = ["Projection", "project", "projection_html", "measure_here", "measurement_html", "build_parallel_widget"]

DTYPE_BYTES = {"bfloat16": 2, "fp8": 1}
MACHINE = "this machine (measured)"


@dataclass(frozen=True)
class Projection:
    """A layout's memory, communication and predicted decode step, from the cost model. Chapter 10."""

    devices: int
    weight_bytes: float
    kv_bytes: float
    device_bytes: float
    tp_bytes_per_token: int           # all-reduced per decode step (2 per layer)
    pp_bytes_per_token: int           # sent between stages per decode step
    step: cost_model.StepPrediction

    @property
    def fits(self) -> bool:
        return self.weight_bytes + self.kv_bytes <= 0.9 * self.device_bytes

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.step.total_s


def project(shape, tp: int, pp: int, link: cost_model.Link, accelerator: cost_model.Accelerator,
            batch_size: int = 1, context_len: int = 4096, dtype_bytes: int = 2,
            cluster_link: cost_model.Link | None = None, gpus_per_node: int = 8) -> Projection:
    """The cost model's view of a tp × pp layout of shape. ValueError for a split the shape refuses. Chapter 10."""
    tensor_parallel_plan(shape, tp)
    memory = cost_model.device_memory(shape, tp, pp, context_len, batch_size, dtype_bytes)
    step = cost_model.predict_decode_step(shape, tp, pp, accelerator, link, cluster_link or link, gpus_per_node,
                                          batch_size, context_len, dtype_bytes)
    tp_bytes = cost_model.tp_bytes_per_token(shape, batch_size, dtype_bytes) if tp > 1 else 0
    pp_bytes = (pp - 1) * batch_size * shape.dim * dtype_bytes
    return Projection(tp * pp, memory.weight_bytes, memory.kv_bytes, accelerator.memory_bytes, tp_bytes, pp_bytes,
                      step)


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def projection_html(name: str, projection: Projection, tp: int, pp: int, link_name: str) -> str:
    """The projection as an HTML table (a model, not a measurement). Chapter 10."""
    step = projection.step
    verdict = ("fits" if projection.fits else "does NOT fit") + f" in {_bytes(projection.device_bytes)} (90% used)"
    rows = [
        ("devices", f"{projection.devices} (TP {tp} × PP {pp})"),
        ("weights per device", _bytes(projection.weight_bytes)),
        ("KV cache per device", _bytes(projection.kv_bytes)),
        ("memory per device", f"{_bytes(projection.weight_bytes + projection.kv_bytes)}: {verdict}"),
        ("all-reduced per token (TP)", _bytes(projection.tp_bytes_per_token)),
        ("sent between stages per token (PP)", _bytes(projection.pp_bytes_per_token)),
        ("predicted decode step", f"{step.total_s * 1e3:.3g} ms = compute {step.compute_s * 1e3:.3g} + TP comm "
                                  f"{step.tp_comm_s * 1e3:.3g} + PP comm {step.pp_comm_s * 1e3:.3g} ms"),
        ("predicted tokens/s per sequence", f"{projection.tokens_per_s:.3g}"),
    ]
    body = "".join(f"<tr><td>{k}</td><td style='text-align:right'><b>{v}</b></td></tr>" for k, v in rows)
    return (f"<b>{name} on {link_name}</b> <i>(the α–β model, not a measurement)</i>"
            f"<table>{body}</table>")


def _prompt(n_tokens: int = 16) -> list[list[int]]:
    """The bundled model's ids of 'The capital of France is', repeated to n_tokens."""
    from llminfer.checkpoint import load_tokenizer

    ids = load_tokenizer("tiny-capitals").encode("The capital of France is")
    return [(ids * n_tokens)[:n_tokens]]


def measure_here(mode: str, link: cost_model.Link | None = None, repeats: int = 10, runner=None) -> dict:
    """Runs the real 2-process TP or PP of the bundled model here; measured times beside predicted. Chapter 10.

    TP: one decode step, measured in one process and in each of 2 ranks, against the prediction
    (one process's step) / 2 + the collectives' α–β time on link (None: measured first, briefly). PP: a prefill
    of 16 sequences of 96 tokens in 1 and 4 micro-batches, the measured bubble against (p − 1) / (m + p − 1).
    """
    from ..parallel import workers
    from ..parallel.pipeline import ideal_bubble_fraction

    if mode not in ("tp", "pp"):
        raise ValueError(f"mode must be 'tp' or 'pp', got {mode!r}")
    runner = runner or workers
    prompt = _prompt()
    if mode == "tp":
        if link is None:
            sizes = [16, 4096, 1 << 20]                 # gloo takes a shorter path for one number
            measured = runner.measure_communication(sizes, repeats=2, budget_s=0.01)
            link = cost_model.fit_alpha_beta(sizes, measured["allreduce_s"]).as_link()
        ranks = runner.run_tensor_parallel("tiny-capitals", prompt, max_new_tokens=2, timing_repeats=repeats)
        single = ranks[0]["baseline"]["decode"]["step_s"]
        collectives = ranks[0]["decode_collectives"]
        predicted_comm = sum(count * cost_model.allreduce_seconds(nbytes / count, 2, link)
                             for count, nbytes, _seconds in collectives.values())
        measured = max(rank["decode"]["step_s"] for rank in ranks)
        return {"mode": "tp", "single_s": single, "measured_s": measured,
                "measured_comm_s": max(rank["decode"]["comm_s"] for rank in ranks),
                "predicted_s": single / 2 + predicted_comm, "predicted_comm_s": predicted_comm,
                "collectives": sum(count for count, _b, _s in collectives.values())}
    else:
        stages = runner.run_pipeline_parallel("tiny-capitals", _prompt(96) * 16, max_new_tokens=2,
                                              micro_batches=(1, 4))
        rows = {}
        for n_micro in (1, 4):
            timeline = runner.stage_timeline(stages, n_micro, step=0)
            rows[n_micro] = {"bubble": timeline["bubble"], "ideal": ideal_bubble_fraction(2, n_micro),
                             "span_s": timeline["span_s"]}
    return {"mode": "pp", "runs": rows}


def measurement_html(result: dict) -> str:
    """Measured beside predicted, as one HTML paragraph. Chapter 10."""
    if result["mode"] == "tp":
        return (f"TP=2 on this machine, tiny-capitals, one decode step: measured {result['measured_s'] * 1e3:.3g} ms "
                f"(communication {result['measured_comm_s'] * 1e3:.3g} ms in {result['collectives']} collectives) "
                f"· predicted {result['predicted_s'] * 1e3:.3g} ms (one process {result['single_s'] * 1e3:.3g} ms "
                f"/ 2 + communication {result['predicted_comm_s'] * 1e3:.3g} ms) · one process measured "
                f"{result['single_s'] * 1e3:.3g} ms")
    parts = [f"{m} micro-batch{'es' if m > 1 else ''}: bubble measured {row['bubble']:.2f}, ideal {row['ideal']:.2f}, "
             f"prefill {row['span_s'] * 1e3:.3g} ms" for m, row in result["runs"].items()]
    return "PP=2 on this machine, tiny-capitals, a prefill of 16 × 96 tokens: " + " · ".join(parts)


def build_parallel_widget(measured_link: cost_model.Link | None = None, default: str = "llama-3-70b",
                          runner=None, repeats: int = 10):
    """A VBox: shape, TP, PP, interconnect, GPU, batch, context, dtype in; memory, bytes and latency out; a
    Run button for the real 2-process TP or PP here. Chapter 10."""
    import ipywidgets as widgets

    shapes = dict(cost_model.SHAPES)
    links = {link.name: link for link in cost_model.LINKS.values()}
    if measured_link is not None:
        links[MACHINE] = measured_link
    gpus = {gpu.name: gpu for gpu in cost_model.ACCELERATORS.values()}
    shape_pick = widgets.Dropdown(options=list(shapes), value=default if default in shapes else next(iter(shapes)),
                                  description="model")
    tp_pick = widgets.Dropdown(options=[1, 2, 4, 8, 16], value=8, description="TP")
    pp_pick = widgets.Dropdown(options=[1, 2, 4, 8], value=1, description="PP")
    link_pick = widgets.Dropdown(options=list(links), value=cost_model.LINKS["nvlink4"].name,
                                 description="link", layout=widgets.Layout(width="420px"))
    gpu_pick = widgets.Dropdown(options=list(gpus), value=cost_model.ACCELERATORS["h100-sxm"].name, description="GPU")
    batch = widgets.IntSlider(value=1, min=1, max=256, description="batch")
    context = widgets.IntSlider(value=4096, min=1, max=131072, step=1, description="context")
    dtype_pick = widgets.Dropdown(options=list(DTYPE_BYTES), value="bfloat16", description="dtype")
    projection_view = widgets.HTML()
    mode_pick = widgets.ToggleButtons(options=[("TP = 2", "tp"), ("PP = 2", "pp")], value="tp",
                                      description="run here")
    run_button = widgets.Button(description="Run", button_style="primary")
    result_view = widgets.HTML()
    for control, css in ((shape_pick, "shape"), (tp_pick, "tp"), (pp_pick, "pp"), (link_pick, "link"),
                         (gpu_pick, "gpu"), (batch, "batch"), (context, "context"), (dtype_pick, "dtype"),
                         (projection_view, "projection"), (mode_pick, "mode"), (run_button, "run"),
                         (result_view, "result")):
        control.add_class(f"llminfer-parallel-{css}")
    box = widgets.VBox([widgets.HBox([shape_pick, gpu_pick]), widgets.HBox([tp_pick, pp_pick, dtype_pick]),
                        link_pick, batch, context, projection_view,
                        widgets.HBox([mode_pick, run_button]), result_view])
    box.state = None
    box.measurement = None

    def refresh(_change=None):
        shape = shapes[shape_pick.value]
        context.max = shape.max_seq_len
        link = links[link_pick.value]
        cluster = link if link.scope == "cluster" or link_pick.value == MACHINE else cost_model.LINKS["ib-ndr"]
        try:
            box.state = project(shape, tp_pick.value, pp_pick.value, link, gpus[gpu_pick.value], batch.value,
                                context.value, DTYPE_BYTES[dtype_pick.value], cluster_link=cluster)
        except ValueError as err:
            box.state = None
            projection_view.value = f"<span style='color:#c62828'>{err}</span>"
            return
        projection_view.value = projection_html(shape_pick.value, box.state, tp_pick.value, pp_pick.value,
                                                link_pick.value)

    def run(_button=None):
        result_view.value = "running 2 processes…"
        try:
            box.measurement = measure_here(mode_pick.value, measured_link, repeats=repeats, runner=runner)
        except Exception as err:                      # shown in the widget: a Run must never break the page
            box.measurement = None
            result_view.value = f"<span style='color:#c62828'>{type(err).__name__}: {err}</span>"
            return
        result_view.value = measurement_html(box.measurement)

    for control in (shape_pick, tp_pick, pp_pick, link_pick, gpu_pick, batch, context, dtype_pick):
        control.observe(refresh, names="value")
    run_button.on_click(run)
    refresh()
    box.shape_pick, box.tp_pick, box.pp_pick = shape_pick, tp_pick, pp_pick
    box.link_pick, box.gpu_pick = link_pick, gpu_pick
    box.batch, box.context, box.dtype_pick, box.projection_view = batch, context, dtype_pick, projection_view
    box.mode_pick, box.run_button, box.result_view = mode_pick, run_button, result_view
    return box
