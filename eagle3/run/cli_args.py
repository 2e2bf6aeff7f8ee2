"""Shared command-line handling for `python -m eagle3.<stage>` entry points and the `eagle3` CLI.

Every stage's ``main()`` is ``stage_main``: parse, build the config, hold the run lock, save config.json, run,
print the result (as JSON when it has ``to_json``); a user error (``is_user_error``) is one line on stderr and exit
status 2, any other exception keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eagle3.config import ConfigError, RunConfig, load_config, validate_config


def add_config_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--preset NAME | --config run/config.json, plus repeatable --set section.field=value."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--preset", default="tiny", help="preset name in configs/ or a YAML file (default: tiny)")
    group.add_argument("--config", type=Path, help="a resolved config.json (as written into a run directory)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, e.g. --set train.lr=1e-4 (repeatable)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Build the RunConfig the arguments describe (ConfigError on bad input)."""
    if getattr(args, "config", None):
        from eagle3.config import apply_overrides, read_config_file

        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        data = apply_overrides(read_config_file(path), list(args.overrides))
        return validate_config(data, str(path))
    return load_config(args.preset, list(args.overrides))


_OS_ERROR_HINTS = {
    errno.ENOSPC: "free space (or set run.workdir on a larger disk) and run the command again: finished work is kept "
    "and the interrupted output is redone",
    errno.EDQUOT: "raise the quota or free space, and run the command again: finished work is kept",
    errno.EROFS: "the run directory must be on a writable file system: remount it or set run.workdir",
    errno.EACCES: "the run directory must be writable by this user: fix its owner or permissions, or set run.workdir",
    errno.EPERM: "the run directory must be writable by this user: fix its owner or permissions, or set run.workdir",
    errno.ENAMETOOLONG: "a path component may be at most 255 bytes, and a non-ASCII character counts 2 to 4: "
    "choose a shorter name",
}
"""OS errors that are the user's to fix (full disk, read-only or foreign folder, too long a name): one line each."""


def _os_error_in(exc: BaseException | None) -> OSError | None:
    """The first OSError with a user-fixable errno in ``exc`` or its causes (a shard writer wraps its OSError)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _OS_ERROR_HINTS:
            return exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return None


def _owner_note(path: str) -> str:
    """', <path> is owned by uid N (name); this process runs as uid M' when the nearest existing folder is not ours."""
    probe = Path(path)
    for candidate in (probe, *probe.parents):
        try:
            st = candidate.stat()
        except OSError:
            continue
        if st.st_uid == os.geteuid():
            return ""
        try:
            import pwd

            name = f" ({pwd.getpwuid(st.st_uid).pw_name})"
        except (ImportError, KeyError):
            name = ""
        return f"; {candidate} is owned by uid {st.st_uid}{name}, this process runs as uid {os.geteuid()}"
    return ""


def os_error_message(exc: BaseException, run_dir: Path | None = None) -> str | None:
    """One line for a user-fixable OS error in ``exc`` (naming the path, else the run directory), else None."""
    err = _os_error_in(exc)
    if err is None:
        return None
    assert err.errno is not None  # (_os_error_in finds only errors whose errno has a hint)
    reason = err.strerror or os.strerror(err.errno)
    if err.filename:
        where = str(err.filename) + (f" -> {err.filename2}" if err.filename2 else "")
    else:  # a write through a descriptor names no file
        where = f"a file under {run_dir}" if run_dir is not None else "a file it was writing"
    context = f" ({exc})" if exc is not err else ""
    owner = _owner_note(str(err.filename)) if err.filename and err.errno in (errno.EACCES, errno.EPERM) else ""
    return f"{reason}: {where}{context}{owner}; {_OS_ERROR_HINTS[err.errno]}"


class RunDirError(RuntimeError):
    """A user-fixable OS error while a stage wrote its run directory (the message names the path)."""


PROJECT_PACKAGES = frozenset({"eagle3", "infra", "flows", "tasks", "deployments"})
"""The packages whose ValueError subclasses are user errors (is_user_error)."""

_MISSING_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError)


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's to fix, so that one line says it all (else it is a bug or an unexpected failure
    of a library, and its traceback is what a user must be able to report):

    * a ValueError subclass the project defines (ConfigError, SourceError, ExportError, MissingInputError, ...:
      bad input, each naming the record and the reason), or the project's RunDirError, DiskSpaceError and
      LockHeldError;
    * a missing or misplaced path the project reports itself (``raise FileNotFoundError("... run export first")``:
      no errno, which the OS always sets);
    * an OS error, here or among its causes, that a user fixes (full disk, read-only or foreign folder, too long a
      name: _OS_ERROR_HINTS).

    A plain ValueError, a KeyError or an OS error the OS raised for any other reason is none of these."""
    from infra.storage import DiskSpaceError, LockHeldError

    if isinstance(exc, (RunDirError, DiskSpaceError, LockHeldError)):
        return True
    if isinstance(exc, ValueError) and type(exc).__module__.split(".")[0] in PROJECT_PACKAGES:
        return True
    if isinstance(exc, _MISSING_PATH_ERRORS) and exc.errno is None:
        return True
    return _os_error_in(exc) is not None


