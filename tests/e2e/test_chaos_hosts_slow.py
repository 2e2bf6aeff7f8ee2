"""VM loss survived by another host, capture half of scripts/chaos_hosts.py: two gpu-pool "hosts", one SIGKILLed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_slice_of_a_lost_host_is_recaptured_on_the_other_host(tmp_path):
    """host-b's slice run is marked Crashed and submitted again, host-a captures what was left; no complete shard
    is captured again, and every shard's sha256 is its done file's with the plan's sample ids, each once."""
    cmd = [
        sys.executable,
        "scripts/chaos_hosts.py",
        "--workdir",
        str(tmp_path),
        "--port",
        "4392",
        "--hosts",
        "2",
        "--kill",
        "capture",
        "--set",
        "capture.tokens_per_shard=300",
    ]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1400)
    finally:
        subprocess.run(
            [sys.executable, "-m", "flows.cli", "server", "stop", "--workdir", str(tmp_path), "--port", "4392"],
            cwd=ROOT,
            capture_output=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "chaos_hosts.json").read_text())
    kill = report["capture_kill"]
    assert report["final_state"] == "Completed" and report["shard_check"]["passed"], report["shard_check"]
    assert kill["victim"] == "host-b" and kill["resubmitted_to_host"] == "host-a"
    assert kill["resubmitted_as"].endswith("-try2") and report["parent_run_count"] == 1
    assert 0 < kill["to_crashed_s"] <= 150 and kill["to_running_again_s"] >= kill["to_crashed_s"]
    assert kill["complete_shards_recaptured"] == 0
    assert kill["shards_captured_after_kill"] == kill["shards_total"] - kill["shards_done_at_kill"]
    assert all(name.endswith("-try1") for name in report["runs_per_host"]["host-b"])
    assert kill["resubmitted_as"] in report["runs_per_host"]["host-a"]
