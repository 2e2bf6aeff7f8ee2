"""The stage registry: the one list of stages, in pipeline order, built from the stage modules themselves.

Every stage is one module with the same names (``StageModule``): ``STAGE`` (its name, folder and output format
version: eagle3.run.stage.StageId), ``SECTION`` (the config section its key hashes), ``DESCRIPTION``,
``skip_reason(cfg)``, ``key(cfg)``, ``run(cfg, progress=None, force=False, known_key=None)`` and
``main(argv)`` (what ``python -m <module>`` runs). Everything that lists stages iterates ``STAGES``: the
``eagle3`` console script (``eagle3 stage NAME`` for every stage, ``--until``), the Prefect tasks and the pipeline
flow, the run report, the kill harness. Adding a stage is its module, one line below and its test.

The stage modules load without torch (their work imports it when it runs), so this registry does too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

from eagle3 import deploy
from eagle3.data.stages import merge, regenerate, synthesize, tokenize, vocab
from eagle3.evaluate import stage as evaluate
from eagle3.export import stage as export
from eagle3.features import stage as capture
from eagle3.train import stage as train

if TYPE_CHECKING:
    from eagle3.config import RunConfig
    from eagle3.run.progress import ProgressFn
    from eagle3.run.stage import StageId, StageOutcome

ONLINE_SKIP = capture.ONLINE_SKIP
"""Why capture does not run for a run that trains online (eagle3.features)."""


class StageModule(Protocol):
    """The names every stage module defines; a module may add ``COMMAND``, ``TORCHRUN``, ``up_to_date(cfg, key)``,
    ``output(layout)`` and ``headline(result)`` (StageSpec says what each means and what its absence does); the
    registry reads nothing else."""

    STAGE: StageId
    SECTION: str | None
    DESCRIPTION: str

    def skip_reason(self, cfg: RunConfig) -> str | None: ...
    def key(self, cfg: RunConfig) -> str: ...
    def run(
        self, cfg: RunConfig, progress: ProgressFn | None = None, force: bool = False, known_key: str | None = None
    ) -> StageOutcome | None: ...
    def main(self, argv: list[str] | None = None) -> Any: ...


@dataclass(frozen=True)
class StageSpec:
    """One stage of the pipeline: its module, and whether it is one of the data stages run as one block."""

    module: ModuleType
    data: bool = False
    """A data stage: the pipeline runs the data block first, and ``--until`` stops after all of it or none."""
    resumable: bool = False
    """The stage keeps finished work across a kill (journal, complete shards, checkpoints): a rerun has less to do."""
    reproducible: bool = False
    """Its outputs are byte for byte the same in every run of the same config on CPU (greedy, seeded): the kill
    harness compares them with an uninterrupted run's."""

    @property
    def stage(self) -> StageModule:
        """The module, typed by what every stage module defines."""
        return cast(StageModule, self.module)

    @property
    def name(self) -> str:
        """The stage's name (its manifest is <folder>/<name>.manifest.json)."""
        return self.stage.STAGE.name

    @property
    def description(self) -> str:
        """One line: what the stage does."""
        return self.stage.DESCRIPTION

    @property
    def section(self) -> str | None:
        """The RunConfig section whose fields the key hashes (None: the key reads other facts only)."""
        return self.stage.SECTION

    @property
    def version(self) -> int:
        """Format version of the stage's output (part of its key)."""
        return self.stage.STAGE.version

    @property
    def folder(self) -> str:
        """The run directory's folder the stage writes into."""
        return self.stage.STAGE.folder

    @property
    def cli(self) -> str:
        """``python -m <cli>`` runs the stage without Prefect."""
        return self.module.__name__

    @property
    def command(self) -> str | None:
        """A second ``eagle3`` subcommand for the stage (``eagle3 export``, ``eagle3 eval``), or None."""
        return getattr(self.module, "COMMAND", None)

    @property
    def torchrun(self) -> bool:
        """The pipeline runs the stage as its own process group (training), not in the flow's process."""
        return bool(getattr(self.module, "TORCHRUN", False))

    def output(self, run_dir: Path) -> Path:
        """Where the stage's outputs are: the file or folder its module's ``output(layout)`` names, else its folder."""
        from eagle3.run.layout import RunLayout

        layout = RunLayout(run_dir)
        named: Callable[[RunLayout], Path] | None = getattr(self.module, "output", None)
        return named(layout) if named is not None else layout.stage_dir(self.stage.STAGE)

    def manifest(self, run_dir: Path) -> Path:
        """<run_dir>/<folder>/<name>.manifest.json."""
        return self.stage.STAGE.manifest(run_dir)

    def skip_reason(self, cfg: RunConfig) -> str | None:
        """Why the stage does nothing for ``cfg`` (no synthetic source, regeneration off, ...), or None."""
        return self.stage.skip_reason(cfg)

    def key(self, cfg: RunConfig) -> str:
        """The stage key of ``cfg`` (raises MissingInputError while an input stage is incomplete)."""
        return self.stage.key(cfg)

    def run(self, cfg: RunConfig, **options: Any) -> StageOutcome | None:
        """Run the stage in this process (skipped when complete); ``options``: progress, force, known_key."""
        return self.stage.run(cfg, **options)

    def main(self, argv: list[str] | None = None) -> Any:
        """The stage's command line (``python -m <cli>``) with ``argv``."""
        return self.stage.main(argv)

    def headline(self, result: Mapping[str, Any]) -> str | None:
        """The main counts of the stage's result (its task's JSON) in a few words, as its module's
        ``headline(result)`` says them (the run summary's result cell); None: the module says nothing of this
        result (the summary lists its outputs)."""
        said: Callable[[Mapping[str, Any]], str | None] | None = getattr(self.module, "headline", None)
        return None if said is None else said(result)

    def is_complete(self, cfg: RunConfig, key: str | None = None) -> bool:
        """True when the stage's manifest matches its current inputs (a re-run would skip it); ``key``: the stage
        key when the caller has it. A stage that checks more than its manifest (capture: its shards) says so with
        ``up_to_date(cfg, key)``."""
        from eagle3.run.stage import manifest_matches

        key = key or self.key(cfg)
        check: Callable[[RunConfig, str], bool] | None = getattr(self.module, "up_to_date", None)
        if check is not None:
            return check(cfg, key)
        path = self.manifest(cfg.run_dir)
        return path.is_file() and manifest_matches(path, key)


