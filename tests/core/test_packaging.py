"""The package as a user installs it: the wheel carries the bundled model and the widgets."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_the_bundled_model(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("llminfer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for file in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"):
        assert f"llminfer/models/tiny-capitals/{file}" in names
    assert "llminfer/widgets/__init__.py" in names and "llminfer/generate.py" in names
    # every subpackage in the source tree is in the wheel (a package missing from pyproject.toml is not)
    for init in (ROOT / "llminfer").rglob("__init__.py"):
        assert init.relative_to(ROOT).as_posix() in names, f"{init.parent.name} is not packaged"
    assert not any(name.startswith(("tests/", "chapters/")) for name in names)
    # the native CPU kernels are compiled from their source on the user's machine: it must ship
    from llminfer import cpu
    for source in cpu.SOURCES + cpu.HEADERS:
        assert f"llminfer/cpu/{source.name}" in names
