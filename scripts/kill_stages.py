"""The pipeline's stages as scripts/kill_harness.py runs, inspects and resets them.

Which stages run (those of eagle3.run.registry this config does not skip) and their plain command lines, the
enlarged tiny preset the harness kills, what a killed stage had done when the kill landed (its resumable progress,
the trainer's logged step) and how a stage is reset so that its next run starts from nothing.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from kill_checks import stray_temps

from eagle3.data.regenerate import JOURNAL_NAME
from eagle3.data.stages import regenerate
from eagle3.evaluate import stage as evaluate
from eagle3.features import stage as capture
from eagle3.run.layout import DATA_DIR, RunLayout
from eagle3.run.registry import STAGES as REGISTRY
from eagle3.run.registry import get_stage
from eagle3.train import stage as train

TINY = "pkg://eagle3/assets/tiny_chats.jsonl"
SHAREGPT = "pkg://eagle3/assets/tiny_chats_sharegpt.json"
SOURCES = ", ".join(f"{{name: {n}, path: '{TINY}'}}" for n in "abcd") + f", {{name: sg, path: '{SHAREGPT}'}}"
OVERRIDES = [
    f"data.sources=[{SOURCES}]",  # 4 x 60 + 20 conversations, kept apart by their source prefix
    "data.dedupe=false",
    "data.max_chars=200",  # the longest conversations become rejects
    "regenerate.enabled=true",
    "regenerate.backend=hf",
    "regenerate.device=cpu",
    "regenerate.max_new_tokens=24",
    "capture.tokens_per_shard=1000",  # ~44 shards
    "train.num_epochs=6",
    "train.checkpoint_every_steps=10",
]  # ~400 steps
"""The tiny preset made big enough that a random kill lands mid-stage (about 2 minutes uninterrupted on 2 cores)."""
RESUMABLE = {s.name for s in REGISTRY if s.resumable}
"""Stages that keep finished work across a kill (journal, complete shards, checkpoints); a rerun has less to do."""
STEP_RE = re.compile(rb"\bstep (\d+)/(\d+)")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage as its plain command line."""

    name: str
    module: str
    by_preset: bool  # True: --preset/--set (writes config.json); False: --config <run>/config.json
    torchrun: bool = False  # training: killed by optimizer step, not by time

    def argv(self, preset: str, overrides: list[str], run_dir: Path) -> list[str]:
        """The command that runs (or resumes, or skips) this stage."""
        head = [sys.executable, "-m", self.module]
        if self.by_preset:
            return head + ["--preset", preset] + [a for o in overrides for a in ("--set", o)]
        return head + ["--config", str(run_dir / "config.json")]


def harness_stages(preset: str = "tiny", overrides: list[str] = OVERRIDES) -> list[Stage]:
    """The registry's stages that do something for this config, in order; those before training run by preset
    (they save config.json), the rest read <run>/config.json."""
    from eagle3.config import load_config

    cfg = load_config(preset, overrides)
    first_by_config = next(i for i, s in enumerate(REGISTRY) if s.torchrun)
    return [
        Stage(s.name, s.cli, i < first_by_config, s.torchrun)
        for i, s in enumerate(REGISTRY)
        if s.skip_reason(cfg) is None
    ]


STAGES = harness_stages()


def _lines(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.is_file() else 0


def snapshot(stage: str, run_dir: Path) -> dict[str, object]:
    """What the killed stage had done when the kill landed (its resumable progress) and the temp files it left."""
    progress: dict[str, object] = {}
    layout = RunLayout(run_dir)
    if stage == regenerate.STAGE.name:
        progress["journaled_conversations"] = _lines(layout.data / JOURNAL_NAME)
    elif stage == capture.STAGE.name:
        progress["complete_shards"] = len(list(layout.features.glob("shard-*.done.json")))
    elif stage == train.STAGE.name:
        steps = [int(p.name[5:]) for p in layout.checkpoints.glob("step-*")]
        progress["newest_checkpoint_step"] = max(steps, default=None)
    elif stage == evaluate.STAGE.name:
        progress["journaled_prompts"] = _lines(layout.eval / evaluate.JOURNAL_NAME)
    return {**progress, "temp_files_left": len(stray_temps(run_dir.parent))}


def logged_step(log: Path, offset: int = 0) -> int | None:
    """The last optimizer step the trainer logged ("step N/M") after byte ``offset`` of its log."""
    try:
        with open(log, "rb") as fh:
            fh.seek(offset)
            found = STEP_RE.findall(fh.read())
    except OSError:
        return None
    return int(found[-1][0]) if found else None


def reset_stage(stage: str, run_dir: Path) -> None:
    """Remove what makes a rerun of ``stage`` skip or resume: its manifest and, for a stage with a folder of its
    own, that whole folder (shards, checkpoints, journals); regeneration's journals in data/. Its next run starts
    from nothing, as in a fresh run (the later stages have not run yet)."""
    layout = RunLayout(run_dir)
    spec = get_stage(stage)
    if spec.folder != DATA_DIR:
        shutil.rmtree(layout.root / spec.folder, ignore_errors=True)
        return
    spec.manifest(layout.root).unlink(missing_ok=True)
    if stage == regenerate.STAGE.name:
        for journal in layout.data.glob(JOURNAL_NAME.replace(".jsonl", "*.jsonl")):
            journal.unlink()
