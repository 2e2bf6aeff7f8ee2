"""The fuzz harness (lab/fuzz.py) on a small budget: no traceback, no miscount, nothing written outside."""

from __future__ import annotations

from lab.fuzz import fuzz


def test_small_fuzz_budget_finds_no_traceback_and_no_miscount(tmp_path):
    """40 mutated sources, presets and overrides (seed 0): only user errors, and every count adds up."""
    report = fuzz(40, seed=0, scratch=tmp_path)  # larger budgets: python -m lab.fuzz (docs/data.md)
    assert report.inputs == 40 and report.tracebacks == [] and report.miscounts == []
    # The budget really reaches every kind of input and both outcomes (kept rows and user errors).
    assert set(report.by_kind) == {"array", "lines", "parquet", "overrides", "preset"}
    assert {"SourceError", "MergeError", "ConfigError"} <= set(report.user_errors)
