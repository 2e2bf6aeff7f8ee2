"""Issue 42's goal on one GPU host: a drafter trained on half of a run's data, refreshed with the other half, against
the drafter the run trained on all of it.

    python3 lab/refresh_goal.py PHASE [--preset smollm2-quality] [--set k=v ...]
    PHASE: split | base | refresh [--share 0.3] [--budget tokens|time] | measure [--reuse-gate] | pack --out DIR

The full run (the preset's run with the overrides) must have been through its data stages, train and export; its
training and exported drafter may come from another host (lab/curve_carry.py, `lab/sglang_lease.sh results DIR`).
The --set overrides apply to every run here (e.g. the feature cache sized to the card). What the phases write goes
to the half run, runs/<name>-half, and its goal/ folder:

  split    the full run's training conversations halved by a hash of their id (lab/refresh_goal_split.py):
           goal/half-a.jsonl and goal/half-b.jsonl, counts in goal/split.json
  base     the half run: the preset with half A as its one source (keep_answers) and train.max_train_tokens halved,
           everything else equal, through data, capture, train and export (lab/quality_run.sh, each phase timed in
           goal/base.json); an export already there (carried in from an earlier host) skips train and export
  refresh  python -m eagle3.refresh on the half run with half B as refresh.prompts (refresh.regenerate=false),
           refresh.max_steps a share of the full run's training (lab/refresh_goal_budget.py, the arithmetic printed),
           the candidate's train.max_train_tokens the full run's, the gate at chain 3 on the frozen evaluation prompts;
           goal/refresh.json has the budget, the command and its seconds. Once a round is decided it does nothing.
  measure  the half, refreshed and full drafters on the gate's prompts (lab/refresh_goal_measure.py): goal/goal.json
           and goal/goal.md, the table with PASS/FAIL against the goal (>= 70% of the gap at <= 30% of the time)
  pack     what the phases wrote, the round's report, gate and data counts, and both trainings' metrics, as
           DIR/refresh-goal.tar.gz (names under runs/)

lab/sglang_lease.sh (LEASE_REFRESH_GOAL=1) runs split, base, refresh and measure on a GPU host; docs/refresh.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3.config import RunConfig, load_config  # noqa: E402
from eagle3.run.layout import CONFIG_FILE  # noqa: E402
from infra.storage import atomic_write_json, atomic_write_text  # noqa: E402
from lab.refresh_goal_budget import read_training, step_budget  # noqa: E402
from lab.refresh_goal_measure import SHARE_MAX, goal_doc, goal_markdown, group_rows, measure_drafters  # noqa: E402
from lab.refresh_goal_split import split_halves  # noqa: E402

HALF_A, HALF_B, GOAL_DIR = "half-a.jsonl", "half-b.jsonl", "goal"
SPLIT_FILE, BASE_FILE, REFRESH_FILE, GOAL_FILE, GOAL_REPORT = (
    "split.json",
    "base.json",
    "refresh.json",
    "goal.json",
    "goal.md",
)
BASE_PHASES = ("data", "capture", "train", "export")
GATE_SETS = ["refresh.gate.chain_steps=3"]
"""The gate's chain, set for the refresh and for measure alike (the same settings key: the same measurement)."""


@dataclass(frozen=True)
class Goal:
    """The runs and files of one measurement of the goal."""

    preset: str
    overrides: list[str] = field(default_factory=list)

    @cached_property
    def full(self) -> RunConfig:
        """The full run's config."""
        return load_config(self.preset, self.overrides)

    @cached_property
    def half_dir(self) -> Path:
        """runs/<full name>-half."""
        return load_config(self.preset, [*self.overrides, f"run.name={self.full.run.name}-half"]).run_dir

    @property
    def goal_dir(self) -> Path:
        """<half run>/goal: the halves and what each phase measured."""
        return self.half_dir / GOAL_DIR

    def base_overrides(self) -> list[str]:
        """The half run: half A as its one source, answers kept; half the full run's token budget (None: all of A)."""
        source = {"name": "half-a", "path": str((self.goal_dir / HALF_A).resolve()), "format": "openai"}
        tokens = self.full.train.max_train_tokens
        return [
            f"run.name={self.half_dir.name}",
            f"data.sources={json.dumps([source | {'keep_answers': True}])}",
            f"train.max_train_tokens={tokens // 2 if tokens else 'null'}",
        ]

    def half_config(self) -> RunConfig:
        """The half run's config as its stages saved it, with the gate's chain."""
        from eagle3.config import apply_overrides, read_config_file, validate_config

        path = self.half_dir / CONFIG_FILE
        if not path.is_file():
            raise SystemExit(f"error: {path} is missing: run `lab/refresh_goal.py base` first")
        return validate_config(apply_overrides(read_config_file(path), GATE_SETS), str(path))


def _sets(overrides: list[str]) -> list[str]:
    return [part for o in overrides for part in ("--set", o)]


