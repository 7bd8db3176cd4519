"""`python -m llminfer.bench rows` end to end: the record's shape (a row per format and thread count, a time per row
count, the ratios to the first) and the printed table."""
from __future__ import annotations

import json

import pytest

from llminfer import bench
from llminfer import cpu as native_cpu


@pytest.mark.skipif(not native_cpu.available(), reason="the native CPU kernels do not build here")
def test_the_rows_benchmark_writes_its_record(tmp_path, capsys):
    assert bench.main(["rows", "--shape", "tiny-capitals", "--formats", "fp32", "int8", "--rows", "1", "3",
                       "--threads", "1", "--rounds", "3", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("rows-*.json")
    report = json.loads(path.read_text())
    assert report["rows"] == [1, 3] and report["isa"] == native_cpu.isa()
    assert [(r["format"], r["threads"]) for r in report["results"]] == [("fp32", 1), ("int8", 1)]
    for result in report["results"]:
        assert len(result["ms"]) == 2 and all(m > 0 for m in result["ms"])
        assert result["ratio"][0] == 1.0 and result["ratio"][1] == pytest.approx(result["ms"][1] / result["ms"][0])
    out = capsys.readouterr().out
    assert "ms per layer-stack step" in out and f"wrote {path}" in out
