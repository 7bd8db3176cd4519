"""`python -m llminfer.bench structured` end to end on the bundled model: the report's counts, the constrained
answers at least as valid as the free ones, and the two prefix caches' equal outputs."""
from __future__ import annotations

import json

from llminfer import bench
from llminfer.bench import structured


def test_the_structured_benchmark_writes_its_report(tmp_path, capsys):
    assert len(structured.prompts()) == 50 and len(structured.SCHEMAS) == 10
    assert bench.main(["structured", "--model", "smollm2-135m-instruct", "--max-tokens", "12", "--shots", "2",
                       "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("structured-*.json")
    report = json.loads(path.read_text())
    assert report["free"]["of"] == report["constrained"]["of"] == 50
    assert report["constrained"]["valid"] >= report["free"]["valid"]
    for row in report["constrained"]["rows"]:                 # cut at 12 tokens, but never off the schema's path
        assert row["valid"] or not row["text"].startswith(("`", " ", "Here")), row
    for name, caches in report["prefix_caches"].items():
        assert caches["identical_outputs"], name
        assert caches["radix"]["saved_tokens"] >= caches["hash"]["saved_tokens"] > 0, name
    assert "parse and validate" in capsys.readouterr().out
