"""The linter, the formatter, the type checker and the spelling checker keep the rules (pyproject.toml [tool.ruff],
[tool.mypy], [tool.codespell]): ruff finds nothing and would reformat nothing in the code, mypy nothing in the
core, codespell nothing in the repository's text files. Each runs as its own process in the repository root, so
its cache (.ruff_cache, .mypy_cache) makes a run after a small change take seconds."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF_PATHS = ("eagle3", "infra", "flows", "tasks", "deployments", "scripts", "tests", "lab")


def _run(tool: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``python -m tool args`` in the repository root (skipped when the tool is not installed)."""
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (it is in the dev extra: pip install -e '.[dev]')")
    # PYTHONPATH left out: a test may have put SGLang 0.5.16's folder first (tests/sglang_side.py), and mypy would
    # then read that release instead of the installed one.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )


def test_ruff_finds_nothing():
    """`ruff check` on the core, the tests and the lab (rules: pyproject.toml [tool.ruff.lint])."""
    proc = _run("ruff", "check", "--output-format", "concise", *RUFF_PATHS, timeout_s=300)
    assert proc.returncode == 0, f"ruff check {' '.join(RUFF_PATHS)}:\n{proc.stdout}{proc.stderr}"


def test_ruff_format_changes_nothing():
    """`ruff format --check` on the same paths: the code is laid out as the formatter writes it."""
    proc = _run("ruff", "format", "--check", *RUFF_PATHS, timeout_s=300)
    assert proc.returncode == 0, f"ruff format --check {' '.join(RUFF_PATHS)} (run it without --check):\n{proc.stdout}"


def test_mypy_finds_nothing():
    """mypy on the core packages (the files and settings of pyproject.toml [tool.mypy])."""
    proc = _run("mypy", timeout_s=900)
    assert proc.returncode == 0, f"mypy (pyproject.toml [tool.mypy]):\n{proc.stdout}{proc.stderr}"


def test_codespell_finds_nothing():
    """codespell on the repository (what it skips and the words it accepts: pyproject.toml [tool.codespell])."""
    proc = _run("codespell_lib", timeout_s=300)
    assert proc.returncode == 0, f"codespell (pyproject.toml [tool.codespell]):\n{proc.stdout}{proc.stderr}"
