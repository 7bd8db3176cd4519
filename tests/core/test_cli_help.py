"""Every command line of the package prints its --help with each option's default said once."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llminfer.checks import HelpFormatter

PACKAGE = Path(__file__).resolve().parents[2] / "llminfer"


def command_lines() -> list[str]:
    """The modules that build an argparse parser, as `python -m` names them (a package for its __main__.py);
    bench/'s entry points are left to the benchmark's own tests."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[1] == "bench" or "ArgumentParser(" not in path.read_text():
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return names


def doubled_defaults(help_text: str) -> list[str]:
    """The lines of a --help printed one option a line that say "(default" more than once."""
    return [line.strip() for line in help_text.splitlines() if len(re.findall(r"\(default", line)) > 1]


def test_the_command_lines_are_found():
    assert {"llminfer.serve", "llminfer.parallel", "llminfer.notebooks"} <= set(command_lines())


@pytest.mark.parametrize("module", command_lines())
def test_help_says_each_default_once(module):
    # wide enough that argparse puts every option's help on one line
    env = {**os.environ, "COLUMNS": "1000"}
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                          env=env, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
    assert doubled_defaults(done.stdout) == [], f"python -m {module} --help repeats a default"


def _help(formatter) -> str:
    parser = argparse.ArgumentParser(prog="demo", formatter_class=formatter)
    parser.add_argument("--device", default=None, help="where to run (default: the best available)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 2; --quick 1)")
    parser.add_argument("--port", type=int, default=8000, help="the port")
    parser.add_argument("--quiet", action="store_true", help="print less")
    return parser.format_help()


def test_the_formatter_says_a_default_once_and_only_where_it_tells_something(monkeypatch):
    """argparse's own ArgumentDefaultsHelpFormatter doubles a default the help already names; HelpFormatter does
    not, leaves out None and an off switch, and still appends a real default."""
    monkeypatch.setenv("COLUMNS", "1000")
    assert len(doubled_defaults(_help(argparse.ArgumentDefaultsHelpFormatter))) == 2
    text = _help(HelpFormatter)
    assert doubled_defaults(text) == []
    assert "the port (default: 8000)" in text and "where to run (default: the best available)" in text
    assert "(default: None)" not in text and "(default: False)" not in text and "print less\n" in text
