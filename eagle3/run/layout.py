"""The run directory's layout: every folder, manifest name and main output a run writes, named once.

    <workdir>/<run.name>/
        config.json                     the resolved config (written by every entry point that runs a stage)
        summary.json                    the latest pipeline run's stages: state and seconds (eagle3.run.summary)
        data/       merged.parquet, regenerated.parquet, tokenized.parquet, <stage>.manifest.json of
                    synthesize, merge, regenerate and tokenize
        vocab/      the draft vocab map, vocab.manifest.json
        features/   spec.json, plan.json, shard-NNNNN.{safetensors,done.json}, capture.manifest.json
        train/      checkpoints/, metrics.jsonl, progress.json, loss.png, acc.png, acceptance.png, torchrun logs,
                    train.manifest.json
        export/     sglang/, speculators/, export.manifest.json
        eval/       results.json, report.md, per_position.png, prompts.jsonl, partial/, evaluate.manifest.json
        deploy/     results.json, report.md, the SGLang server logs of the benchmark
        logs/       logs of managed servers and of failed flow runs
        history/    acceptance.jsonl: what each pipeline run that evaluated measured (eagle3.run.history)

Modules that write a file take its folder from here and keep naming the files only they read; a file that
another module reads (a manifest, the tokenized data, the feature spec) is named here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from eagle3.config import RunConfig

CONFIG_FILE = "config.json"
MANIFEST_SUFFIX = ".manifest.json"

DATA_DIR, VOCAB_DIR, FEATURES_DIR, TRAIN_DIR = "data", "vocab", "features", "train"
EXPORT_DIR, EVAL_DIR, DEPLOY_DIR, LOGS_DIR = "export", "eval", "deploy", "logs"
"""The run's folders. Which stage writes into which one is the stage's own fact (its StageId, eagle3.run.stage)."""

MERGED_FILE, REGENERATED_FILE, TOKENIZED_FILE = "merged.parquet", "regenerated.parquet", "tokenized.parquet"
SPEC_FILE, PLAN_FILE = "spec.json", "plan.json"
METRICS_FILE, PROGRESS_FILE, CHECKPOINTS_DIR = "metrics.jsonl", "progress.json", "checkpoints"
LOSS_PLOT, ACC_PLOT, ACCEPTANCE_PLOT = "loss.png", "acc.png", "acceptance.png"
TRAIN_PLOTS = (LOSS_PLOT, ACC_PLOT, ACCEPTANCE_PLOT)
"""train/'s plots (eagle3.train.plots): loss and accuracy per TTT step, and measured acceptance against tokens seen
(written only by a run with train.measured)."""
SGLANG_EXPORT_DIR = "sglang"
RESULTS_FILE, REPORT_FILE, EVAL_PLOT, PARTIAL_DIR = "results.json", "report.md", "per_position.png", "partial"
PROMPTS_FILE, REPLAYED_FILE = "prompts.jsonl", "replayed.json"  # eval/: per-prompt records; replays on greedy texts
MERGE_STATS_FILE = "stats.json"  # data/: what merge kept and rejected, per source
HISTORY_DIR, ACCEPTANCE_HISTORY = "history", "acceptance.jsonl"  # one line per pipeline run that evaluated
APPENDIX_DIR = "appendix"
"""Pages that tools outside the stages add to the run report: each <name>.md a section, <name>.png its plot."""


class StagePlace(Protocol):
    """What the layout needs of a stage (eagle3.run.stage.StageId): its name and the folder it writes into."""

    @property
    def name(self) -> str: ...

    @property
    def folder(self) -> str: ...


def manifest_name(stage: str) -> str:
    """'<stage>.manifest.json'."""
    return f"{stage}{MANIFEST_SUFFIX}"


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory (``root``); nothing is created by asking for a path."""

    root: Path

    def stage_dir(self, stage: StagePlace) -> Path:
        """The folder a stage writes into."""
        return self.root / stage.folder

    def manifest(self, stage: StagePlace) -> Path:
        """<folder of the stage>/<stage>.manifest.json: written last, it says the stage is complete."""
        return self.root / stage.folder / manifest_name(stage.name)

    @property
    def config(self) -> Path:
        """<run>/config.json."""
        return self.root / CONFIG_FILE

    @property
    def data(self) -> Path:
        """<run>/data."""
        return self.root / DATA_DIR

    @property
    def vocab(self) -> Path:
        """<run>/vocab."""
        return self.root / VOCAB_DIR

    @property
    def features(self) -> Path:
        """<run>/features."""
        return self.root / FEATURES_DIR

    @property
    def train(self) -> Path:
        """<run>/train."""
        return self.root / TRAIN_DIR

    @property
    def export(self) -> Path:
        """<run>/export."""
        return self.root / EXPORT_DIR

    @property
    def eval(self) -> Path:
        """<run>/eval."""
        return self.root / EVAL_DIR

    @property
    def deploy(self) -> Path:
        """<run>/deploy: the SGLang benchmark's results.json, report.md and server logs."""
        return self.root / DEPLOY_DIR

    @property
    def summary(self) -> Path:
        """summary.json: the latest pipeline run's StageRun rows, read back by the command that followed it."""
        return self.root / "summary.json"

    @property
    def logs(self) -> Path:
        """<run>/logs."""
        return self.root / LOGS_DIR

    @property
    def acceptance_history(self) -> Path:
        """history/acceptance.jsonl: the acceptance each pipeline run measured, for the trend across runs."""
        return self.root / HISTORY_DIR / ACCEPTANCE_HISTORY

    @property
    def merged(self) -> Path:
        """data/merged.parquet (the merge stage's conversations)."""
        return self.data / MERGED_FILE

    @property
    def regenerated(self) -> Path:
        """data/regenerated.parquet (the conversations re-answered by the target)."""
        return self.data / REGENERATED_FILE

    @property
    def tokenized(self) -> Path:
        """data/tokenized.parquet (input ids and loss masks)."""
        return self.data / TOKENIZED_FILE

    @property
    def spec(self) -> Path:
        """features/spec.json (what the features hold; written online too)."""
        return self.features / SPEC_FILE

    @property
    def plan(self) -> Path:
        """features/plan.json (the capture's shards)."""
        return self.features / PLAN_FILE

    @property
    def checkpoints(self) -> Path:
        """train/checkpoints."""
        return self.train / CHECKPOINTS_DIR

    @property
    def metrics(self) -> Path:
        """train/metrics.jsonl."""
        return self.train / METRICS_FILE

    @property
    def progress(self) -> Path:
        """train/progress.json."""
        return self.train / PROGRESS_FILE

    @property
    def train_plots(self) -> list[Path]:
        """train/loss.png, train/acc.png and train/acceptance.png (the last only where train.measured ran)."""
        return [self.train / name for name in TRAIN_PLOTS]

    @property
    def sglang_export(self) -> Path:
        """export/sglang: the SGLang drafter the evaluate and deploy stages load."""
        return self.export / SGLANG_EXPORT_DIR

    @property
    def eval_results(self) -> Path:
        """eval/results.json."""
        return self.eval / RESULTS_FILE

    @property
    def eval_plot(self) -> Path:
        """eval/per_position.png."""
        return self.eval / EVAL_PLOT

    @property
    def appendix(self) -> Path:
        """appendix/: pages the run report appends (flows/report.py), written by tools outside the stages."""
        return self.root / APPENDIX_DIR

    @property
    def deploy_report(self) -> Path:
        """deploy/report.md."""
        return self.deploy / REPORT_FILE


