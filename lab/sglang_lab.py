"""Helpers shared by the SGLang lab benchmarks (lab/sglang_capture.py, lab/sglang_regenerate.py).

Lab code: it imports the core, the core never imports it. What is here:

  say                   a progress line, flushed (PYTHONUNBUFFERED may be unset on the GPU host)
  write_results         results JSON written atomically (temp file + rename)
  installed_sglang      the sglang version the server interpreter has (``<python> -c importlib.metadata``)
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python lab/x.py` puts lab/ first, not the repository
    sys.path.insert(0, str(REPO))

from infra.storage import atomic_write_text  # noqa: E402

_T0 = time.monotonic()
VERSION_PROBE = "import importlib.metadata as m; print(m.version('sglang'))"

if TYPE_CHECKING:
    from eagle3.config import RunConfig


def say(text: str) -> None:
    """One progress line with the seconds since start, flushed at once."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {text}", flush=True)


def write_results(path: Path, results: dict[str, Any]) -> Path:
    """Write ``results`` as indented JSON atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")


def installed_sglang(python: str, timeout_s: float = 120.0) -> str:
    """The sglang distribution version ``python`` sees; RuntimeError naming the interpreter when it has none."""
    try:
        done = subprocess.run([python, "-c", VERSION_PROBE], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"cannot ask {python!r} for its sglang version: {type(exc).__name__}: {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(
            f"{python!r} has no sglang distribution (exit {done.returncode}): {done.stderr.strip()[-400:]}"
        )
    return done.stdout.strip()


def device_name(device: str) -> str:
    """The accelerator's name for a cuda device, else a plain description (imports torch)."""
    import platform

    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.get_device_name(torch.device("cuda" if device == "auto" else device))
    return f"cpu ({platform.processor() or platform.machine()})"


def run_and_record(out: Path, results: dict[str, Any], body: Callable[[], list[str]]) -> int:
    """Run a benchmark's body; its failures (or the error that ended it) go into ``out`` and on the console.

    Exit status: 0 when the body found no failure, 1 otherwise; an exception is re-raised after it is recorded.
    SIGTERM (a time limit, a lease's cleanup) ends the body through SystemExit, so its ``finally`` blocks stop the
    servers and stage processes it started instead of leaving them on their ports."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        failures = body()
    except (Exception, SystemExit) as exc:  # every error ends in the JSON too, naming what failed
        results["error"] = (
            f"interrupted (exit {exc.code})" if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
        )
        write_results(out, results)
        say(f"FAILED: {results['error']} (results: {out})")
        raise
    results["failures"] = failures
    write_results(out, results)
    for failure in failures:
        say(f"FAIL: {failure}")
    say(f"results: {out}")
    return 1 if failures else 0


def add_server_args(parser: argparse.ArgumentParser, python_default: str) -> None:
    """The flags every SGLang lab benchmark takes to start its server (module, interpreter, flags, version)."""
    from infra.sglang import LAUNCH_MODULE

    parser.add_argument("--module", default=LAUNCH_MODULE, help=f"server module (default {LAUNCH_MODULE})")
    parser.add_argument("--python", help=f"interpreter with sglang (default {python_default})")
    parser.add_argument("--server-args", default="", help='extra server flags, one string: --server-args="--a b"')


def new_flags(cfg: RunConfig, server_args: list[str]) -> list[str]:
    """``server_args`` minus flags (with their values) the run's server section already sets: the spec refuses
    repeats, and the lease passes the same flags to every lab script."""
    have = {a for a in cfg.server.extra_args if a.startswith("--")}
    if cfg.server.attention_backend:
        have.add("--attention-backend")
    out: list[str] = []
    skip = False
    for arg in server_args:
        if arg.startswith("--"):
            skip = arg in have
        if not skip:
            out.append(arg)
    return out


def bench_config(cfg: RunConfig, args: argparse.Namespace, backend: str) -> RunConfig:
    """cfg for one capture backend: final_hidden supervision; for sglang a managed capture_packed server."""
    sg = cfg.capture.sglang.model_copy(update={"server_mode": "capture_packed", "endpoints": [], "final_endpoints": []})
    server = cfg.server.model_copy(
        update={"python": args.python, "extra_args": [*cfg.server.extra_args, *new_flags(cfg, args.server_args)]}
    )
    capture = cfg.capture.model_copy(update={"backend": backend, "supervision": "final_hidden", "sglang": sg})
    return cfg.model_copy(update={"capture": capture, "server": server})
