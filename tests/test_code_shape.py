"""The package's shape, enforced: layered imports without cycles (import-linter's contracts in
``pyproject.toml``), small modules, no reaching into another module's private names, checkpointd
imports at module level only, and the environment read in one module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "checkpointd"
MODULES = sorted(p for p in SRC.rglob("*.py"))
MAX_LINES = 500
ENV_MODULE = SRC / "options.py"


def _rel(path: Path) -> str:
    return str(path.relative_to(SRC.parent))


def _checkpointd_aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound to checkpointd modules at module level: ``{alias: module}``."""
    aliases = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("checkpointd"):
            for name in node.names:
                aliases[name.asname or name.name] = f"{node.module}.{name.name}"
        elif isinstance(node, ast.Import):
            for name in node.names:
                if name.name.startswith("checkpointd"):
                    aliases[name.asname or name.name.split(".")[0]] = name.name
    return aliases


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=SRC.parents[1], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_module_is_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{_rel(path)} has {lines} lines (at most {MAX_LINES}): split it by responsibility"


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_no_private_names_of_other_modules(path: Path) -> None:
    tree = ast.parse(path.read_text())
    aliases = _checkpointd_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("checkpointd"):
            found += [f"from {node.module} import {n.name}" for n in node.names
                      if n.name.startswith("_") and not n.name.startswith("__")]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
              and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
    assert not found, f"{_rel(path)} uses private names of other modules: {found}"


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_checkpointd_imports_at_module_level(path: Path) -> None:
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    inner = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and id(node) in top:  # `if TYPE_CHECKING:` blocks at module level
            top.update(map(id, node.body))
    for node in ast.walk(tree):
        if id(node) in top:
            continue
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("checkpointd")):
            inner.append(f"line {node.lineno}: from {'.' * node.level}{node.module or ''}")
        elif isinstance(node, ast.Import) and any(n.name.startswith("checkpointd") for n in node.names):
            inner.append(f"line {node.lineno}: import {node.names[0].name}")
    assert not inner, f"{_rel(path)} imports checkpointd modules inside functions (an import cycle dodged?): {inner}"


def test_environment_is_read_in_one_module() -> None:
    readers = [_rel(p) for p in MODULES if p != ENV_MODULE and "CHECKPOINTD_" in p.read_text()]
    assert not readers, f"CHECKPOINTD_* variables appear outside {_rel(ENV_MODULE)}: {readers}"
    names = set()
    for node in ast.walk(ast.parse(ENV_MODULE.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("CHECKPOINTD_"):
            names.add(node.value)
    assert 0 < len(names) <= 6, sorted(names)
