"""scripts/kill_harness.py's kill planning: every stage gets a landed kill at any kill count, on a machine faster
than the reference run (where timed kills miss)."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _harness():
    spec = importlib.util.spec_from_file_location("kill_harness", ROOT / "scripts" / "kill_harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kill_harness"] = module
    spec.loader.exec_module(module)
    return module


kh = _harness()
# The reference run's seconds (full, no-op) as on the 2-core machine; train by steps.
TIMINGS = {
    "merge": kh.Timing(6.0, 3.0),
    "regenerate": kh.Timing(40.0, 5.0),
    "tokenize": kh.Timing(5.0, 4.0),
    "vocab": kh.Timing(4.5, 4.0),
    "capture": kh.Timing(30.0, 6.0),
    "train": kh.Timing(60.0, 5.0, steps=400),
    "export": kh.Timing(7.0, 5.0),
    "evaluate": kh.Timing(20.0, 6.0),
}


class FakeMachine:
    """Runs stages ``speedup`` times faster than the reference: a stage's fresh run takes full_s / speedup, a
    resumable one's rerun only what a kill left; a reset makes the next run fresh again."""

    def __init__(self, speedup: float):
        self.speedup = speedup
        self.left: dict[str, float] = {}
        self.resets: list[str] = []

    def reset(self, stage: str, run_dir: Path) -> None:
        self.left.pop(stage, None)
        self.resets.append(stage)

    def runner(self, stage: str):
        timing = TIMINGS[stage]

        def run(argv, log, kill_after_s, kill_when):
            takes = self.left.get(stage, timing.full_s / self.speedup)
            if kill_when is not None:  # train: killed by step; the fake trainer lands it halfway through
                kill_after_s = 0.5 * takes
            if kill_after_s is None or kill_after_s >= takes:
                self.left[stage] = timing.noop_s / self.speedup  # done: a rerun is a no-op
                return "exited", takes
            resumed = kill_after_s if stage in kh.RESUMABLE else 0.0
            self.left[stage] = max(takes - resumed, timing.noop_s / self.speedup)
            return "killed", kill_after_s

        return run


def _trial(kills: int, seed: int, speedup: float) -> tuple[dict[str, int], FakeMachine]:
    """kill_harness.run_trial's loop over the stages with a fake machine (no processes)."""
    rng, machine = random.Random(seed), FakeMachine(speedup)
    quota, carry, landed = kh.plan_kills(rng, kills, TIMINGS), 0, {}
    for stage in kh.STAGES:
        want = quota[stage.name] + carry
        out = kh.kill_stage(
            rng,
            stage,
            want,
            TIMINGS[stage.name],
            [],
            Path("/nonexistent"),
            Path("/nonexistent"),
            last=stage is kh.STAGES[-1],
            run=machine.runner(stage.name),
            reset=machine.reset,
        )
        carry = want - out.kills
        landed[stage.name] = out.kills
    return landed, machine


@pytest.mark.parametrize("speedup", [1.0, 3.0, 10.0])
def test_every_stage_gets_a_landed_kill_at_any_kill_count(speedup, monkeypatch):
    """For 1..30 kills and several seeds, each of the 8 stages gets >= 1 landed kill and the trial lands every kill
    asked for (at least one per stage), even where the machine outruns the reference's timed kills."""
    monkeypatch.setattr(kh, "snapshot", lambda stage, run_dir: {})
    for kills in range(1, 31):
        for seed in range(3):
            landed, _ = _trial(kills, seed, speedup)
            assert min(landed.values()) >= 1, (kills, seed, landed)
            assert sum(landed.values()) >= max(kills, len(kh.STAGES)), (kills, seed, landed)


def test_misses_on_a_fast_machine_reset_the_stage_and_shrink_the_window(monkeypatch):
    """On a machine 10x faster than the reference, quick stages miss their first kill: each such stage is reset
    (and only stages whose kills all missed, or the last one); the retry window ends below the run that outran it."""
    monkeypatch.setattr(kh, "snapshot", lambda stage, run_dir: {})
    _, machine = _trial(10, 0, 10.0)
    assert machine.resets, "a 10x faster machine outran no timed kill: the test would not exercise the retry"
    low, high = kh.retry_window(TIMINGS["tokenize"], outran_s=0.5)
    assert high == pytest.approx(0.45) and 0.0 <= low <= high
    assert kh.retry_window(TIMINGS["tokenize"], outran_s=None)[1] == pytest.approx(0.9 * TIMINGS["tokenize"].full_s)


def test_reset_removes_what_makes_a_rerun_skip_or_resume(tmp_path):
    """reset_stage removes a data stage's manifest (and regeneration's journals) but no other stage's files, and a
    foldered stage's whole folder."""
    data, features = tmp_path / "data", tmp_path / "features"
    data.mkdir()
    features.mkdir()
    for name in (
        "merge.manifest.json",
        "merged.parquet",
        "regenerate.manifest.json",
        "regenerate.journal.jsonl",
        "regenerate.journal.slice-0.jsonl",
        "tokenize.manifest.json",
    ):
        (data / name).write_text("x")
    (features / "shard-00000.safetensors").write_text("x")
    kh.reset_stage("regenerate", tmp_path)
    assert sorted(p.name for p in data.iterdir()) == ["merge.manifest.json", "merged.parquet", "tokenize.manifest.json"]
    kh.reset_stage("tokenize", tmp_path)
    assert sorted(p.name for p in data.iterdir()) == ["merge.manifest.json", "merged.parquet"]
    kh.reset_stage("capture", tmp_path)
    assert not features.exists()
