"""What two servers of a benchmark pair share: their argv without the speculative flags and the port."""

from __future__ import annotations

import argparse
from typing import Any

import pytest


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


SGLANG_SKIP_REASON = (
    "sglang 0.5.23 is not importable (pip install --no-deps sglang==0.5.23 and tests/sglang-parser-requirements.txt)"
)


def sglang_parser() -> tuple[Any, argparse.ArgumentParser]:
    """SGLang 0.5.23's ServerArgs class and its own launch_server parser (the test is skipped without SGLang)."""
    server_args = pytest.importorskip("sglang.srt.server_args", reason=SGLANG_SKIP_REASON)
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    server_args.ServerArgs.add_cli_args(parser)
    return server_args.ServerArgs, parser


SERVING = {
    "tp_size": 2,
    "dtype": "bfloat16",
    "mem_fraction_static": 0.8,
    "max_running_requests": 32,
    "cuda_graph_max_bs_decode": 32,
    "attention_backend": "triton",
    "extra_args": ("--context-length", "4096"),
}
"""The serving settings a pair's two servers share in the n-gram and DFlash pair tests (every one set, none default)."""
