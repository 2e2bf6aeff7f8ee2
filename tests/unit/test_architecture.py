"""The codebase's import rules, checked by parsing every module; and no citation of files outside the repo."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
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


_LAB = re.compile(r"lab([./][\w./-]*)?")
"""A module or path in the lab, as a whole string: ``lab``, ``lab.fuzz``, ``lab/quality_run.sh``."""


def _lab_references(path: Path) -> list[str]:
    """The lab modules ``path`` imports (anywhere in it) and its string literals that name a lab module or file (a
    script run by path, ``runpy.run_path``, ``importlib.import_module``)."""
    found = [f"imports {name}" for name in _imports(path, top_level_only=False) if name.split(".")[0] == "lab"]
    tree = ast.parse(path.read_text(), filename=str(path))
    found += [
        f"names {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _LAB.fullmatch(node.value)
    ]
    return found


_NAMES_THE_LAB_FOLDER = {"tests/unit/test_lint.py": "lab"}
"""Files that may name the lab as a bare string: the lint test passes the folder to ruff (it runs no lab code)."""


@pytest.mark.parametrize("package", ["eagle3", "infra", "flows", "tasks", "deployments", "tests"])
def test_the_lab_is_one_way(package):
    """The lab (lab/) imports the core, never the reverse: neither the core nor the default tests import a lab
    module or run a lab file (the lab's own tests live in lab/tests/)."""
    this = Path(__file__).resolve()
    paths = [path for path in sorted((ROOT / package).rglob("*.py")) if path.resolve() != this]
    assert paths, f"no Python files under {package}/"
    found = []
    for path in paths:
        name = path.relative_to(ROOT).as_posix()
        allowed = _NAMES_THE_LAB_FOLDER.get(name)
        found += [f"{name} {hit}" for hit in _lab_references(path) if allowed is None or hit != f"names {allowed!r}"]
    assert found == []


def test_lab_reference_checker_detects_each_form(tmp_path):
    """Imports of the lab (nested ones too) and lab paths or module names in strings are found; a name that merely
    starts with "lab" and prose that mentions a lab file are not."""
    module = tmp_path / "m.py"
    module.write_text(
        "import lab.fuzz\nfrom lab import curve_carry\nimport laboratory\n"
        "def f():\n    from lab.shapes import X\n    runpy.run_path('lab/eval_speed.py')\n"
        "    importlib.import_module('lab.fuzz')\n"
        "    return 'label', 'lab', 'a lab', 'lab/x.py: a docstring'\n"
    )
    assert _lab_references(module) == [
        "imports lab.fuzz",
        "imports lab",
        "imports lab.shapes",
        "names 'lab/eval_speed.py'",
        "names 'lab.fuzz'",
        "names 'lab'",
    ]


def test_rule_checker_detects_a_violation(tmp_path):
    """The parser sees an import nested in a function (so the checks above can fail)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import prefect\n")
    assert _imports(module, top_level_only=False) == ["prefect"]
    assert _imports(module, top_level_only=True) == []


_REF, _DESIGN = "refer" + "ence", "ARCHI" + "TECTURE"  # spelled in parts: this file is scanned by the rule checks
_OUTSIDE_FILES = re.compile(
    rf"shared/{_REF}|\b{_REF}/[\w-]+\.md|{_REF} (section|doc)|(?-i:{_DESIGN})(\.md| section)"
    r"|\b(sglang|prefect|eagle3-training|offline-assets|style-anchors|transformers-generation"
    r"|prefect-postgres-auth-sglang)\.md\b",
    re.IGNORECASE,
)
"""Citations of design notes kept outside this repository; code and docs cite the upstream project instead."""


def _outside_citations(paths: list[Path]) -> list[str]:
    hits = []
    for path in paths:
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if _OUTSIDE_FILES.search(line):
                hits.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {line.strip()}")
    return hits


def test_no_tracked_file_cites_files_outside_the_repo():
    """No tracked text file (but this one) cites the design notes kept outside the repository or their sections."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to list the tracked files")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    this = Path(__file__).resolve()
    paths = [ROOT / name for name in listed.decode().split("\0") if name]
    assert _outside_citations([p for p in paths if p.is_file() and p.resolve() != this]) == []


def test_outside_citation_checker_detects_each_form(tmp_path):
    """The pattern catches every form such a citation took, and leaves ordinary uses of the words alone."""
    cited = [
        f"see shared/{_REF}/sglang.md",
        f"per `{_REF}/sglang.md` section 8",
        f"({_REF} section 5)",
        f"{_DESIGN} section 4",
        f"{_DESIGN}.md",
        f"{_REF}/eagle3-training.md, appendix",
        "prefect" + ".md",
        f"In the offsets of the {_REF} doc",
    ]
    fine = [
        'architectures: ["LlamaForCausalLMEagle3"]',
        "the greedy reference",
        "docs/export.md",
        f"SGLANG_{_DESIGN} = 1",
        "python/sglang/srt/models/llama_eagle3.py",
    ]
    for i, line in enumerate(cited + fine):
        (tmp_path / f"{i}.txt").write_text(line + "\n")
    hits = _outside_citations(sorted(tmp_path.iterdir(), key=lambda p: int(p.stem)))
    assert [h.split(": ", 1)[1] for h in hits] == cited
