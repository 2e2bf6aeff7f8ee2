"""Run code under SGLang 0.5.16, installed beside the venv's 0.5.23 by scripts/bootstrap.sh.

``run_under(version, code)`` runs ``code`` in a fresh interpreter: for the venv's own release as is, for
0.5.16 with ``.venv/sglang-0.5.16`` first on PYTHONPATH (so ``import sglang`` is 0.5.16) and ``PRELUDE``
first. The prelude only makes 0.5.16's import chain load on this CPU-only venv; SGLang's code is not touched:
- torchvision from PyPI is the CUDA build: on a CPU torch its ``_C`` does not load, and its
  ``_meta_registrations`` then fails registering fakes for ``torchvision::nms``/``qnms`` that no library
  defined. The prelude defines those two schemas (only when that import failed), so the Python part of
  torchvision imports; no torchvision op is ever run by a parser.
- the venv's ``kernels`` package is newer than transformers 5.12.1 understands (its LayerRepository
  wants a version): hidden, so that transformers treats hub kernels as not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDE = {"0.5.16": Path(sys.prefix) / "sglang-0.5.16"}
PRELUDE = """
import sys
sys.modules["kernels"] = None
try:
    import torchvision  # noqa: F401
except RuntimeError as exc:
    if "torchvision::" not in str(exc):
        raise
    import torch
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    _torchvision_lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        _torchvision_lib.define(op + "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except ImportError:
    pass
"""


def side_folder(version: str) -> Path | None:
    """The folder holding ``version`` beside the venv's release, or None when that is the venv's own."""
    return SIDE.get(version)


def available(version: str) -> bool:
    folder = side_folder(version)
    return folder is None or (folder / "sglang" / "__init__.py").is_file()


def run_under(version: str, code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter whose ``import sglang`` is ``version``; cwd is the repository root."""
    folder = side_folder(version)
    env = dict(os.environ)
    paths = [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if folder is not None:
        paths.insert(0, str(folder))
        code = PRELUDE + code
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
