"""Shared command-line handling for `python -m eagle3.<stage>` entry points and the `eagle3` CLI.

Every stage's ``main()`` is ``stage_main``: parse, build the config, hold the run lock, save config.json, run,
print the result (as JSON when it has ``to_json``); a user error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, e.g. --set train.lr=1e-4 (repeatable)")
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


def exit_on_user_error(fn):
    """Decorator for main(): user errors (bad config, bad input) print one clear message, no traceback."""
    from infra.storage import DiskSpaceError, LockHeldError

    user_errors = (ConfigError, FileNotFoundError, IsADirectoryError, DiskSpaceError, LockHeldError, ValueError)

    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except user_errors as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None

    wrapper.__doc__, wrapper.__name__ = fn.__doc__, fn.__name__
    return wrapper


def print_json(result: Any) -> None:
    """Print each result (one, or a list; None is skipped) as indented JSON, through ``to_json`` when it has one."""
    for item in result if isinstance(result, list) else [result]:
        if item is not None:
            print(json.dumps(item.to_json() if hasattr(item, "to_json") else item, indent=2))


def stage_main(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
               run: Callable[[RunConfig, argparse.Namespace], Any], *,
               lock_owner: str | Callable[[argparse.Namespace], str | None] | None = None,
               write_config: bool = False, show: Callable[[Any], None] = print_json,
               without_config: Callable[[argparse.Namespace], bool] | None = None) -> None:
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
        with run_lock(cfg.run_dir, owner=owner) if owner else contextlib.nullcontext():
            if write_config:
                from eagle3.run.layout import write_run_config

                write_run_config(cfg)
            result = run(cfg, args)
        show(result)

    main()
