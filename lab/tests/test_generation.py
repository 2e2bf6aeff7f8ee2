"""lab/generation.py: the generation benchmark runs on CPU and its fast path gives plain generate's rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

LAB = Path(__file__).resolve().parents[1]


def test_generation_benchmark_runs_tiny_and_reports_identical_rows(capsys):
    """lab/generation.py --tiny (static path on CPU) prints its figures and all rows identical to plain."""
    path = LAB / "generation.py"
    spec = importlib.util.spec_from_file_location("generation_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--tiny", "--device", "cpu", "--backend", "static", "--new-tokens", "6"])
    out = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line)
    assert {"plain_tok_s", "fast_tok_s", "fast_over_plain"} <= set(out)
    assert out["identical_rows"].startswith("8/8") and out["check_identical"].startswith("8/8")
    assert out["fast_backend"].startswith("static")
