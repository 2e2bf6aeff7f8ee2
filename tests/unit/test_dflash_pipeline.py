"""The whole pipeline with drafter.family=dflash on the tiny preset, run as a user runs it without Prefect: the
stage commands one after another (data, capture, train, export, evaluate), each a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

DFLASH_TINY = [
    "drafter.family=dflash",
    "drafter.dflash.block_size=4",
    "drafter.dflash.num_blocks=16",
    "train.max_steps=6",
    "train.eval_every_steps=3",
    "evaluate.num_prompts=2",
    "evaluate.max_new_tokens=16",
    "evaluate.device=cpu",
]
COMMANDS = [
    ("eagle3.run.stages", "all"),
    ("eagle3.features.capture",),
    ("eagle3.train",),
    ("eagle3.export",),
    ("eagle3.evaluate.stage",),
]


def _stage(command: tuple[str, ...], workdir) -> subprocess.CompletedProcess:
    sets = [a for o in (f"run.workdir={workdir}", *DFLASH_TINY) for a in ("--set", o)]
    return subprocess.run(
        [sys.executable, "-m", *command, "--preset", "tiny", *sets], capture_output=True, text=True, timeout=300
    )


@pytest.mark.timeout(900)
def test_tiny_dflash_pipeline_runs_stage_by_stage(tmp_path):
    """Every stage command exits 0; the train manifest names a best checkpoint, the export is SGLang's DFlash layout
    (checked), and the evaluation's DFlash block method and n-gram are token-identical to greedy on every prompt."""
    for command in COMMANDS:
        proc = _stage(command, tmp_path)
        assert proc.returncode == 0, f"{' '.join(command)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    run = tmp_path / "tiny"
    train = json.loads((run / "train" / "train.manifest.json").read_text())["stats"]
    assert train["step"] == 6 and train["best_checkpoint"] is not None
    export = json.loads((run / "export" / "sglang" / "config.json").read_text())
    assert export["architectures"] == ["DFlashDraftModel"] and export["dflash_config"]["block_size"] == 4
    assert export["dflash_config"]["target_layer_ids"] == [1, 3, 4]
    results = json.loads((run / "eval" / "results.json").read_text())["results"]
    assert {r["method"] for r in results} == {"dflash-3-1-4", "ngram"}
    for row in results:
        assert row["lossless"]["identical"] == row["num_prompts"] == 2 and row["accept_len"] >= 1.0, row
