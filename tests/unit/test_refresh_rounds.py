"""Whole refreshes on the tiny target (CPU): a refresh on the target's own answers promotes; one on noisy data at a
learning rate far too high is kept, with the reason in its report; two refreshes started together give one winner;
a refresh SIGKILLed anywhere resumes its round and leaves the old or the new drafter current."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3.config import load_config
from eagle3.refresh.core import NO_NEW, run_refresh
from eagle3.refresh.line import Line

ROOT = Path(__file__).resolve().parents[2]
GATE = [
    "evaluate.num_prompts=4",
    "evaluate.max_new_tokens=24",
    "evaluate.datasets=[mtbench]",
    "regenerate.backend=hf",
    "regenerate.max_new_tokens=32",
    "refresh.max_steps=30",
    "refresh.lr=3e-3",
]
WEAK = ["train.max_steps=1", "train.eval_every_steps=0", "drafter.init_lm_head_from_target=false"]
"""A drafter trained one step from a random lm_head: a refresh on the target's own answers has room to help."""
GOOD = ["train.max_steps=2", "train.eval_every_steps=0"]
"""A drafter that already accepts most drafts on the tiny target's repetitive greedy text."""
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "music",
    "light",
    "table",
    "ocean",
    "window",
    "garden",
    "paper",
    "yellow",
    "quick",
    "slow",
    "happy",
]


def _overrides(workdir: Path, cache: Path, base: list[str], prompts: Path) -> list[str]:
    return [f"run.workdir={workdir}", f"target.cache_dir={cache}", *base, *GATE, f"refresh.prompts={prompts}"]


def _base_run(workdir: Path, cache: Path, base: list[str]) -> Path:
    """The pipeline up to export, in-process; the run directory."""
    from eagle3.export.stage import run_export
    from eagle3.features.capture import run_capture
    from eagle3.run.stages import run_all
    from eagle3.train.loop import train

    cfg = load_config("tiny", _overrides(workdir, cache, base, workdir / "unused"))
    run_all(cfg)
    run_capture(cfg)
    assert train(cfg).status == "done"
    run_export(cfg)
    return cfg.run_dir


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """{"weak" | "good": a finished tiny run directory}, built once; tests refresh copies of them."""
    root = tmp_path_factory.mktemp("refresh-bases")
    cache = root / "_targets"
    return {name: _base_run(root / name, cache, base) for name, base in (("weak", WEAK), ("good", GOOD))}, cache


