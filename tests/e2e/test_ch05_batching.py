"""Chapter 05 in the browser: the scheduling widget reruns the engine with the policy picked and redraws."""
import re

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

NOTEBOOK = "05_batching.ipynb"


@pytest.fixture(scope="module")
def widget_output_tokens() -> int:
    """Output tokens of the widget's workload (16 requests, seed 1): a sequential run makes one per step."""
    from llminfer.bench import engine as benchmark
    from llminfer.engine.workload import make_workload

    settings = dict(benchmark.DEFAULT_WORKLOAD, n_requests=16, seed=1)
    return sum(make_workload(vocab_size=benchmark.NARROW_LLAMA.vocab_size, **settings).output_lens)


def test_run_button_reruns_the_engine_with_the_chosen_policy(lab, widget_output_tokens):
    lab.open(NOTEBOOK)
    lab.run_all(timeout_ms=360_000)
    summary = lab.widget("llminfer-schedule-summary")
    chart = lab.widget("llminfer-schedule-chart")
    # the widget opens on the chapter's own continuous run of the 24-request workload
    expect(summary).to_have_text(re.compile(r"^continuous · 24 requests · \d+ steps · "))
    first_chart = chart.get_attribute("src")

    lab.widget("llminfer-schedule-policy").locator("select").select_option("sequential")
    lab.widget("llminfer-schedule-run").click()
    # one request at a time: one token per step, so the steps are the workload's output tokens
    expect(summary).to_have_text(re.compile(rf"^sequential · 16 requests · {widget_output_tokens} steps · 0 "
                                            r"preemptions · "), timeout=240_000)
    expect(chart).not_to_have_attribute("src", first_chart)
    assert chart.evaluate("img => img.complete && img.naturalWidth > 100 && img.naturalHeight > 100")

    lab.widget("llminfer-schedule-policy").locator("select").select_option("continuous")
    lab.widget("llminfer-schedule-run").click()
    expect(summary).to_have_text(re.compile(r"^continuous · 16 requests · "), timeout=240_000)
    expect(lab.widget("llminfer-schedule-run")).to_have_text("Run")     # the run, and its chart, are done
    steps = int(re.search(r"(\d+) steps", summary.inner_text()).group(1))
    assert steps < widget_output_tokens                 # a batch makes several tokens per step
    lab.screenshot("ch05-schedule", locator=lab.output_of(summary))
