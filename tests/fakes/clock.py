"""FakeClock: a TEST DOUBLE for a timing source, so tests check arithmetic on known timings, not this machine's
speed."""

from __future__ import annotations


class FakeClock:
    """Each reading is ``tick`` seconds after the previous one (the first reads ``tick``); ``calls`` counts them."""

    def __init__(self, tick: float):
        self.tick, self.calls = tick, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.calls * self.tick
