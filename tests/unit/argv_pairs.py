"""What two servers of a benchmark pair share: their argv without the speculative flags and the port."""

from __future__ import annotations


def without_speculative_flags(argv: list[str]) -> list[str]:
    """argv minus every --speculative-* flag and --port, each with its value (both flags always take one)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("--speculative-") or arg == "--port":
            skip = True
        else:
            out.append(arg)
    return out
