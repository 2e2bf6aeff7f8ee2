"""lab/quality_run.sh end to end on the tiny preset (CPU): every phase runs, a repeat trains nothing, and
PACK_RESULTS_TO carries off what the run measured, its exported drafter included, byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lab import curve_carry

REPO = Path(__file__).resolve().parents[2]
PHASES = ("data", "capture", "train", "export", "eval")


def _quality_run(phase: str, workdir: Path, pack: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PRESET": "tiny", "PYTHON": sys.executable, "PACK_RESULTS_TO": str(pack)}
    done = subprocess.run(
        [str(REPO / "lab" / "quality_run.sh"), phase, "--set", f"run.workdir={workdir}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_the_script_runs_every_phase_skips_what_is_done_and_packs_the_measured_drafter(tmp_path):
    """`all` runs the five phases; `train` again trains nothing; the parts restore the drafter and its card byte for
    byte."""
    runs, pack, restored = tmp_path / "runs", tmp_path / "pack", tmp_path / "restored"
    first = _quality_run("all", runs, pack)
    assert [p for p in PHASES if f"== {p} took" in first.stdout] == list(PHASES), first.stdout[-3000:]

    again = _quality_run("train", runs, pack)
    assert "nothing to do" in again.stdout + again.stderr, again.stderr[-3000:]

    names = curve_carry.unpack_results(restored, pack)
    run = runs / "tiny"
    for rel in (
        "eval/results.json",
        "export/sglang/model.safetensors",
        "export/sglang/README.md",
        "train/train.manifest.json",
        "config.json",
    ):
        assert f"tiny/{rel}" in names
        assert (restored / "tiny" / rel).read_bytes() == (run / rel).read_bytes(), rel
    card = (restored / "tiny" / "export" / "sglang" / "README.md").read_text()
    # packed after the evaluation wrote its table
    assert "| chain-3-1-4 | 10 |" in card and "Not measured yet" not in card
