"""What a finished training did, and the refresh's step budget as a share of the full run's (lab/refresh_goal.py).

A training's record comes from its train.manifest.json (steps) and train/metrics.jsonl (one record a step):
tokens = the last step's ``tokens_seen`` (real tokens, padding excluded); seconds = the sum of the steps' ``step_s``
(each from the step's start to its end: the first includes the compile; validation and checkpoints are outside
every step). Both are read the same way for every run, so shares compare like with like.

The budget (``--budget tokens``, the default): refresh.max_steps = floor(share x full tokens / full tokens per
step), the candidate's rows being packed as the full run's were (same tokens_per_row, same packing). With
``--budget time``, the most steps whose predicted seconds fit share x the full run's seconds. The prediction is a
model, not a measurement: online training runs the target on every row of its first epoch and reads the feature
cache after, so a candidate step costs what a full-run step cost in the same epoch (first step, the rest of epoch
one, later epochs), its epoch as long as the full run's (the same train.max_train_tokens over the same data).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.run.layout import RunLayout
from eagle3.run.registry import get_stage


@dataclass(frozen=True)
class Training:
    """A finished training, from its manifest and metrics."""

    steps: int
    tokens: int
    steps_s: float
    epoch_steps: list[int]
    """Optimizer steps per epoch, in order (the last may be cut by train.max_steps)."""
    first_step_s: float
    epoch_one_step_s: float
    """Mean seconds of the first epoch's steps after the first (online: the target runs on each row)."""
    later_step_s: float
    """Mean seconds of the later epochs' steps (online: the feature cache); the first epoch's when there are none."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict."""
        return asdict(self)


class TrainingMissing(FileNotFoundError):
    """A run without a finished training (no train manifest, or no step in its metrics)."""


def read_training(run_dir: Path) -> Training:
    """The training of ``run_dir`` (TrainingMissing when it has not finished)."""
    layout = RunLayout(run_dir)
    manifest = get_stage("train").manifest(run_dir)
    if not manifest.is_file() or not layout.metrics.is_file():
        raise TrainingMissing(f"{run_dir} has no finished training ({manifest}, {layout.metrics})")
    steps = json.loads(manifest.read_text())["stats"]["step"]
    records = [json.loads(line) for line in layout.metrics.read_text().splitlines() if line.strip()]
    train = sorted((r for r in records if r.get("type") == "train" and r["step"] <= steps), key=lambda r: r["step"])
    if not train:
        raise TrainingMissing(f"{layout.metrics} holds no train step")
    epochs = sorted({r["epoch"] for r in train})
    per_epoch = [[r["step_s"] for r in train if r["epoch"] == e] for e in epochs]
    rest = per_epoch[0][1:] or per_epoch[0]
    later = [s for times in per_epoch[1:] for s in times] or rest
    return Training(
        steps=steps,
        tokens=train[-1]["tokens_seen"],
        steps_s=sum(r["step_s"] for r in train),
        epoch_steps=[len(times) for times in per_epoch],
        first_step_s=per_epoch[0][0],
        epoch_one_step_s=sum(rest) / len(rest),
        later_step_s=sum(later) / len(later),
    )


def predicted_s(full: Training, steps: int) -> float:
    """Seconds a candidate of ``steps`` steps is predicted to train (the module docstring's model)."""
    epoch = full.epoch_steps[0]
    return (
        full.first_step_s
        + max(0, min(steps, epoch) - 1) * full.epoch_one_step_s
        + max(0, steps - epoch) * full.later_step_s
    )


@dataclass(frozen=True)
class StepBudget:
    """refresh.max_steps and how it was reached."""

    by: str
    share: float
    max_steps: int
    tokens_per_step: float
    full: Training

    @property
    def predicted_s(self) -> float:
        """The model's seconds for max_steps (an estimate)."""
        return predicted_s(self.full, self.max_steps)

    def lines(self) -> list[str]:
        """The arithmetic, printed and kept in refresh.json."""
        f = self.full
        lines = [
            f"full run: {f.steps:,} steps, {f.tokens:,} tokens -> {self.tokens_per_step:,.1f} tokens per step; "
            f"its steps took {f.steps_s:,.1f} s",
        ]
        if self.by == "tokens":
            budget = self.share * f.tokens
            lines.append(
                f"budget: {self.share:g} x {f.tokens:,} tokens = {budget:,.1f} tokens / {self.tokens_per_step:,.1f} "
                f"= {budget / self.tokens_per_step:,.2f} -> refresh.max_steps = {self.max_steps:,}"
            )
        else:
            lines.append(
                f"budget: {self.share:g} x {f.steps_s:,.1f} s = {self.share * f.steps_s:,.1f} s of steps -> "
                f"refresh.max_steps = {self.max_steps:,} (the most steps the model below fits in it)"
            )
        lines.append(
            f"predicted (a model of the full run's step times, not a measurement): first step {f.first_step_s:.1f} s "
            f"+ {f.epoch_one_step_s:.4f} s a step to step {f.epoch_steps[0]:,} + {f.later_step_s:.4f} s a step after "
            f"= {self.predicted_s:,.1f} s = {self.predicted_s / f.steps_s:.1%} of the full run's steps; "
            f"tokens {self.max_steps * self.tokens_per_step / f.tokens:.1%} of its tokens"
        )
        return lines

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict, the arithmetic included."""
        return {
            "by": self.by,
            "share": self.share,
            "max_steps": self.max_steps,
            "tokens_per_step": self.tokens_per_step,
            "predicted_s": self.predicted_s,
            "full": self.full.to_json(),
            "arithmetic": self.lines(),
        }


def step_budget(full: Training, share: float, by: str = "tokens") -> StepBudget:
    """refresh.max_steps for a candidate given ``share`` of the full run's tokens (by="tokens") or of its steps'
    seconds as predicted (by="time"); at least 1."""
    tokens_per_step = full.tokens / full.steps
    if by == "tokens":
        steps = math.floor(share * full.tokens / tokens_per_step + 1e-9)  # 1e-9: 0.3 x 10 steps is 3, not 2.99...
    else:
        limit, steps = share * full.steps_s, 0
        while steps < full.steps and predicted_s(full, steps + 1) <= limit:
            steps += 1
    return StepBudget(by, share, max(1, steps), tokens_per_step, full)
