"""Kill it many times: SIGKILL the pipeline's stages at random moments, recover each time, check nothing was lost.

    .venv/bin/python scripts/kill_harness.py                          # 1 trial, 21 kills, seed 0 (~8 min, 2 cores)
    .venv/bin/python scripts/kill_harness.py --trials 3 --kills 24 --seed 7 --workdir runs/kill

No Prefect: each stage of eagle3.run.registry that this config runs is its module's plain command
(scripts/kill_stages.py: ``python -m eagle3.data.stages.merge`` ...,
``python -m eagle3.features.capture``, ``python -m eagle3.train``, ``python -m eagle3.export``,
``python -m eagle3.evaluate.stage``), a child in its own process group. What it does:
1. an uninterrupted reference run of the tiny preset (enlarged: more conversations, regeneration on the
   in-process target, small capture shards, a few hundred training steps), timing each stage, then
   running each stage once more to time its no-op (start-up, manifest check, exit);
2. per trial, a fresh run in which every stage gets a random number of kills (at least one; the rest
   spread by stage duration): the stage starts, and at a random moment (uniform over its expected
   start-up plus remaining work) its whole process group gets SIGKILL; the recovery is running the same
   command again (which may be killed again), until it exits 0 by itself; then the next stage;
3. at the end of a trial, the checks of scripts/kill_checks.py: no lost, duplicated or corrupt shard;
   every manifest's outputs as recorded; every rejected record accounted for; data, shards, final
   drafter, exported weights and evaluation figures equal to the reference run's; no temp files; no
   stale lock.
A kill that finds the stage already exited counts as a miss (not a kill). Every stage gets at least one
landed kill at any ``--kills``: a stage whose kills all missed so far (or the last stage, whose quota has
nowhere to go) is reset (its manifest and resumable state removed, so its next run starts from nothing) and
run again, killed earlier than the run that outran the kill (``retry_window``); a missed kill of a stage that
already had one moves its quota on to the next stage. The JSON summary (``<workdir>/kill_summary.json``) has
kills, misses and resets per stage, recoveries, what each kill interrupted, the checks and wall times. Exit
code 0 when every check of every trial passed, every stage got a landed kill and at least ``--kills`` kills
landed in each trial.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from kill_checks import Check, all_checks  # noqa: E402
from kill_stages import OVERRIDES, RESUMABLE, STAGES, Stage, logged_step, reset_stage, snapshot  # noqa: E402

from infra.process import group_alive, popen_detached, tail  # noqa: E402

STAGE_TIMEOUT_S = 900.0
MAX_RESETS = 30
"""Resets of one stage after misses; each retry's window shrinks (retry_window), so this is never reached on a
working stage: reaching it means the stage keeps exiting at once."""


class StageFailed(RuntimeError):
    """A stage exited non-zero on its own (a recovery that does not recover)."""


def child_env() -> dict[str, str]:
    """The stages import this checkout first; one thread each, so CPU training is the same in every run."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_until(
    argv: list[str], log: Path, kill_after_s: float | None, kill_when: Callable[[int], bool] | None = None
) -> tuple[str, float]:
    """Run argv in its own process group; SIGKILL the group after ``kill_after_s``, or once ``kill_when(log offset
    at start)`` holds, if it still runs. Returns ("killed" | "exited", seconds); StageFailed on a non-zero exit."""
    t0 = time.monotonic()
    offset = log.stat().st_size if log.is_file() else 0
    proc = popen_detached(argv, log, env=child_env(), cwd=ROOT)
    try:
        if kill_when is None:
            proc.wait(timeout=kill_after_s if kill_after_s is not None else STAGE_TIMEOUT_S)
        else:
            while proc.poll() is None and not kill_when(offset):
                time.sleep(0.01)
            if proc.poll() is None:
                raise subprocess.TimeoutExpired(argv, 0)
            proc.wait()
    except subprocess.TimeoutExpired:
        if kill_after_s is None and kill_when is None:
            _kill_group(proc)
            raise StageFailed(f"{' '.join(argv[2:4])} ran past {STAGE_TIMEOUT_S:.0f} s") from None
        _kill_group(proc)
        return "killed", time.monotonic() - t0
    elapsed = time.monotonic() - t0
    _wait_group_gone(proc)
    if proc.returncode != 0:
        raise StageFailed(f"{' '.join(argv[2:4])} exited {proc.returncode}; log {log}:\n{tail(log, 30)}")
    return "exited", elapsed


