"""lab/refresh_goal.py: the halves, the step budget, the goal's arithmetic, and (slow) split -> base -> refresh ->
measure -> pack on the tiny target, CPU only (its figures mean nothing; the plumbing is what is checked)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3.data.sources import content_hash
from lab import refresh_goal
from lab.refresh_goal_budget import Training, predicted_s, step_budget
from lab.refresh_goal_measure import goal_doc
from lab.refresh_goal_split import half_of

REPO = Path(__file__).resolve().parents[2]
FULL_STEPS_S = [75.8] + [0.174] * 1222 + [0.0775] * 6115
QUALITY = Training(7338, 119_994_042, sum(FULL_STEPS_S), [1223] * 6, 75.8, 0.174, 0.0775)
"""smollm2-quality's training as its manifest and metrics give it (step times rounded)."""


def test_halves_are_stable_and_near_even():
    """A conversation's half depends on its id alone, and 10,000 ids split within 3% of even."""
    ids = [f"sharegpt:{i}" for i in range(10_000)]
    halves = [half_of(i) for i in ids]
    assert halves == [half_of(i) for i in ids] and set(halves) == {"a", "b"}
    assert abs(halves.count("a") - 5_000) < 300


def test_token_budget_is_the_share_of_the_full_runs_tokens():
    """30% of smollm2-quality's 119,994,042 tokens at its 16,352.4 tokens a step is 2,201 steps, printed as such."""
    budget = step_budget(QUALITY, 0.3)
    assert budget.max_steps == 2201 == math.floor(0.3 * QUALITY.tokens / (QUALITY.tokens / QUALITY.steps))
    assert "= 2,201.40 -> refresh.max_steps = 2,201" in budget.lines()[1]
    assert step_budget(Training(10, 1000, 1.0, [10], 0.1, 0.1, 0.1), 0.3).max_steps == 3  # not 2.999... -> 2


def test_time_budget_is_the_most_steps_the_model_fits():
    """By time, max_steps is predicted within the share of the full run's step seconds, and one more step is not."""
    budget = step_budget(QUALITY, 0.3, "time")
    limit = 0.3 * QUALITY.steps_s
    assert predicted_s(QUALITY, budget.max_steps) <= limit < predicted_s(QUALITY, budget.max_steps + 1)
    assert budget.max_steps < step_budget(QUALITY, 0.3).max_steps  # first-epoch steps run the target: dearer


def _training(steps: int, tokens: int, seconds: float) -> Training:
    return Training(steps, tokens, seconds, [steps], seconds / steps, seconds / steps, seconds / steps)


def test_goal_arithmetic_and_verdicts():
    """The recovered share is (refreshed - half) / (full - half); the time share the candidate's step seconds over
    the full run's; the goal passes only with both; a full drafter no better than the half one leaves it undefined."""
    rows = [{"group": "all", "prompts": 160, "half": 2.0, "refreshed": 2.3, "full": 2.4}]
    trainings = {"half": _training(10, 50, 5.0), "refreshed": _training(3, 30, 2.5), "full": _training(10, 100, 10.0)}
    doc = goal_doc(rows, trainings, {"half": 0, "refreshed": 0, "full": 0})
    assert doc["recovered_share"] == pytest.approx(0.75) and doc["time_share"] == pytest.approx(0.25)
    assert doc["tokens_share"] == pytest.approx(0.3)
    assert doc["verdict"] == {"recovered": "PASS", "time": "PASS", "goal": "PASS"}
    slow = goal_doc(rows, trainings | {"refreshed": _training(3, 30, 3.5)}, {})
    assert slow["verdict"] == {"recovered": "PASS", "time": "FAIL", "goal": "FAIL"}
    flat = goal_doc([rows[0] | {"full": 2.0}], trainings, {})
    assert flat["recovered_share"] is None and flat["verdict"]["goal"] == "FAIL"


