"""lab/eval_speed.py: the decode speed benchmark runs on CPU and times only lossless decodes."""

from __future__ import annotations

import runpy
from pathlib import Path

LAB = Path(__file__).resolve().parents[1]


def test_eval_speed_benchmark_tiny_run_is_lossless(capsys):
    """lab/eval_speed.py --tiny runs end to end on CPU and every decode it times equals the static and the
    eager greedy."""
    bench = runpy.run_path(str(LAB / "eval_speed.py"))
    bench["main"](["--tiny", "--new-tokens", "16", "--repeats", "1"])
    printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line)
    assert printed["lossless_identical"].startswith("5 of 5") and float(printed["greedy_static_tok_s"].split()[0]) > 0
    assert printed["eager_reference_identical"].startswith("7 of 7")
    assert float(printed["chain-3-oracle_round_ms"].split()[0]) > 0
