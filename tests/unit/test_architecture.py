"""Import rules of ARCHITECTURE.md section 2, checked by parsing every module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path, top_level_only: bool) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _violations(package: str, forbidden: tuple[str, ...], top_level_only: bool) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path, top_level_only):
            if name.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


@pytest.mark.parametrize("package", ["eagle3", "infra"])
def test_core_never_imports_orchestration(package):
    """eagle3/ and infra/ import neither prefect nor flows, tasks or deployments, anywhere."""
    assert _violations(package, ("prefect", "flows", "tasks", "deployments"), top_level_only=False) == []


def test_infra_does_not_import_eagle3():
    """infra/ is below eagle3/: it never imports it."""
    assert _violations("infra", ("eagle3",), top_level_only=False) == []


@pytest.mark.parametrize("package", ["flows", "tasks"])
def test_orchestration_has_no_module_level_torch(package):
    """flows/ and tasks/ do not import torch (or transformers) at module level."""
    assert _violations(package, ("torch", "transformers"), top_level_only=True) == []


def test_rule_checker_detects_a_violation(tmp_path):
    """The parser sees an import nested in a function (so the checks above can fail)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import prefect\n")
    assert _imports(module, top_level_only=False) == ["prefect"]
    assert _imports(module, top_level_only=True) == []
