"""Stress harness for infra.locks.run_lock: many processes race for a stale run lock, over many trials.

Each trial first leaves the lock file as a crashed writer would (a record of a dead pid, an empty file,
a partial record, or the lock of a holder that was SIGKILLed while holding it), then releases every
racer at once through a barrier. A racer that gets the lock holds it until every racer has tried, so
"exactly one holder" means exactly one racer got it and all the others were refused.

    python -m tests.unit.lock_race --trials 1000 --racers 4     # prints the figure for docs/operations.md

The unit test (tests/unit/test_storage_lock.py) runs a few dozen trials.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from infra.locks import LOCK_FILE, LOCK_HOLDER_ENV, LockHeldError, run_lock

STALE_KINDS = ("dead_pid_record", "empty_file", "partial_record", "killed_holder")
BARRIER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RaceResult:
    """Holders per trial (exactly 1 is the only good value) and the stale state each trial started from."""

    holders: list[int]
    kinds: list[str]

    @property
    def bad_trials(self) -> list[int]:
        return [i for i, n in enumerate(self.holders) if n != 1]


def _dead_pid() -> int:
    """The pid of a child that has exited and been reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def _killed_holder(run_dir: Path) -> None:
    """A process that takes the lock and is SIGKILLed while holding it."""
    pid = os.fork()
    if pid == 0:
        try:
            with run_lock(run_dir, owner="doomed"):
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)  # refused: the forked child must never return into the caller's code
    os.waitpid(pid, 0)


def make_stale(run_dir: Path, kind: str) -> None:
    """Leave ``<run_dir>/.lock`` as a crashed writer of the given kind would."""
    lock = run_dir / LOCK_FILE
    if kind == "killed_holder":
        _killed_holder(run_dir)
        return
    record = json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "owner": "crashed"})
    lock.write_text({"dead_pid_record": record, "empty_file": "", "partial_record": record[:9]}[kind])


def _racer(
    run_dir: str, trials: int, start: mp.Barrier, tried: mp.Barrier, released: mp.Barrier, wins: mp.Array
) -> None:
    os.environ.pop(LOCK_HOLDER_ENV, None)
    for trial in range(trials):
        start.wait()
        held = False
        try:
            with run_lock(run_dir, owner=f"racer {os.getpid()}"):
                held = True
                with wins.get_lock():
                    wins[trial] += 1
                tried.wait()  # hold until every racer has tried
        except LockHeldError:
            pass
        except Exception:  # noqa: BLE001 (any other failure to lock is a refusal here; the trial still counts)
            if held:
                raise
        if not held:
            tried.wait()
        released.wait()


def race(run_dir: Path, trials: int, racers: int = 4) -> RaceResult:
    """Run ``trials`` races of ``racers`` processes for a stale lock in ``run_dir``; returns holders per trial."""
    ctx = mp.get_context("fork")  # racers must start together; fork keeps each trial at a few milliseconds
    barriers = [ctx.Barrier(racers + 1, timeout=BARRIER_TIMEOUT_S) for _ in range(3)]
    wins = ctx.Array("i", trials)
    procs = [
        ctx.Process(target=_racer, args=(str(run_dir), trials, *barriers, wins), daemon=True) for _ in range(racers)
    ]
    for proc in procs:
        proc.start()
    kinds = []
    try:
        for trial in range(trials):
            kinds.append(STALE_KINDS[trial % len(STALE_KINDS)])
            make_stale(run_dir, kinds[-1])
            for barrier in barriers:
                barrier.wait()
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return RaceResult(list(wins[:]), kinds)


def main(argv: list[str] | None = None) -> None:
    """Print trials, racers, the distribution of holders per trial and the wall time."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--racers", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = race(Path(tmp), args.trials, args.racers)
        elapsed = time.perf_counter() - t0
    per_kind = Counter(k for k, n in zip(result.kinds, result.holders) if n != 1)
    print(
        json.dumps(
            {
                "trials": args.trials,
                "racers": args.racers,
                "holders_per_trial": dict(sorted(Counter(result.holders).items())),
                "trials_without_exactly_one_holder": len(result.bad_trials),
                "bad_by_stale_kind": per_kind,
                "elapsed_s": round(elapsed, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
