"""requirements-cpu.lock covers what scripts/bootstrap.sh installs: every requirement of pyproject.toml (and its dev
extra), of the requirement files the bootstrap installs into the venv and of its --no-deps model/data packages has
one exact line in the lock, at a version the requirement allows. A requirement added or changed without
scripts/lock.sh fails here, naming it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements-cpu.lock"
VENV_REQUIREMENT_FILES = (
    "tests/speculators-requirements.txt",
    "tests/sglang-parser-requirements.txt",
    "tests/sglang-draft-requirements.txt",
)
"""The requirement files the bootstrap installs into the venv (SGLang 0.5.16's goes into a folder of its own)."""


def locked() -> dict[str, Version]:
    """{canonical name: version} of the lock's lines (each must read name==version)."""
    pins: dict[str, Version] = {}
    for line in LOCK.read_text().splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version and " " not in version, f"not an exact pin: {line!r}"
        assert canonicalize_name(name) not in pins, f"{name} is locked twice"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def bootstrap_requirements() -> list[str]:
    """Every requirement the bootstrap installs into the venv, as written where it is declared."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])
    script = (ROOT / "scripts" / "bootstrap.sh").read_text()
    reqs += re.search(r'^DATA_PACKAGES="([^"]+)"', script, re.M).group(1).split()  # type: ignore[union-attr]
    reqs += re.findall(r"--no-deps \S* ?(sglang==[\d.]+)", script)
    reqs.append(re.search(r"EAGLE3_TORCH:-([^}]+)}", script).group(1))  # type: ignore[union-attr]
    for name in VENV_REQUIREMENT_FILES:
        reqs += [
            line.split("#")[0].strip() for line in (ROOT / name).read_text().splitlines() if line.split("#")[0].strip()
        ]
    return reqs


def test_the_lock_pins_every_bootstrap_requirement_at_an_allowed_version():
    """Each requirement (pyproject, dev extra, data packages, SGLang, torch, the venv's requirement files) is locked
    exactly once, at a version inside its specifier."""
    pins = locked()
    reqs = bootstrap_requirements()
    assert len(reqs) > 30 and any(r.startswith("sglang==") for r in reqs) and any(r.startswith("torch") for r in reqs)
    for text in reqs:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in requirements-cpu.lock: run scripts/lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements-cpu.lock has {req.name}=={pins[name]}, outside {text!r}: run scripts/lock.sh"
        )


def test_the_lock_holds_the_cpu_build_of_torch():
    """torch is locked to its CPU build (a +cpu local version): the lock is the CPU install's."""
    assert locked()["torch"].local == "cpu"
