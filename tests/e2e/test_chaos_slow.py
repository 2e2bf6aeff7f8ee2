"""VM loss, small version of scripts/chaos.py: SIGKILL worker + flow mid-capture, recovery by the automations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_run_recovers_after_a_vm_loss_mid_capture_reusing_complete_shards(tmp_path):
    """The killed run is marked Crashed, retried on a new worker and completes; no complete shard is redone."""
    cmd = [
        sys.executable,
        "scripts/chaos.py",
        "--workdir",
        str(tmp_path),
        "--port",
        "4391",
        "--kill",
        "capture",
        "--set",
        "capture.tokens_per_shard=300",
        "--set",
        "train.max_steps=3",
        "--set",
        "evaluate.num_prompts=1",
        "--set",
        "evaluate.max_new_tokens=8",
    ]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1400)
    finally:
        subprocess.run(
            [sys.executable, "-m", "flows.cli", "server", "stop", "--workdir", str(tmp_path), "--port", "4391"],
            cwd=ROOT,
            capture_output=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "chaos.json").read_text())
    kill = report["capture_kill"]
    assert report["final_state"] == "Completed" and report["run_count"] >= 2
    assert 0 < kill["to_crashed_s"] <= 150 and kill["to_running_again_s"] >= kill["to_crashed_s"]
    assert kill["complete_shards_recaptured"] == 0
    assert kill["shards_captured_after_kill"] == kill["shards_total"] - kill["shards_done_at_kill"]
