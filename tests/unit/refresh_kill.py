"""Test helper: run a promotion or a refresh in this process and SIGKILL it at a chosen point.

python -m tests.unit.refresh_kill promote RUN_DIR EXPORT_DIR ID N
    promote EXPORT_DIR as drafter ID of RUN_DIR's line, SIGKILLed just before its N-th file-system step
    (a rename, replace, symlink, copy, mkdir or fsync); N = 0 runs to the end. Exit 0 when it finished.
python -m tests.unit.refresh_kill refresh POINT -- --preset tiny --set ...
    one refresh (python -m eagle3.refresh), SIGKILLed on entering POINT (a name of POINTS); "none" runs to the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

STEPS = ((os, "rename"), (os, "replace"), (os, "symlink"), (os, "mkdir"), (os, "fsync"), (shutil, "copy2"))
"""Every call by which a promotion changes the file system (or makes a change durable)."""


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at_step(n: int) -> None:
    """SIGKILL this process just before its n-th call of any of STEPS (n >= 1)."""
    count = [0]
    for module, name in STEPS:
        original = getattr(module, name)

        def step(*args, _original=original, **kwargs):
            count[0] += 1
            if count[0] == n:
                _die()
            return _original(*args, **kwargs)

        setattr(module, name, step)


def _points() -> dict[str, tuple[object, str]]:
    from eagle3.refresh import candidate, core, line

    return {
        "ingest": (candidate, "ingest"),
        "train": (candidate, "train_candidate"),
        "gate": (core, "judge"),
        "pointer": (line.Line, "_point"),
        "record": (line.Line, "record_current"),
        "close": (core, "close_round"),
    }


POINTS = ("ingest", "train", "gate", "pointer", "record", "close")
"""Where a refresh can be killed: on entering the round's ingest, its training, its gate, the pointer swap, the
events after it, the round's report and decision."""


def kill_on_entry(point: str) -> None:
    """SIGKILL this process when the refresh enters ``point``; at record, only on its call after a promotion."""
    owner, name = _points()[point]
    original = getattr(owner, name)
    calls = [0]

    def enter(*args, **kwargs):
        calls[0] += 1
        if point != "record" or calls[0] > 1:  # the first record_current is ensure_current's repair
            _die()
        return original(*args, **kwargs)

    setattr(owner, name, enter)


def main(argv: list[str]) -> None:
    if argv[0] == "promote":
        from eagle3.refresh.line import Line, utc_now
        from eagle3.refresh.records import Promotion

        run_dir, export, drafter, n = Path(argv[1]), Path(argv[2]), argv[3], int(argv[4])
        line = Line(run_dir)
        promotion = Promotion(drafter, "manual", line.current_id(), "test", utc_now(), str(export))
        if n:
            kill_at_step(n)
        line.promote(export, promotion)
        return
    point, rest = argv[1], argv[argv.index("--") + 1 :]
    if point != "none":
        kill_on_entry(point)
    from eagle3.refresh.__main__ import main as refresh_main

    refresh_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
