"""A stand-in for eagle3.train under torchrun (a test double): prints step lines, can fail or hang.

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m tests.fakes.fake_trainer \
        --steps 3 --pid-dir DIR [--fail] [--hang] [--launcher-guard [--stop-delay-s S]]

--launcher-guard installs the real trainer's "stop when the launcher dies" request and a SIGTERM
handler that records rank<r>.stopped (where the real trainer would checkpoint) before exiting;
--stop-delay-s makes that handler take S seconds first, as the real trainer finishing a long step and
writing its checkpoint does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def emit(line: str) -> None:
    """One write per line: under PYTHONUNBUFFERED print() writes the text and its newline separately, and the
    two ranks' lines then interleave in the shared pipe. A pipe whose reader died (the supervisor SIGKILLed) is
    ignored, as the real trainer's logging handler does, so the rank lives on to get its SIGTERM."""
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except OSError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pid-dir", type=Path, required=True)
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--launcher-guard", action="store_true")
    parser.add_argument("--stop-delay-s", type=float, default=0.0)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    args.pid_dir.mkdir(parents=True, exist_ok=True)
    if args.launcher_guard:
        import signal

        from eagle3.train.__main__ import _stop_with_launcher

        def stopped(*_):
            time.sleep(args.stop_delay_s)
            (args.pid_dir / f"rank{rank}.stopped").write_text("SIGTERM\n")
            sys.exit(0)

        signal.signal(signal.SIGTERM, stopped)
        _stop_with_launcher()
    pid_file = args.pid_dir / f"rank{rank}.pid"  # written whole (tmp + rename): a reader never sees it empty
    pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
    os.replace(pid_file.with_suffix(".tmp"), pid_file)
    for step in range(args.steps):
        emit(f"rank {rank} step {step} loss {1.0 / (step + 1):.3f}")
        emit(f"rank {rank} chatter {step}")
    if args.fail and rank == 0:
        emit("rank 0 Traceback: simulated failure")
        sys.exit(3)
    while args.hang:
        time.sleep(0.5)


if __name__ == "__main__":
    main()
