"""Kill it many times, small version of scripts/kill_harness.py: 3 trials of SIGKILLs across every stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_three_trials_of_random_sigkills_lose_and_corrupt_nothing(tmp_path):
    """Every kill recovers, and each trial ends with the uninterrupted run's shards, data and drafter, bit for bit."""
    cmd = [
        sys.executable,
        "scripts/kill_harness.py",
        "--trials",
        "3",
        "--kills",
        "10",
        "--seed",
        "3",
        "--workdir",
        str(tmp_path),
        "--set",
        "train.num_epochs=3",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=2300, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "kill_summary.json").read_text())
    assert summary["trials_run"] == 3 and summary["all_passed"]
    assert summary["kills"] >= 30 and summary["recoveries"] == summary["kills"]
    assert all(n >= 1 for n in summary["kills_per_stage"].values()), summary["kills_per_stage"]
    names = {c["name"] for t in summary["trials"] for c in t["checks"] if c["passed"]}
    assert {
        "shards_complete_unique_uncorrupted",
        "drafter_equals_uninterrupted_run",
        "rejects_accounted_for",
        "manifests_match_outputs",
        "no_stray_temp_files",
        "run_lock_free",
    } <= names
    assert summary["checks_passed"] == summary["checks_total"]
