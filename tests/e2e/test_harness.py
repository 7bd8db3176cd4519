"""The browser harness on a generated notebook: a slider drives an HTML readout through a kernel-side observer."""
import nbformat
import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SCRATCH_SOURCE = '''\
import ipywidgets as widgets
slider = widgets.IntSlider(value=3, min=0, max=10, description="n")
square = widgets.HTML(value="square: 9")
slider.add_class("scratch-slider")
square.add_class("scratch-square")
slider.observe(lambda change: setattr(square, "value", f"square: {change['new'] ** 2}"), names="value")
widgets.VBox([slider, square])
'''


@pytest.fixture
def scratch_notebook(jupyter_server):
    """Writes a one-widget notebook into a scratch folder of the served copy; returns its path under the root."""
    folder = jupyter_server["root"] / "_e2e_scratch"
    folder.mkdir(exist_ok=True)
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_markdown_cell("# scratch"), nbformat.v4.new_code_cell(SCRATCH_SOURCE)]
    nbformat.write(notebook, folder / "scratch.ipynb")
    return "_e2e_scratch/scratch.ipynb"


def test_slider_updates_html_through_the_kernel(lab, scratch_notebook):
    lab.open(scratch_notebook)
    lab.run_all()
    slider = lab.widget("scratch-slider")
    square = lab.widget("scratch-square")
    expect(square).to_have_text("square: 9")

    slider.locator(".noUi-handle").focus()
    slider.locator(".noUi-handle").press("ArrowRight")
    expect(square).to_have_text("square: 16")

    lab.set_text(slider.locator(".widget-readout"), 7)
    expect(square).to_have_text("square: 49")
    lab.screenshot("harness-slider")


def test_requests_leave_only_for_localhost(lab, jupyter_server):
    lab.page.goto(f"{jupyter_server['base_url']}/lab?reset&token={jupyter_server['token']}")
    lab.page.locator(".jp-LabShell").wait_for(state="visible")
    outcome = lab.page.evaluate(
        "() => fetch('http://192.0.2.1/probe').then(() => 'reached', () => 'refused')")
    assert outcome == "refused"
    assert lab.blocked == ["http://192.0.2.1/probe"]