def do_split(goal: Goal, args: argparse.Namespace) -> int:
    """goal/half-a.jsonl, goal/half-b.jsonl and goal/split.json from the full run's data."""
    from eagle3.refresh.candidate import answered_file
    from eagle3.run.layout import run_layout

    answered, tokenized = answered_file(goal.full), run_layout(goal.full).tokenized
    if not answered.is_file() or not tokenized.is_file():
        raise SystemExit(f"error: {answered} or {tokenized} is missing: run the full run's data stages first")
    summary = split_halves(answered, tokenized, {"a": goal.goal_dir / HALF_A, "b": goal.goal_dir / HALF_B})
    atomic_write_json(goal.goal_dir / SPLIT_FILE, summary.to_json())
    print(json.dumps(summary.to_json(), indent=2))
    return 0


def export_present(run_dir: Path) -> bool:
    """Whether the run has a complete SGLang export (its manifest and weights), as a refresh requires."""
    from eagle3.export import stage as export_stage
    from eagle3.export.checks import WEIGHTS_FILE
    from eagle3.run.layout import RunLayout

    layout = RunLayout(run_dir)
    return export_stage.STAGE.manifest(run_dir).is_file() and (layout.sglang_export / WEIGHTS_FILE).is_file()


def do_base(goal: Goal, args: argparse.Namespace) -> int:
    """The half run through lab/quality_run.sh, each phase timed into goal/base.json."""
    path = goal.goal_dir / BASE_FILE
    doc: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {"phases_s": {}}
    doc |= {"overrides": goal.base_overrides(), "skipped": []}
    env = {**os.environ, "PRESET": goal.preset, "PYTHON": sys.executable}
    for phase in BASE_PHASES:
        if phase in ("train", "export") and export_present(goal.half_dir):
            doc["skipped"].append(phase)  # trained already (here, or on an earlier host and its export carried in)
            continue
        print(f"== base {phase} ==", flush=True)
        t0 = time.monotonic()
        cmd = ["bash", str(REPO / "lab" / "quality_run.sh"), phase, *_sets([*goal.overrides, *goal.base_overrides()])]
        done = subprocess.run(cmd, env=env)
        if done.returncode:
            return done.returncode
        doc["phases_s"][phase] = round(time.monotonic() - t0, 1)
        atomic_write_json(path, doc)
    atomic_write_json(path, doc)
    print(json.dumps(doc, indent=2))
    return 0


def last_round(half: RunConfig) -> str | None:
    """The id of the half run's last decided refresh round, or None."""
    from eagle3.refresh.core import DECISIONS_FILE, refresh_dir
    from eagle3.run.journal import Journal

    decided = sorted(Journal(refresh_dir(half) / DECISIONS_FILE).load())
    return decided[-1] if decided else None


def do_refresh(goal: Goal, args: argparse.Namespace) -> int:
    """python -m eagle3.refresh on the half run, refresh.max_steps from the budget; goal/refresh.json."""
    budget = step_budget(read_training(goal.full.run_dir), args.share, args.budget)
    print("\n".join(budget.lines()), flush=True)
    half = goal.half_config()
    decided = last_round(half)
    if decided is not None:
        print(f"round {decided} of {half.run_dir} is decided already: nothing to do")
        return 0
    tokens = goal.full.train.max_train_tokens
    overrides = [
        *GATE_SETS,
        f"refresh.prompts={(goal.goal_dir / HALF_B).resolve()}",
        "refresh.regenerate=false",
        f"refresh.max_steps={budget.max_steps}",
        f"train.max_train_tokens={tokens or 'null'}",  # the candidate's pool is the full data: the full run's cap
    ]
    cmd = [sys.executable, "-m", "eagle3.refresh", "--config", str(half.run_dir / CONFIG_FILE), *_sets(overrides)]
    print("$", shlex.join(cmd), flush=True)
    t0 = time.monotonic()
    done = subprocess.run(cmd)
    doc = {
        "budget": budget.to_json(),
        "command": shlex.join(cmd),
        "wall_s": round(time.monotonic() - t0, 1),
        "returncode": done.returncode,
        "round": last_round(half),
    }
    atomic_write_json(goal.goal_dir / REFRESH_FILE, doc)
    return done.returncode


def drafter_runs(goal: Goal, half: RunConfig, round_id: str) -> dict[str, Path]:
    """The run directory of each drafter: the half run, the round's candidate, the full run."""
    from eagle3.refresh.candidate import CANDIDATE
    from eagle3.refresh.core import round_dir

    return {"half": half.run_dir, "refreshed": round_dir(half, round_id) / CANDIDATE, "full": goal.full.run_dir}


