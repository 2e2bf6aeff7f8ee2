"""The real trainer (python -m eagle3.train) with every computation of the train key counted, for
tests/flows/test_stage_key_once.py to count what torchrun's ranks compute.

    EAGLE3_TRAIN_KEY_LOG=FILE python -m tests.fakes.counting_trainer <the arguments of python -m eagle3.train>

Writes ``start <pid>`` to FILE once the counter is in place, then ``key <pid>`` for each call of
eagle3.train.build.stage_key_for (the one function that computes the train key). The counter is installed before
eagle3.train.loop and eagle3.train.trainer are imported, so a module that imports the function by name gets it too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOG_ENV = "EAGLE3_TRAIN_KEY_LOG"


def note(path: Path, what: str) -> None:
    """Append ``<what> <pid>`` to ``path`` (each rank and the test's own process append to the same file)."""
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"{what} {os.getpid()}\n")


def counted(fn: Callable[..., Any], path: Path) -> Callable[..., Any]:
    """``fn`` that notes ``key`` in ``path`` on every call."""

    def stage_key_for(*args: Any, **kwargs: Any) -> Any:
        note(path, "key")
        return fn(*args, **kwargs)

    return stage_key_for


def main() -> None:
    from eagle3.train import build

    loaded = [m for m in ("eagle3.train.loop", "eagle3.train.trainer") if m in sys.modules]
    assert not loaded, f"{loaded} imported before the counter: their calls would not be counted"
    path = Path(os.environ[LOG_ENV])
    build.stage_key_for = counted(build.stage_key_for, path)
    note(path, "start")
    from eagle3.train.__main__ import main as train_main

    train_main()


if __name__ == "__main__":
    main()