def _copy(bases, name: str, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of base ``name`` under tmp_path (its workdir) and the shared target cache."""
    runs, cache = bases
    shutil.copytree(runs[name].parent, tmp_path / "w", symlinks=True)
    return tmp_path / "w", cache


def _prompts(path: Path, count: int) -> Path:
    """``count`` plain prompts, one JSON line each."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"prompt": f"Tell me about {WORDS[i % 15]} and {WORDS[(3 * i) % 15]}, item {i}."})
        for i in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _noise(path: Path, count: int) -> Path:
    """``count`` conversations of random characters, answers included."""
    import random

    rng = random.Random(2)
    chars = "abcdefghijklmnopqrstuvwxyz0123456789 .,;:!?"
    text = lambda n: "".join(rng.choice(chars) for _ in range(n))  # noqa: E731
    lines = [
        json.dumps({"messages": [{"role": "user", "content": text(40)}, {"role": "assistant", "content": text(200)}]})
        for _ in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _refresh_cmd(point: str, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tests.unit.refresh_kill",
        "refresh",
        point,
        "--",
        "--preset",
        "tiny",
        *(f"--set={o}" for o in overrides),
    ]


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_two_refreshes_started_together_give_one_winner_which_promotes_the_better_drafter(bases, tmp_path):
    """Of two refreshes started at once on one run, one takes the round and the other fails naming the lock's holder;
    the winner's candidate, trained on the target's answers from the weak drafter, passes the gate and is current;
    the next refresh finds nothing new."""
    workdir, cache = _copy(bases, "weak", tmp_path)
    overrides = _overrides(workdir, cache, WEAK, _prompts(tmp_path / "new" / "a.jsonl", 40))
    procs = [
        subprocess.Popen(
            _refresh_cmd("none", overrides),
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=1200), p.stdout.read(), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [r[2][-2000:] for r in results]
    loser = next(err for code, _, err in results if code == 2)
    assert "is locked by pid" in loser and "refresh" in loser
    cfg = load_config("tiny", overrides)
    line = Line(cfg.run_dir)
    assert line.current_id() == "round-0001"
    table = {r["group"]: r for r in line.promotion("round-0001").table}
    assert table["all"]["candidate"] >= table["all"]["current"] + cfg.refresh.gate.min_gain
    assert "## Promotion `round-0001`" in (line.root / "README.md").read_text()
    assert len((cfg.run_dir / "refresh" / "watermark.jsonl").read_text().splitlines()) == 1
    assert run_refresh(cfg).status == NO_NEW


def test_a_refresh_that_hurts_is_kept_and_says_why(bases, tmp_path):
    """Noisy new conversations kept as written, trained at a learning rate far too high, lower the acceptance: the
    promoted drafter stays current and the round's report gives the measured fall."""
    workdir, cache = _copy(bases, "good", tmp_path)
    noise = _noise(tmp_path / "noise.jsonl", 60)
    cfg = load_config("tiny", _overrides(workdir, cache, GOOD, noise) + ["refresh.regenerate=false", "refresh.lr=5e-2"])
    outcome = run_refresh(cfg)
    line = Line(cfg.run_dir)
    assert outcome.status == "kept" and line.current_id() == outcome.current and line.current_id().startswith("run-")
    overall = next(r for r in outcome.gate_table if r["group"] == "all")
    assert overall["candidate"] < overall["current"]
    report = Path(outcome.report or "").read_text()
    assert "**kept**" in report and "rises by less than refresh.gate.min_gain" in report
    decisions = (cfg.run_dir / "refresh" / "decisions.jsonl").read_text().splitlines()
    assert [json.loads(d)["status"] for d in decisions] == ["kept"]


@pytest.mark.slow
def test_a_refresh_killed_anywhere_resumes_its_round_and_never_serves_a_mix(bases, tmp_path):
    """SIGKILLed on entering each step of a round in turn (ingest, training, gate, pointer swap, events, report),
    the refresh leaves the initial or the promoted drafter current, whole; the next one resumes the same round
    (the watermark has one record), and at the end round 1 is decided once and promoted."""
    workdir, cache = _copy(bases, "weak", tmp_path)
    overrides = _overrides(workdir, cache, WEAK, _prompts(tmp_path / "new" / "a.jsonl", 40))
    cfg = load_config("tiny", overrides)
    from tests.unit.refresh_kill import POINTS

    for point in POINTS:
        proc = subprocess.run(
            _refresh_cmd(point, overrides), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1200
        )
        assert proc.returncode == -9, (point, proc.returncode, proc.stderr[-3000:])
        line = Line(cfg.run_dir)
        assert line.current_id() in {None, "round-0001"} or line.current_id().startswith("run-")
        if line.current_id() is not None:
            assert (line.pointer / "model.safetensors").is_file() and (line.pointer / "promotion.json").is_file()
        assert len((cfg.run_dir / "refresh" / "watermark.jsonl").read_text().splitlines()) == 1, point
    time.sleep(0.1)
    outcome = run_refresh(cfg)
    assert (outcome.round_id, outcome.status) == ("0001", "promoted")
    decisions = (cfg.run_dir / "refresh" / "decisions.jsonl").read_text().splitlines()
    assert [json.loads(d)["id"] for d in decisions] == ["0001"]
    assert Line(cfg.run_dir).current_id() == "round-0001"
    assert run_refresh(cfg).status == NO_NEW