def _kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group at once, as a lost machine would
    _wait_group_gone(proc)


def _wait_group_gone(proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while group_alive(proc.pid, reap=lambda _pid: proc.poll()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"process group {proc.pid} still alive 30 s after it should have ended")
        time.sleep(0.02)


@dataclass
class Timing:
    """An uninterrupted stage's wall time and its no-op rerun's (start-up + manifest check + exit)."""

    full_s: float
    noop_s: float
    steps: int | None = None  # training: the optimizer steps of the whole run


def reference_run(preset: str, overrides: list[str], workdir: Path, logs: Path) -> dict[str, Timing]:
    """The uninterrupted run every trial is compared with; times each stage and its no-op rerun."""
    shutil.rmtree(workdir, ignore_errors=True)
    run_dir = _run_dir(preset, overrides, workdir)
    over = overrides + [f"run.workdir={workdir}"]
    timings = {}
    for stage in STAGES:
        argv = stage.argv(preset, over, run_dir)
        _, full = run_until(argv, logs / f"ref-{stage.name}.log", None)
        _, noop = run_until(argv, logs / f"ref-{stage.name}-noop.log", None)
        steps = logged_step(logs / f"ref-{stage.name}.log") if stage.torchrun else None
        timings[stage.name] = Timing(round(full, 2), round(noop, 2), steps)
        print(f"reference {stage.name}: {full:.1f} s (no-op rerun {noop:.1f} s)", flush=True)
    return timings


def _run_dir(preset: str, overrides: list[str], workdir: Path) -> Path:
    from eagle3.config import load_config

    return load_config(preset, overrides + [f"run.workdir={workdir}"]).run_dir


def plan_kills(rng: random.Random, total: int, timings: dict[str, Timing]) -> dict[str, int]:
    """Kills per stage: one each, the rest drawn with weights = the stage's own work (full - no-op) + 1 s."""
    quota = {s.name: 1 for s in STAGES}
    names = [s.name for s in STAGES]
    weights = [max(timings[n].full_s - timings[n].noop_s, 0.0) + 1.0 for n in names]
    for name in rng.choices(names, weights=weights, k=max(total - len(names), 0)):
        quota[name] += 1
    return quota


@dataclass
class StageLog:
    """What happened to one stage in a trial."""

    kills: int = 0
    misses: int = 0
    resets: int = 0
    attempts: int = 0
    events: list[dict] = field(default_factory=list)


Runner = Callable[[list[str], Path, "float | None", "Callable[[int], bool] | None"], tuple[str, float]]
"""run_until's signature: (argv, log, kill_after_s, kill_when) -> ("killed" | "exited", seconds)."""


def retry_window(timing: Timing, outran_s: float | None) -> tuple[float, float]:
    """(low, high) seconds for the kill of a reset stage's rerun: below the wall time of the run that outran the
    last kill (``outran_s``: it finished before the kill, so the machine does the whole stage in about that time),
    or, for the first reset, below the reference run's. Each miss shrinks ``high`` to 0.9 of a run that was itself
    shorter than the last kill, so the window reaches the stage's own start-up after a few misses at most."""
    high = 0.9 * (timing.full_s if outran_s is None else outran_s)
    return min(0.8 * timing.noop_s, 0.5 * high), high


def kill_stage(
    rng: random.Random,
    stage: Stage,
    quota: int,
    timing: Timing,
    argv: list[str],
    run_dir: Path,
    logs: Path,
    last: bool = False,
    run: Runner = run_until,
    reset: Callable[[str, Path], None] = reset_stage,
) -> StageLog:
    """Start the stage, SIGKILL it at random moments up to ``quota`` times, then let it finish (the recovery).

    A kill that misses (the stage exited first) while the stage has no landed kill yet, or on the ``last``
    stage, resets the stage and runs it again with a kill inside ``retry_window``; any other miss returns
    early, and the caller moves the rest of the quota to the next stage."""
    out, done_s, log, last_step = StageLog(), 0.0, logs / f"{stage.name}.log", 0
    work = max(timing.full_s - timing.noop_s, 0.2)
    outran_s: float | None = None
    retrying = False
    while out.kills < quota:
        out.attempts += 1
        if stage.torchrun and timing.steps:  # by step, not time: the step rate follows the machine's load
            span = (timing.steps - last_step) / (quota - out.kills)
            target = min(last_step + max(1, round(rng.uniform(0.05, 1.0) * span)), timing.steps - 1)
            when, kill_when = f"step {target}", lambda offset, t=target: (logged_step(log, offset) or 0) >= t
            outcome, elapsed = run(argv, log, None, kill_when)
            last_step = max(last_step, logged_step(log) or 0)
        else:
            if retrying:
                low, high = retry_window(timing, outran_s)
                delay = rng.uniform(low, high)
                when = f"{delay:.2f} s of a reset stage (window {low:.2f}-{high:.2f} s)"
            else:
                remaining = max(work - done_s, 0.2) if stage.name in RESUMABLE else work
                # Half the kills anywhere in the stage's life (imports, target load included), half in its work.
                low = timing.noop_s * 0.8 if rng.random() < 0.5 else 0.0
                delay = rng.uniform(low, timing.noop_s + 0.9 * remaining)
                when = f"{delay:.2f} s of an expected {timing.noop_s + remaining:.1f} s"
            outcome, elapsed = run(argv, log, delay, None)
            done_s += max(delay - timing.noop_s, 0.0)
        if outcome == "exited":
            out.misses += 1
            out.events.append({"kill_at": when, "result": f"stage had already finished ({elapsed:.2f} s)"})
            if out.kills and not last:
                return out
            if out.resets >= MAX_RESETS:
                raise StageFailed(f"{stage.name}: {out.resets} resets, every kill missed (the stage exits at once)")
            reset(stage.name, run_dir)
            out.resets += 1
            outran_s = elapsed if retrying else None
            retrying, done_s, last_step = True, 0.0, 0
            out.events.append({"reset": "manifest and resumable state removed; the stage runs again from nothing"})
            continue
        out.kills += 1
        out.events.append({"kill_at": when, "after_s": round(elapsed, 2), **snapshot(stage.name, run_dir)})
    out.attempts += 1
    _, elapsed = run(argv, logs / f"{stage.name}.log", None, None)
    out.events.append({"recovered_in_s": round(elapsed, 2)})
    return out


def run_trial(
    index: int,
    seed: int,
    kills: int,
    preset: str,
    overrides: list[str],
    timings: dict[str, Timing],
    workdir: Path,
    ref_dir: Path,
) -> dict:
    """One fresh run killed ``kills`` times across all stages, then every check."""
    rng = random.Random(f"{seed}:{index}")
    trial_dir = workdir / f"trial-{index}"
    shutil.rmtree(trial_dir, ignore_errors=True)
    logs = trial_dir / "logs"
    run_dir = _run_dir(preset, overrides, trial_dir / "w")
    over = overrides + [f"run.workdir={trial_dir / 'w'}"]
    quota, carry, per_stage = plan_kills(rng, kills, timings), 0, {}
    t0 = time.monotonic()
    error = None
    try:
        for stage in STAGES:
            want = quota[stage.name] + carry
            log = kill_stage(
                rng,
                stage,
                want,
                timings[stage.name],
                stage.argv(preset, over, run_dir),
                run_dir,
                logs,
                last=stage is STAGES[-1],
            )
            carry = want - log.kills
            per_stage[stage.name] = log
            print(
                f"trial {index} {stage.name}: {log.kills} kills, {log.misses} misses, {log.resets} resets, recovered",
                flush=True,
            )
    except StageFailed as exc:
        error = str(exc)
        print(f"trial {index}: RECOVERY FAILED: {error}", flush=True)
    checks = all_checks(run_dir, ref_dir, trial_dir / "w") if error is None else []
    total = sum(s.kills for s in per_stage.values())
    checks.append(Check("enough_kills", total >= kills, f"{total} kills landed (asked for {kills})"))
    unkilled = [s.name for s in STAGES if s.name in per_stage and per_stage[s.name].kills == 0]
    checks.append(
        Check(
            "every_stage_killed",
            error is None and not unkilled,
            f"stages without a landed kill: {', '.join(unkilled)}"
            if unkilled
            else "every stage got at least one landed kill",
        )
    )
    return {
        "trial": index,
        "wall_s": round(time.monotonic() - t0, 1),
        "kills": total,
        "kills_per_stage": {n: s.kills for n, s in per_stage.items()},
        "misses": sum(s.misses for s in per_stage.values()),
        "resets_per_stage": {n: s.resets for n, s in per_stage.items()},
        "recoveries": total if error is None else None,
        "error": error,
        "checks": [c.to_json() for c in checks],
        "passed": error is None and all(c.passed for c in checks),
        "stages": {n: {"attempts": s.attempts, "events": s.events} for n, s in per_stage.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--kills", type=int, default=21, help="SIGKILLs per trial (at least one per stage)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="extra config overrides (after the harness's own)"
    )
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "kill")
    parser.add_argument(
        "--keep", action="store_true", help="keep each trial's run directory (default: removed once its checks passed)"
    )
    args = parser.parse_args(argv)
    workdir = args.workdir.resolve()
    overrides = OVERRIDES + args.overrides
    t0 = time.monotonic()
    timings = reference_run(args.preset, overrides, workdir / "reference", workdir / "logs")
    ref_dir = _run_dir(args.preset, overrides, workdir / "reference")
    trials = []
    for index in range(args.trials):
        trials.append(run_trial(index, args.seed, args.kills, args.preset, overrides, timings, workdir, ref_dir))
        if trials[-1]["passed"] and not args.keep:
            shutil.rmtree(workdir / f"trial-{index}" / "w", ignore_errors=True)
        print(
            json.dumps({k: trials[-1][k] for k in ("trial", "kills_per_stage", "misses", "passed", "wall_s")}),
            flush=True,
        )
    summary = _summary(args, overrides, timings, trials, time.monotonic() - t0)
    (workdir / "kill_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "trials"}, indent=2))
    return 0 if summary["all_passed"] else 1


def _summary(
    args: argparse.Namespace, overrides: list[str], timings: dict[str, Timing], trials: list[dict], wall_s: float
) -> dict:
    per_stage = {s.name: sum(t["kills_per_stage"].get(s.name, 0) for t in trials) for s in STAGES}
    return {
        "command": " ".join(sys.argv),
        "seed": args.seed,
        "preset": args.preset,
        "overrides": overrides,
        "cpus": os.cpu_count(),
        "reference_s": {n: vars(t) for n, t in timings.items()},
        "trials_run": len(trials),
        "kills": sum(t["kills"] for t in trials),
        "kills_per_stage": per_stage,
        "misses": sum(t["misses"] for t in trials),
        "recoveries": sum(t["recoveries"] or 0 for t in trials),
        "checks_passed": sum(c["passed"] for t in trials for c in t["checks"]),
        "checks_total": sum(len(t["checks"]) for t in trials),
        "all_passed": all(t["passed"] for t in trials),
        "wall_s": round(wall_s, 1),
        "trials": trials,
    }


if __name__ == "__main__":
    sys.exit(main())
