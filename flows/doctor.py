"""`eagle3 doctor [--preset NAME]`: one screen that says whether this machine can run a preset, and how to fix it.

Versions (Python, torch and its device, transformers, prefect), whether each optional piece imports,
the installed SGLang's version and whether every launch argv we build parses with that version's own
parser (infra/sglang_argv_check.py), the Prefect API and whether it answers, free disk, and for every
preset whether its target and data resolve (files and packages exist; no model is loaded). Exit 1 when something
the chosen preset needs is missing; each such line carries its fix.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import RunConfig, list_presets, load_config
from infra.sglang_modes import MODES, SGLANG_VERSIONS

PIP = f"{sys.executable} -m pip install"


@dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, whether it is fine, and the one-line fix when not."""

    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self, needed: bool) -> str:
        mark = "ok " if self.ok else ("MISSING" if needed else "-- ")
        text = f"  {mark:<7} {self.name:<28} {self.detail}"
        return text + (f"\n          fix: {self.fix}" if not self.ok and self.fix else "")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _imports(module: str) -> str | None:
    """None when ``module`` imports, else the error in one line."""
    try:
        importlib.import_module(module)
        return None
    except Exception as exc:  # an optional piece may fail with anything (ImportError, a broken CUDA lib, ...)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def versions() -> list[str]:
    """Python, torch (device, CUDA), transformers and prefect versions."""
    import torch

    cuda = (
        f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else "no CUDA device (CPU)"
    )
    return [
        f"  python        {sys.version.split()[0]} ({sys.executable})",
        f"  torch         {torch.__version__}; {cuda}",
        f"  transformers  {_version('transformers')}",
        f"  prefect       {_version('prefect')}",
    ]


def gguf_check() -> Check:
    """transformers' from_pretrained(..., gguf_file=...) needs accelerate (>= its minimum) and gguf."""
    from transformers.utils import is_accelerate_available, is_gguf_available
    from transformers.utils.import_utils import ACCELERATE_MIN_VERSION, GGUF_MIN_VERSION

    missing = (
        [f"'accelerate>={ACCELERATE_MIN_VERSION}'"] if not is_accelerate_available() or _imports("accelerate") else []
    )
    missing += [f"'gguf>={GGUF_MIN_VERSION}'"] if not is_gguf_available() else []
    detail = (
        f"accelerate {_version('accelerate')}, gguf {_version('gguf')}"
        if not missing
        else "transformers cannot load GGUF files without " + " and ".join(m.strip("'") for m in missing)
    )
    return Check("GGUF loading", not missing, detail, f"{PIP} {' '.join(missing)}")


def optional_checks() -> dict[str, Check]:
    """{piece: Check} for the optional pieces: GGUF loading, SGLang's argument parser, speculators, chromium."""
    sglang_error = _imports("sglang.srt.server_args")
    speculators_error = _imports("speculators")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    return {
        "gguf": gguf_check(),
        "sglang": Check(
            "SGLang argument parser",
            sglang_error is None,
            f"sglang {_version('sglang')}" if sglang_error is None else sglang_error,
            f"{PIP} -r tests/sglang-parser-requirements.txt (or use server.python with sglang)",
        ),
        "speculators": Check(
            "speculators",
            speculators_error is None,
            speculators_error or f"speculators {_version('speculators')}",
            f"{PIP} -r tests/speculators-requirements.txt",
        ),
        "chromium": Check(
            "chromium (UI screenshots)", browser is not None, browser or "not on PATH", "apt-get install -y chromium"
        ),
    }


def sglang_mode_checks() -> tuple[str | None, list[Check]]:
    """(installed sglang version or None, one Check per ServerSpec mode: its argv through that version's parser)."""
    from infra.sglang_argv_check import check_modes, installed_version

    version = installed_version()
    if version is None:
        return None, []
    try:
        results = check_modes(version)
    except Exception as exc:  # the parser itself does not import or build
        return version, [
            Check(
                "argv of every mode",
                False,
                f"{type(exc).__name__}: {exc}",
                f"{PIP} -r tests/sglang-parser-requirements.txt",
            )
        ]
    return version, [
        Check(
            f"argv {r.mode}",
            r.ok,
            r.detail if r.ok or not r.known_gap else f"{r.mode}: {r.known_gap} ({r.detail})",
            "" if r.ok else f"run this mode with an SGLang whose parser takes it ({SGLANG_VERSIONS})",
        )
        for r in results
    ]


def sglang_modes_used(cfg: RunConfig) -> set[str]:
    """ServerSpec modes a run of ``cfg`` launches (sglang capture: its server_mode and capture_final for
    final_hidden with capture_aux; serve: the baseline and its EAGLE-3 or, drafter.family=dflash, DFlash twin;
    regenerate.backend sglang: the plain server)."""
    drafter = "dflash" if cfg.drafter.family == "dflash" else "speculative"
    modes = {"serve", drafter} if cfg.serve.enabled else set()
    if cfg.regenerate.enabled and cfg.regenerate.backend == "sglang":
        modes.add("serve")
    if cfg.capture.backend == "sglang":
        server_mode = getattr(cfg.capture.sglang, "server_mode", "capture_aux")
        modes.add(server_mode)
        if server_mode == "capture_aux" and getattr(cfg.capture, "supervision", None) == "final_hidden":
            modes.add("capture_final")
    return modes & set(MODES)


