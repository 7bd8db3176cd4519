"""The measurement layer every `python -m llminfer.bench` subcommand shares: turns, threads, the report writer, the
machine, and the one command line. Logic only: nothing here is timed."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from llminfer import bench
from llminfer.bench import cli, measure, report


def test_contenders_take_turns_and_the_medians_leave_out_the_warm_up():
    calls = []

    def contender(name, values):
        values = iter(values)
        return lambda: calls.append(name) or next(values)

    sampled = []
    found = measure.interleave({"fast": contender("fast", [99.0, 1.0, 3.0, 2.0]),
                                "slow": contender("slow", [99.0, 10.0, 30.0, 20.0])},
                               3, warmup=1, between=lambda: sampled.append(len(calls)))
    assert calls == ["fast", "slow"] * 4                         # one warm-up each, then one call each per round
    assert sampled == [3, 4, 5, 6, 7, 8]                         # the probe after every timed call, not the warm-up
    assert measure.medians(found) == {"fast": 2.0, "slow": 20.0}
    calls.clear()
    measure.interleave({"a": contender("a", [1, 2]), "b": contender("b", [1, 2])}, 2, warmup=0, alternate=True)
    assert calls == ["a", "b", "b", "a"]                         # alternating rounds: the other goes first


def test_the_thread_count_is_restored_after_the_block_and_after_an_error():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with measure.threads(other) as count:
        assert count == other == torch.get_num_threads()
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="a failing run"):
        with measure.threads(other):
            raise RuntimeError("a failing run")
    assert torch.get_num_threads() == before
    with measure.threads(None) as count:                        # None: leaves torch's count as it is
        assert count == before
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="must be a positive integer"):
            with measure.threads(bad):
                pass
    assert torch.get_num_threads() == before


def test_the_report_writer_writes_standard_json_a_table_and_a_plot(tmp_path, capsys):
    import matplotlib.pyplot as plt

    document = {"machine": report.machine("cpu"), "ratio": 1.5, "nan": float("nan"), "rows": [1.0, float("inf")],
                "path": tmp_path}

    def plot(doc):
        figure, axis = plt.subplots()
        axis.plot([1, 2], [doc["ratio"], doc["ratio"]])
        return figure

    paths = report.publish(document, tmp_path / "out", "run-x", table=lambda doc: f"ratio {doc['ratio']}x", plot=plot)
    assert [p.name for p in paths] == ["run-x.json", "run-x.png"]
    saved = json.loads(paths[0].read_text(), parse_constant=lambda name: pytest.fail(f"non-standard JSON: {name}"))
    assert saved["nan"] is None and saved["rows"] == [1.0, None] and saved["path"] == str(tmp_path)
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert printed.startswith("ratio 1.5x") and "run-x.json and" in printed
    # without table and plot: only the JSON, and nothing printed
    assert [p.name for p in report.publish({"a": 1}, tmp_path, "bare")] == ["bare.json"]
    assert capsys.readouterr().out == ""


def test_the_machine_is_described_once_from_the_cpu_reader():
    from llminfer.device import cpu_capabilities, cpu_slug

    cpu = cpu_capabilities()
    described = report.machine("cpu")
    assert described["cpu"] == cpu.model and described["cpu_isa"] == cpu.isa_level
    assert described["cpu_vector_flags"] == cpu.vector_flags() and described["cpu_class"] == cpu_slug(cpu)
    assert described["torch_threads"] == torch.get_num_threads() and described["device"] == "cpu"
    assert report.device_slug("cpu") == cpu_slug(cpu)
    load = report.load_average()
    assert load is None or (len(load) == 3 and all(x >= 0 for x in load))


def test_the_one_entry_point_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert list(cli.SUBCOMMANDS) == ["prefill-decode", "decode", "real", "engine", "serve", "gpu", "rows",
                                  "llama-cpp", "moe", "structured"]
    assert all(re.search(rf"^\s+{name}\b", text, re.M) for name in cli.SUBCOMMANDS)
    with pytest.raises(SystemExit) as stop:                     # no subcommand: usage, status 2
        bench.main([])
    assert stop.value.code == 2 and "<what>" in capsys.readouterr().err


def _option_entries(help_text: str) -> list[str]:
    """Each option's block of a --help text, its wrapped lines joined."""
    entries, current = [], None
    for line in help_text.splitlines():
        if re.match(r"^  -", line):
            current = [line.strip()]
            entries.append(current)
        elif current is not None and line.startswith("      ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    return [" ".join(entry) for entry in entries]


@pytest.mark.parametrize("what", list(cli.SUBCOMMANDS))
def test_each_subcommand_has_help_that_states_each_default_once(what, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main([what, "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m llminfer.bench {what}")
    entries = _option_entries(text)
    assert len(entries) >= 3 and any("--" in entry for entry in entries)
    assert "(default: None)" not in text
    for entry in entries:
        assert entry.count("(default") <= 1, f"{what}: a default stated twice: {entry}"
        assert not (re.match(r"--no-[\w-]+ ", entry) and "(default" in entry), f"{what}: a switch's default: {entry}"


def test_the_makefile_runs_the_one_entry_point():
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    benchmarks = [m for m in re.findall(r"-m (llminfer\.[\w.]+)", makefile) if "bench" in m]
    assert benchmarks and set(benchmarks) == {"llminfer.bench"}        # no llminfer.bench.decode, serve.bench, ...
    for target, what in (("bench", "prefill-decode"), ("bench", "decode"), ("bench-vllm", "serve --compare vllm"),
                         ("test-gpu", "gpu")):
        # test-gpu runs it with the node's interpreter, layered in .venv-gpu (GPU_PY)
        assert re.search(rf"^{target}:.*\n(\t.*\n)*\t\$\((GPU_)?PY\) -m llminfer\.bench {what}", makefile, re.M), target


def test_the_names_the_chapters_call_are_still_there():
    """Chapters 05, 06, 08 and 11 call these; the layer's move kept them where the chapters import them."""
    from llminfer.bench import decode, decode_real, engine
    from llminfer.serve import bench as load, peer

    called = {engine: ["batch_sweep", "NARROW_LLAMA", "DEFAULT_WORKLOAD", "latency_target", "compare_policies",
                       "TARGETS", "chunked_prefill_trade", "memory_accounting", "prefix_cache_trade"],
              decode: ["BandwidthCeiling"],
              decode_real: ["compare_tokens", "file_bytes_by_type", "interleave", "llama_cpp_contender",
                            "llminfer_contender", "summarise", "table"],
              load: ["BenchRequest", "run_benchmark", "summarize", "workload_requests"],
              peer: ["VLLMProcess", "peer_checkpoint", "vllm_python"]}
    missing = [f"{module.__name__}.{name}" for module, names in called.items() for name in names
               if not hasattr(module, name)]
    assert not missing, missing
    assert decode_real.interleave is measure.interleave and decode.BandwidthCeiling is measure.BandwidthCeiling