def do_measure(goal: Goal, args: argparse.Namespace) -> int:
    """The three drafters on the gate's prompts, the shares and the verdicts: goal/goal.json and goal/goal.md."""
    from eagle3.refresh.core import gate_prompts_path, round_dir
    from eagle3.refresh.gate import GATE_DIR, method_name, read_gate_prompts
    from eagle3.run.layout import RunLayout
    from infra.storage import sha256_file

    half = goal.half_config()
    round_id = last_round(half)
    if round_id is None:
        raise SystemExit(f"error: {half.run_dir} has no decided refresh round: run `lab/refresh_goal.py refresh` first")
    runs = drafter_runs(goal, half, round_id)
    exports = {role: RunLayout(run).sglang_export for role, run in runs.items()}
    prompts_path = gate_prompts_path(half)
    prompts = read_gate_prompts(prompts_path)
    gate_dir = round_dir(half, round_id) / GATE_DIR if args.reuse_gate else None
    records, here = measure_drafters(half, prompts, exports, goal.goal_dir / "measure", gate_dir)
    method = method_name(half.refresh.gate.chain_steps)
    mismatches = {
        role: sum(r.methods[method].lossless.kind == "mismatch" for r in recs) for role, recs in records.items()
    }
    doc = goal_doc(group_rows(prompts, records, method), {r: read_training(d) for r, d in runs.items()}, mismatches)
    doc |= {
        "method": method,
        "prompts": {"file": str(prompts_path), "sha256": sha256_file(prompts_path), "count": len(prompts)},
        "exports": {role: str(path) for role, path in exports.items()},
        "round": round_id,
        "measured_here": here,
        "budget": _read(goal.goal_dir / REFRESH_FILE).get("budget", {"by": "-", "share": args.share}),
        "walls": walls(goal),
    }
    atomic_write_json(goal.goal_dir / GOAL_FILE, doc)
    print(atomic_write_text(goal.goal_dir / GOAL_REPORT, goal_markdown(doc)).read_text())
    return 0


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def walls(goal: Goal) -> dict[str, float]:
    """Wall-clock seconds of the half run's training and of the whole refresh, where this host measured them."""
    found = {
        "base train s": _read(goal.goal_dir / BASE_FILE).get("phases_s", {}).get("train"),
        "refresh s": _read(goal.goal_dir / REFRESH_FILE).get("wall_s"),
    }
    return {k: v for k, v in found.items() if v is not None}


def packed_paths(goal: Goal) -> list[Path]:
    """What pack carries, under the half run: the goal files, the refresh's decisions and each round's report,
    gate result, data counts and candidate training, and the half run's training."""
    from eagle3.refresh.candidate import CANDIDATE, INGEST
    from eagle3.refresh.core import DECISIONS_FILE, REFRESH_DIR, REPORT_FILE, ROUNDS_DIR
    from eagle3.refresh.gate import GATE_DIR, GATE_FILE
    from eagle3.run.layout import MERGE_STATS_FILE, RunLayout
    from eagle3.run.registry import get_stage

    def training(prefix: Path) -> list[str]:
        layout = RunLayout(prefix)
        return [str(p) for p in (layout.data / MERGE_STATS_FILE, layout.metrics, get_stage("train").manifest(prefix))]

    rounds = Path(REFRESH_DIR) / ROUNDS_DIR / "*"
    patterns = [
        f"{GOAL_DIR}/*.json",
        f"{GOAL_DIR}/*.md",
        f"{REFRESH_DIR}/{DECISIONS_FILE}",
        str(rounds / REPORT_FILE),
        str(rounds / GATE_DIR / GATE_FILE),
        str(RunLayout(rounds / INGEST).data / MERGE_STATS_FILE),
        *training(rounds / CANDIDATE),
        *training(Path()),
    ]
    return sorted({p for pattern in patterns for p in goal.half_dir.glob(pattern) if p.is_file()})


def do_pack(goal: Goal, args: argparse.Namespace) -> int:
    """packed_paths as <out>/refresh-goal.tar.gz, names relative to runs/."""
    if args.out is None:
        raise SystemExit("error: pack needs --out DIR")
    files = packed_paths(goal)
    if not files:
        raise SystemExit(f"error: nothing to pack under {goal.half_dir}")
    args.out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(args.out / "refresh-goal.tar.gz", "w:gz") as tar:
        for path in files:
            tar.add(path, arcname=str(path.relative_to(goal.half_dir.parent)))
    print(f"{len(files)} files packed into {args.out / 'refresh-goal.tar.gz'}")
    return 0


PHASES = {"split": do_split, "base": do_base, "refresh": do_refresh, "measure": do_measure, "pack": do_pack}


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run one phase; its exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=list(PHASES))
    parser.add_argument("--preset", default="smollm2-quality", help="the full run's preset")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--share", type=float, default=SHARE_MAX, help="refresh: the budget's share of the full run")
    parser.add_argument("--budget", choices=("tokens", "time"), default="tokens", help="refresh: a share of what")
    parser.add_argument("--reuse-gate", action="store_true", help="measure: the gate's journals for half, refreshed")
    parser.add_argument("--out", type=Path, help="pack: the folder of refresh-goal.tar.gz")
    args = parser.parse_args(argv)
    return PHASES[args.phase](Goal(args.preset, args.overrides), args)


if __name__ == "__main__":
    sys.exit(main())
