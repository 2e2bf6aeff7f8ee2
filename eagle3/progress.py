"""Progress reporting that the core can call without knowing who listens.

The CLI shows a tqdm bar; a Prefect task passes a callback that updates a progress artifact.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

ProgressFn = Callable[[int, int, dict[str, Any]], None]
"""Called as fn(done, total, info) with info holding rates and counters."""


class Progress:
    """Counts units of work and forwards them to an optional callback and a tqdm bar."""

    def __init__(self, total: int, desc: str, callback: ProgressFn | None = None,
                 bar: bool | None = None, min_interval_s: float = 1.0):
        self.total, self.desc, self.callback = total, desc, callback
        self.done = 0
        self.min_interval_s = min_interval_s
        self._last_emit = 0.0
        self._start = time.monotonic()
        self._bar = None
        if bar if bar is not None else sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="row", dynamic_ncols=True)

    def update(self, num: int = 1, **info: Any) -> None:
        """Advance by ``num`` units."""
        self.done += num
        if self._bar is not None:
            self._bar.update(num)
        now = time.monotonic()
        if self.callback and (now - self._last_emit >= self.min_interval_s or self.done >= self.total):
            self._last_emit = now
            elapsed = max(now - self._start, 1e-9)
            self.callback(self.done, self.total, {"desc": self.desc, "rate_per_s": self.done / elapsed, **info})

    def close(self) -> None:
        """Finish the bar (and emit a final callback)."""
        if self.callback:
            elapsed = max(time.monotonic() - self._start, 1e-9)
            self.callback(self.done, self.total, {"desc": self.desc, "rate_per_s": self.done / elapsed})
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
