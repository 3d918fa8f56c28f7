"""The package's layout keeps its promises: only ``autospec.cli`` prints, every command follows
one registration convention, the store-only commands never import torch, and the wheel
carries every package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = [ROOT / "autospec", ROOT / "policies", ROOT / "store"]


def _sources():
    for top in LIBRARY:
        yield from sorted(top.rglob("*.py"))


def _prints(path: Path) -> list[str]:
    """``print(...)`` calls and writes to sys.stdout / sys.stderr in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "print":
            found.append(f"{path.name}:{node.lineno} print()")
        elif (isinstance(f, ast.Attribute) and f.attr == "write"
              and isinstance(f.value, ast.Attribute) and f.value.attr in ("stdout", "stderr")):
            found.append(f"{path.name}:{node.lineno} sys.{f.value.attr}.write()")
    return found


def test_only_the_command_line_prints():
    cli = ROOT / "autospec" / "cli"
    outside = [p for path in _sources() if cli not in path.parents for p in _prints(path)]
    assert outside == [], f"library code must log, not print: {outside}"
    assert any(_prints(p) for p in cli.glob("*.py"))  # the scan does find prints


def test_library_code_never_imports_the_command_line():
    cli = ROOT / "autospec" / "cli"
    offenders = []
    for path in _sources():
        if cli in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names
                          if n == "autospec.cli" or n.startswith("autospec.cli.")]
    assert offenders == []


def test_every_command_module_registers_the_same_way():
    from autospec.cli import COMMANDS, build_parser

    modules = {p.stem for p in (ROOT / "autospec" / "cli").glob("*.py")}
    assert set(COMMANDS) == modules - {"__init__", "__main__", "common"}
    parser = build_parser()
    choices = parser._subparsers._group_actions[0].choices
    assert list(choices) == list(COMMANDS)
    for name in COMMANDS:
        module = sys.modules[f"autospec.cli.{name}"]
        assert callable(module.register), name
        defaults = choices[name]._defaults
        if name == "categorize":  # its actions carry the run functions
            sub = choices[name]._subparsers._group_actions[0].choices
            defaults = {**sub["fit"]._defaults, "parser": sub["fit"]}
        assert callable(defaults["run"]) and defaults["parser"] is not None, name


@pytest.mark.parametrize("argv", [["stats", "--help"], ["report", "--help"],
                                  ["tune", "--help"], ["categorize", "show", "--help"],
                                  ["metrics", "--help"], ["export", "--help"],
                                  ["ingest", "--help"]])
def test_store_only_commands_do_not_import_torch(argv):
    code = (f"import sys\nfrom autospec.cli import main\ntry:\n    main({argv!r})\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_the_wheel_lists_every_package():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(meta["tool"]["setuptools"]["packages"])
    assert "package-dir" not in meta["tool"]["setuptools"]  # one tree: the package's folders
    found = {".".join(init.parent.relative_to(ROOT).parts)
             for init in (ROOT / "autospec").rglob("__init__.py")}
    assert {"autospec.policies", "autospec.store", "autospec.engine.proposers"} <= found
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
