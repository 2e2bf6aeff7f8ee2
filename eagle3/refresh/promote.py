"""eagle3 promote: change which drafter of a run is current, by hand (eagle3.refresh.line).

    eagle3 promote --preset tiny               promote the run's own export/sglang (no gate; recorded as manual)
    eagle3 promote --preset tiny --rollback    point `current` back at the drafter the current one replaced
    eagle3 promote --preset tiny --status      print the current drafter and the events, change nothing

Each takes the run lock, so it never races a refresh of the same run.
"""

from __future__ import annotations

import argparse
from typing import Any


def line_status(line: Any) -> dict[str, Any]:
    """The current drafter, its folder and the events, oldest first."""
    events = sorted(line.events.load().values(), key=lambda e: e["at"])
    folder = line.current_dir()
    return {
        "current": line.current_id(),
        "path": str(folder.resolve()) if folder else None,
        "pointer": str(line.pointer),
        "events": events,
    }


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments; promote, roll back or show, then print the line's state as JSON."""
    from eagle3.refresh.core import promote_export
    from eagle3.refresh.line import Line
    from eagle3.run.cli_args import add_config_args, print_json, stage_main

    parser = add_config_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--rollback", action="store_true", help="return to the drafter the current one replaced")
    action.add_argument("--status", action="store_true", help="show the current drafter and the events only")

    def run(cfg, args: argparse.Namespace) -> dict[str, Any]:
        line = Line(cfg.run_dir)
        if args.rollback:
            line.rollback()
        elif not args.status:
            promote_export(cfg, line, "manual", "promoted by hand (eagle3 promote), without a gate")
        return line_status(line)

    stage_main(parser, argv, run, show=print_json, lock_owner=lambda args: None if args.status else "eagle3 promote")


if __name__ == "__main__":
    main()