TINY = [
    "train.features=online",  # as smollm2-quality: no capture
    "regenerate.enabled=true",  # the full run's answers are the target's; the half run keeps them (keep_answers)
    "regenerate.backend=hf",
    "regenerate.max_new_tokens=32",
    "train.max_train_tokens=6000",  # the half run gets 3000
    "train.num_epochs=2",
    "evaluate.datasets=[mtbench]",
    "evaluate.num_prompts=4",
    "evaluate.max_new_tokens=24",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PRESET": "tiny", "PYTHON": sys.executable}


def _rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _full_run(overrides: list[str]) -> None:
    """The tiny full run through data, capture, train and export (lab/quality_run.sh)."""
    for phase in ("data", "capture", "train", "export"):
        cmd = [str(REPO / "lab" / "quality_run.sh"), phase, *(p for o in overrides for p in ("--set", o))]
        done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _check_split(full: Path, goal: Path) -> tuple[list[dict], list[dict]]:
    """The halves partition the full run's train rows by half_of(id); its val rows are in neither."""
    rows = _rows(full / "data" / "regenerated.parquet")
    a, b = _lines(goal / "half-a.jsonl"), _lines(goal / "half-b.jsonl")
    assert {r["id"] for r in a} | {r["id"] for r in b} == {r["id"] for r in rows if r["split"] == "train"}
    assert {half_of(r["id"]) for r in a} == {"a"} and {half_of(r["id"]) for r in b} == {"b"}
    counts = json.loads((goal / "split.json").read_text())["halves"]
    assert (counts["a"]["rows"], counts["b"]["rows"]) == (len(a), len(b))
    return a, b


@pytest.mark.slow
def test_split_base_refresh_measure_on_the_tiny_target(tmp_path, capsys, monkeypatch):
    """The halves partition the full run's training rows; the half run trains on half A's answers as written at half
    the token budget; the refresh trains floor(0.3 x the full run's steps) steps on a pool holding every half-B
    conversation; measure's figures are the gate's for half and refreshed, its shares add up, and pack carries them."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two cores, shared: more threads only contend
    overrides = [f"run.workdir={tmp_path}", *TINY]
    _full_run(overrides)
    args = ["--preset", "tiny", *(p for o in overrides for p in ("--set", o))]
    full, half = tmp_path / "tiny", tmp_path / "tiny-half"
    goal = half / "goal"

    assert refresh_goal.main(["split", *args]) == 0
    a, b = _check_split(full, goal)

    assert refresh_goal.main(["base", *args]) == 0
    config = json.loads((half / "config.json").read_text())
    assert config["train"]["max_train_tokens"] == 3000 and config["data"]["sources"][0]["keep_answers"]
    regen = json.loads((half / "data" / "regenerate.manifest.json").read_text())["stats"]
    assert regen["skipped_source"] == len(a) and regen["success"] == 0  # nothing generated: A's answers kept
    assert {r["content_hash"] for r in _rows(half / "data" / "regenerated.parquet")} == {
        content_hash(r["messages"]) for r in a
    }

    assert refresh_goal.main(["refresh", *args]) == 0
    full_train = json.loads((full / "train" / "train.manifest.json").read_text())["stats"]
    budget = json.loads((goal / "refresh.json").read_text())["budget"]
    assert budget["max_steps"] == math.floor(0.3 * full_train["step"] + 1e-9)
    candidate = half / "refresh" / "rounds" / "0001" / "candidate"
    assert json.loads((candidate / "train" / "train.manifest.json").read_text())["stats"]["step"] == budget["max_steps"]
    pool = {r["content_hash"] for r in _rows(candidate / "data" / "merged.parquet")}
    assert {content_hash(r["messages"]) for r in b} <= pool  # every half-B conversation reached the candidate's data
    assert refresh_goal.main(["refresh", *args]) == 0  # a decided round: nothing runs again
    assert json.loads((goal / "refresh.json").read_text())["budget"] == budget

    assert refresh_goal.main(["measure", "--reuse-gate", *args]) == 0
    doc = json.loads((goal / "goal.json").read_text())
    assert doc["measured_here"] == {"half": 0, "refreshed": 0, "full": doc["prompts"]["count"]}
    gate = {r["group"]: r for r in json.loads((candidate.parent / "gate" / "gate.json").read_text())["rows"]}
    assert (doc["accept_len"]["half"], doc["accept_len"]["refreshed"]) == (
        gate["all"]["current"],
        gate["all"]["candidate"],
    )
    h, r, f = (doc["accept_len"][k] for k in ("half", "refreshed", "full"))
    assert doc["recovered_share"] == (pytest.approx((r - h) / (f - h)) if f > h else None)
    steps_s = {
        name: sum(x["step_s"] for x in _lines(run / "train" / "metrics.jsonl") if x["type"] == "train")
        for name, run in (("refreshed", candidate), ("full", full))
    }
    assert doc["time_share"] == pytest.approx(steps_s["refreshed"] / steps_s["full"])
    assert doc["tokens_share"] == pytest.approx(
        doc["training"]["refreshed"]["tokens"] / full_train["train"]["tokens_seen"]
    )
    assert doc["verdict"]["time"] == ("PASS" if doc["time_share"] <= 0.3 else "FAIL")
    assert "goal: " + doc["verdict"]["goal"] in capsys.readouterr().out

    assert refresh_goal.main(["pack", "--out", str(tmp_path / "out"), *args]) == 0
    with tarfile.open(tmp_path / "out" / "refresh-goal.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"tiny-half/goal/goal.json", "tiny-half/refresh/rounds/0001/gate/gate.json"} <= names
