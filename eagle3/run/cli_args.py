"""Shared command-line handling for `python -m eagle3.<stage>` entry points and the `eagle3` CLI."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