def needed_pieces(cfg: RunConfig) -> set[str]:
    """The optional pieces a run of ``cfg`` imports in this interpreter."""
    needs = {"gguf"} if cfg.target.kind == "gguf" else set()
    if cfg.capture.device_map == "auto":
        needs.add("accelerate")
    return needs


def prefect_check(workdir: str) -> Check:
    """The API URL the commands use (PREFECT_API_URL, else this workdir's local server) and whether it answers."""
    import httpx

    from flows.local_server import for_workdir

    url = os.environ.get("PREFECT_API_URL") or for_workdir(workdir).api_url
    try:
        answers = httpx.get(f"{url.rstrip('/')}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        answers = False
    return Check(
        "Prefect API",
        answers,
        f"{url} " + ("answers" if answers else "does not answer"),
        "eagle3 server start (eagle3 demo and eagle3 run start it themselves)",
    )


def disk_line(label: str, path: Path) -> str:
    """Free space on the filesystem that holds ``path`` (its nearest existing parent)."""
    probe = path.resolve()
    while not probe.exists():
        probe = probe.parent
    return f"  disk   {label:<28} {shutil.disk_usage(probe).free / 1e9:,.1f} GB free at {path}"


def _resolves(what: str, setting: str, path: str | None, need_config: bool = False) -> Check:
    from eagle3.run.paths import resolve_path

    try:
        resolved = resolve_path(path or "")
    except Exception as exc:  # pkg:// of a package that is not installed
        return Check(what, False, str(exc), "./scripts/bootstrap.sh installs the packages the presets use")
    ok = (resolved / "config.json").is_file() if need_config else resolved.is_file()
    return Check(
        what,
        ok,
        str(resolved) + ("" if ok else " not found"),
        "" if ok else f"put it there, or point --set {setting}=... at it",
    )


def preset_checks(cfg: RunConfig) -> list[Check]:
    """Whether the preset's target and data files resolve (no model is loaded)."""
    t = cfg.target
    checks = (
        [Check("target (tiny)", True, "built on first use")]
        if t.kind == "tiny"
        else [_resolves(f"target ({t.kind})", "target.path", t.path, need_config=t.kind == "hf")]
    )
    checks += [
        Check(f"data source {s.name}", True, "written by the synthesize stage")
        if s.format == "synthetic"
        else _resolves(f"data source {s.name}", f"data.sources.{i}.path", s.path)
        for i, s in enumerate(cfg.data.sources)
    ]
    users = [
        why
        for why, used in (
            ("capture.backend sglang", cfg.capture.backend == "sglang"),
            ("regenerate.backend sglang", cfg.regenerate.enabled and cfg.regenerate.backend == "sglang"),
            ("serve.enabled", cfg.serve.enabled),
        )
        if used
    ]
    if users:
        python = cfg.server.python
        found = shutil.which(python)
        checks.append(
            Check(
                f"interpreter for {' and '.join(users)}",
                found is not None,
                found or f"{python} not found",
                "set server.python to an interpreter that has sglang",
            )
        )
    return checks


def run_doctor(preset: str) -> int:
    """Print the report; 0 when everything ``preset`` needs is there, else 1."""
    cfg = load_config(preset)
    print("eagle3 doctor\n" + "\n".join(versions()))
    pieces = optional_checks()
    needs = needed_pieces(cfg)
    if "accelerate" in needs:
        pieces["accelerate"] = Check(
            "accelerate (device_map auto)",
            _imports("accelerate") is None,
            f"accelerate {_version('accelerate')}",
            f"{PIP} accelerate",
        )
    print("optional pieces (MISSING = the chosen preset needs it):")
    print("\n".join(c.line(k in needs) for k, c in pieces.items()))
    version, mode_checks = sglang_mode_checks()
    used = sglang_modes_used(cfg)
    print(
        f"SGLang {version}: every launch argv through its own parser (MISSING = the chosen preset launches it):"
        if version
        else "SGLang: not importable here, so no launch argv was parsed (the preset's server.python"
        " interpreter may still have it)"
    )
    needed_mode = (
        {c.name: c.name.removeprefix("argv ") in used or c.name == "argv of every mode" for c in mode_checks}
        if used
        else {}
    )
    for c in mode_checks:
        print(c.line(needed_mode.get(c.name, False)))
    failed_modes = [c for c in mode_checks if not c.ok and needed_mode.get(c.name)]
    api = prefect_check(cfg.run.workdir)
    print(api.line(False))
    print(disk_line("workdir", Path(cfg.run.workdir)) + "\n" + disk_line("target cache", cfg.target_cache_dir))
    failed = [c for k, c in pieces.items() if k in needs and not c.ok] + failed_modes
    for name in list_presets() + ([] if preset in list_presets() else [preset]):
        checks = preset_checks(load_config(name))
        chosen = name == preset
        print(f"preset {name}{' (chosen)' if chosen else ''}:")
        print("\n".join(c.line(chosen) for c in checks))
        failed += [c for c in checks if chosen and not c.ok]
    print(
        f"\n{preset}: " + ("ready" if not failed else "NOT ready: " + "; ".join(f"{c.name}: {c.fix}" for c in failed))
    )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """python -m flows.doctor [--preset NAME]"""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2-demo", help="the preset to check for (default smollm2-demo)")
    return run_doctor(parser.parse_args(argv).preset)


if __name__ == "__main__":
    sys.exit(main())
