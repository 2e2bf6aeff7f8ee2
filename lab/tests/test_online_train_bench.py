"""lab/online_train.py on a CPU: every pass it offers runs and prints its figures (a smoke run; the figures
themselves are measured on a GPU, docs/train.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_online_train_benchmark_runs_every_pass_and_prints_positive_rates():
    """Offline, online (tokens from the host row and from the device), cached and the profiles all run; every
    summary rate is a positive number."""
    cmd = [
        sys.executable,
        "lab/online_train.py",
        "--device",
        "cpu",
        "--num-layers",
        "4",
        "--rows",
        "4",
        "--warmup",
        "1",
        "--seq-len",
        "1024",
        "--ttt-steps",
        "1",
        "--online-forward",
        "padded",
        "--device-tokens",
        "--feature-cache",
        "--profile",
        "1",
    ]
    out = subprocess.run(
        cmd,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    for what in ("online (padded target forward)", "cached"):
        assert f"profile of 1 {what} steps" in out
    rates = dict(re.findall(r"(\w+_tok_s|host_tokens_over_device_tokens|cached_over_online)=([\d,.]+)", out))
    assert {
        "online_tok_s",
        "offline_train_tok_s",
        "cached_tok_s",
        "host_tokens_over_device_tokens",
        "cached_over_online",
    } <= rates.keys(), out
    assert all(float(v.replace(",", "")) > 0 for v in rates.values()), rates