STAGES: tuple[StageSpec, ...] = (
    StageSpec(synthesize, data=True),
    StageSpec(merge, data=True, reproducible=True),
    StageSpec(regenerate, data=True, resumable=True, reproducible=True),
    StageSpec(tokenize, data=True, reproducible=True),
    StageSpec(vocab, data=True, reproducible=True),
    StageSpec(capture, resumable=True, reproducible=True),
    StageSpec(train, resumable=True),
    StageSpec(export),
    StageSpec(evaluate, resumable=True),
    StageSpec(deploy),
)
BY_NAME: dict[str, StageSpec] = {s.name: s for s in STAGES}
DATA_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.data)

UNTIL_CHOICES: tuple[str, ...] = (DATA_STAGES[-1], *(s.name for s in STAGES if not s.data))
"""Where a pipeline run may stop: after the data stages (all or none), or after any later stage."""


def get_stage(name: str) -> StageSpec:
    """The registry entry of stage ``name`` (KeyError listing the stages)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown stage {name!r}; stages: {', '.join(BY_NAME)}") from None


def stages_until(until: str) -> tuple[StageSpec, ...]:
    """The stages a run up to ``until`` reaches, in order (every data stage first)."""
    last = [s.name for s in STAGES].index(until)
    return tuple(s for i, s in enumerate(STAGES) if i <= last or s.data)


def run_data_block(cfg: RunConfig, force: bool = False) -> list[StageOutcome]:
    """Every data stage in order in this process (what the pipeline's data block does, without Prefect); the
    outcomes of those that ran or were up to date (a stage with nothing to do returns none)."""
    outcomes = [s.run(cfg, force=force) for s in STAGES if s.data]
    return [o for o in outcomes if o is not None]


DATA_BLOCK = "all"
"""``eagle3 stage all``: every data stage in order."""


def data_block_main(argv: list[str] | None = None) -> None:
    """``eagle3 stage all --preset NAME [--set k=v ...] [--force]``: the data block under the run lock."""
    import argparse

    from eagle3.run.cli_args import add_config_args, stage_main

    parser = argparse.ArgumentParser(description="every data stage in order: " + ", ".join(DATA_STAGES))
    parser.add_argument("--force", action="store_true", help="recompute even if the manifests match")
    add_config_args(parser)
    stage_main(
        parser,
        argv,
        lambda cfg, args: run_data_block(cfg, args.force),
        write_config=True,
        lock_owner=f"eagle3 stage {DATA_BLOCK}",
    )
