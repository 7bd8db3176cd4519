"""The package as a user installs it: the wheel carries the bundled model and the widgets; the make targets that
the Makefile declares and the README names all exist."""
from __future__ import annotations

import re
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


def makefile_rules(text: str) -> tuple[list[str], dict[str, tuple[str, list[str]]]]:
    """Returns (the targets named .PHONY, each explicit target -> (its prerequisites, its recipe lines))."""
    lines = text.replace("\\\n", " ").splitlines()
    phony, rules = [], {}
    for index, line in enumerate(lines):
        match = re.match(r"^([A-Za-z0-9_.$()/ -]+?)\s*:(?![=:])(.*)$", line)
        if not match or line.startswith("\t"):
            continue
        recipe = []
        for following in lines[index + 1:]:
            if not following.startswith("\t"):
                break
            recipe.append(following.strip())
        prerequisites = match[2].split("#")[0].strip()
        for target in match[1].split():
            if target == ".PHONY":
                phony += prerequisites.split()
            else:
                rules[target] = (prerequisites, recipe)
    return phony, rules


def test_every_phony_target_has_a_rule_and_every_make_command_of_the_readme_exists():
    phony, rules = makefile_rules((ROOT / "Makefile").read_text())
    assert {"lab", "test", "test-unit", "test-notebooks", "bench-quick", "book"} <= set(phony)
    # a target with no rule would answer "Nothing to be done" and succeed without doing anything
    without = [target for target in phony if target not in rules or rules[target] == ("", [])]
    assert not without, f"declared .PHONY in the Makefile but with no rule: {without}"
    assert rules["test"][0].split() == ["test-unit", "test-notebooks"] and not rules["test"][1]
    named = set(re.findall(r"\bmake\s+([a-z][\w-]*)", (ROOT / "README.md").read_text()))
    assert {"lab", "test"} <= named
    assert not named - set(rules), f"README.md names make targets the Makefile lacks: {sorted(named - set(rules))}"


def test_the_makefile_parser_sees_a_phantom_target():
    phony, rules = makefile_rules(".PHONY: a b \\\n\tc\na: x\nb:\n\techo b\n")
    assert phony == ["a", "b", "c"]
    assert [target for target in phony if target not in rules or rules[target] == ("", [])] == ["c"]
