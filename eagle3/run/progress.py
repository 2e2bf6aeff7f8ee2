"""Progress reporting that the core can call without knowing who listens.

The CLI shows a tqdm bar; a Prefect task passes a callback that updates a progress artifact. With neither
(a CLI whose stderr is a log file), a plain line goes to stderr every ``LOG_EVERY_S`` seconds and at the end.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

LOG_EVERY_S = 30.0
"""How often a progress line is written when there is no bar and no callback."""

ProgressFn = Callable[[int, int, dict[str, Any]], None]
"""Called as fn(done, total, info) with info holding rates and counters."""

UNKNOWN = "\u2014"
"""What progress text shows for a value not known yet (an ETA before the first unit of work): an em dash, never
'nan'."""


def known(value: Any) -> bool:
    """True for a finite number (None, NaN, infinities, booleans and non-numbers are not known values)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fmt(value: Any, spec: str = "") -> str | None:
    """``value`` formatted with ``spec`` when it is a known number (see ``known``), else None (omit it)."""
    return format(value, spec) if known(value) else None


def eta_text(seconds: Any) -> str:
    """'ETA 42 s', or 'ETA \u2014' while the time left is unknown (no rate yet: None, NaN, infinite, negative)."""
    return f"ETA {seconds:,.0f} s" if known(seconds) and seconds >= 0 else f"ETA {UNKNOWN}"


def finite_or_none(value: Any) -> Any:
    """A non-finite float as None (JSON null: 'NaN' is not JSON and reads as 'nan' on a page), inside dicts and
    lists too; anything else as is."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


class Progress:
    """Counts units of work and forwards them to an optional callback and a tqdm bar."""

    def __init__(
        self,
        total: int,
        desc: str,
        callback: ProgressFn | None = None,
        bar: bool | None = None,
        min_interval_s: float = 1.0,
    ):
        self.total, self.desc, self.callback = total, desc, callback
        self.done = 0
        self.min_interval_s = min_interval_s
        self._last_emit = 0.0
        self._start = time.monotonic()
        self._bar = None
        self._info: dict[str, Any] = {}
        self._last_line = self._start
        show_bar = bar if bar is not None else sys.stderr.isatty()
        self._log_lines = not show_bar and bar is None and callback is None
        if show_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="row", dynamic_ncols=True)

    def update(self, num: int = 1, **info: Any) -> None:
        """Advance by ``num`` units."""
        self.done += num
        if self._bar is not None:
            self._bar.update(num)
        now = time.monotonic()
        self._info.update(info)
        if self._log_lines and now - self._last_line >= LOG_EVERY_S:
            self._write_line(now)
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
        if self._log_lines:
            self._write_line(time.monotonic())

    def _write_line(self, now: float) -> None:
        """'capture: 5/11 (45%) 120 s, 0.04/s, tokens_per_s=...' on stderr."""
        self._last_line = now
        elapsed = max(now - self._start, 1e-9)
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        extra = "".join(
            f", {k}={v}"
            for k, v in self._info.items()
            if v is not None and (known(v) or not isinstance(v, (int, float)))
        )  # unknown: omitted
        print(
            f"{self.desc}: {self.done}/{self.total}{pct} {elapsed:.0f} s, {self.done / elapsed:.3g}/s{extra}",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