def run_relative(root: Path, path: Path | str) -> str:
    """How a file of the run records ``path``: relative to the run dir ``root`` when inside it (so the run stays
    valid when moved or copied elsewhere), else absolute as given. ``resolve_in_run`` reads it back."""
    path = Path(path)
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def resolve_in_run(root: Path, stored: str | Path) -> Path:
    """A path that a file of the run dir ``root`` records (``run_relative``) as a path now.

    Relative: under ``root``. Absolute: a run written before paths were stored relative records paths inside it
    as absolute ones of where it was; one that runs through a folder named as the run (``<old>/<name>/<rest>``)
    is ``root/<rest>``, the run's own file where it is now (the innermost such folder whose ``rest`` exists; else
    the path itself if it exists, else the innermost one). Other absolute paths are returned as they are."""
    path = Path(stored)
    if not path.is_absolute():
        return root / path
    parts = path.parts
    at = [i for i, part in enumerate(parts) if part == root.name and i + 1 < len(parts)]
    if not at or path.is_relative_to(root):
        return path
    rebased = [root.joinpath(*parts[i + 1 :]) for i in reversed(at)]
    return next((p for p in rebased if p.exists()), path if path.exists() else rebased[0])


def run_layout(cfg: RunConfig) -> RunLayout:
    """The layout of ``cfg``'s run directory."""
    return RunLayout(cfg.run_dir)


def write_run_config(cfg: RunConfig) -> Path:
    """Save the resolved config as <run>/config.json."""
    from eagle3.config import save_config

    return save_config(cfg, run_layout(cfg).config)
