"""End to end on the real SmolLM2 target and real ShareGPT data (slow: minutes on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow


def test_demo_preset_turns_2000_sharegpt_conversations_into_data_outputs(tmp_path):
    """`eagle3 stage all --preset smollm2-demo` merges >= 2,000 conversations, tokenizes and builds the vocab."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3.run.stages",
            "all",
            "--preset",
            "smollm2-demo",
            "--set",
            f"run.workdir={tmp_path}",
            "--set",
            "data.sources.0.max_records=2000",
            "--set",
            "tokenize.max_len=2048",
            "--set",
            "vocab.draft_vocab_size=8192",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "smollm2-demo"
    stats = json.loads((run_dir / "data" / "stats.json").read_text())
    assert stats["total"]["kept"] == 2000
    assert stats["total"]["kept"] + stats["total"]["rejected"] == stats["total"]["read"]
    tokenized = pq.read_table(run_dir / "data" / "tokenized.parquet")
    with open(run_dir / "data" / "tokenize_rejects.jsonl") as fh:
        rejected = sum(1 for _ in fh)
    assert tokenized.num_rows + rejected == 2000
    assert max(tokenized.column("num_tokens").to_pylist()) <= 2048
    vocab = json.loads((run_dir / "vocab" / "vocab_map.json").read_text())
    assert vocab["draft_vocab_size"] == 8192 and vocab["coverage"] > 0.85