def exit_on_user_error(fn):
    """Decorator for main(): a user error (is_user_error) prints one line, ``error: <message>``, and exits 2; a
    failed check of measured figures (MeasurementError: its message names each failed figure and why) prints that
    message and exits 1, as a result rather than a bug; any other exception propagates with its traceback (Python
    exits 1)."""
    from infra.sglang_bench_records import MeasurementError

    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except Exception as exc:
            if isinstance(exc, MeasurementError):
                print(f"error: {exc}", file=sys.stderr)
                raise SystemExit(1) from None
            if not is_user_error(exc):
                raise
            print(f"error: {os_error_message(exc) or exc}", file=sys.stderr)
            raise SystemExit(2) from None

    wrapper.__doc__, wrapper.__name__ = fn.__doc__, fn.__name__
    return wrapper


def print_json(result: Any) -> None:
    """Print each result (one, or a list; None is skipped) as indented JSON, through ``to_json`` when it has one."""
    for item in result if isinstance(result, list) else [result]:
        if item is not None:
            print(json.dumps(item.to_json() if hasattr(item, "to_json") else item, indent=2))


def stage_main(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    run: Callable[[RunConfig, argparse.Namespace], Any],
    *,
    lock_owner: str | Callable[[argparse.Namespace], str | None] | None = None,
    write_config: bool = False,
    show: Callable[[Any], None] = print_json,
    without_config: Callable[[argparse.Namespace], bool] | None = None,
) -> None:
    """The body of every ``python -m`` stage entry point.

    ``parser`` carries the config arguments (add_config_args) and the module's own; ``run(cfg, args)`` does the
    work and returns what ``show`` prints. ``lock_owner`` (or a function of the arguments giving it, None = no
    lock) names the holder of the run lock taken around ``run``; ``write_config`` saves <run>/config.json under
    it. ``without_config(args)`` handles the arguments that need no config (a check of a folder, say) and
    returns True when nothing is left to do."""

    @exit_on_user_error
    def main() -> None:
        from infra.storage import run_lock

        args = parser.parse_args(argv)
        if without_config is not None and without_config(args):
            return
        cfg = config_from_args(args)
        owner = lock_owner(args) if callable(lock_owner) else lock_owner
        try:
            with run_lock(cfg.run_dir, owner=owner) if owner else contextlib.nullcontext():
                if write_config:
                    from eagle3.run.layout import write_run_config

                    write_run_config(cfg)
                result = run(cfg, args)
        except Exception as exc:
            message = os_error_message(exc, cfg.run_dir)
            if message is None:
                raise
            raise RunDirError(message) from None
        show(result)

    main()
