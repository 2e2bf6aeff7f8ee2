"""A non-editable install carries the presets: the wheel built from the checkout holds every configs/*.yaml inside
the eagle3 package, and once installed, a preset loads by name from another working directory with no checkout on
the import path."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "configs", "eagle3", "infra", "flows", "tasks", "deployments")
PRESETS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


def _pip(*args: str, cwd: Path) -> None:
    """``python -m pip ARGS`` offline (no index: the build uses the venv's setuptools)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args, "--no-index", "--disable-pip-version-check", "-q"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the checkout's sources (a build writes build/ and egg-info
    beside them, which must not race another build in the shared checkout)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src), cwd=src)
    (found,) = dist.glob("eagle3_pipeline-*.whl")
    return found


def test_the_wheel_holds_every_preset(wheel):
    """Each configs/*.yaml is in the wheel as eagle3/presets/<name>, byte for byte."""
    with zipfile.ZipFile(wheel) as zf:
        shipped = {Path(n).name: zf.read(n) for n in zf.namelist() if n.startswith("eagle3/presets/")}
    assert sorted(shipped) == PRESETS and len(PRESETS) >= 2
    for name in PRESETS:
        assert shipped[name] == (ROOT / "configs" / name).read_bytes(), name


def test_an_installed_package_loads_presets_by_name_from_anywhere(wheel, tmp_path):
    """The wheel installed into a folder of its own, Python started in an unrelated folder with only that folder and
    the venv's third-party packages on its path (no site hooks, so not the checkout's editable install): eagle3 comes
    from the install, lists every preset and loads one by name."""
    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _pip("install", "--no-deps", "--target", str(target), str(wheel), cwd=tmp_path)
    third_party = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    code = (
        "import sys; sys.path[:0] = sys.argv[1:]\n"
        "import eagle3.config as c\n"
        "cfg = c.load_config('smollm2-demo')\n"
        "print(c.__file__); print(' '.join(c.list_presets())); print(cfg.run.name, cfg.train.num_epochs)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code, str(target), *third_party],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    module_file, presets, loaded = proc.stdout.splitlines()
    assert Path(module_file).is_relative_to(target)
    assert presets.split() == [Path(p).stem for p in PRESETS]
    assert loaded.split()[0] == "smollm2-demo"
