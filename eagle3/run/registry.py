"""The stage registry: one entry per stage, from which everything that lists stages reads.

Each entry names the stage, the format version of its output (part of its key), the config section whose
fields its key hashes (operational fields left out, eagle3.config_base), how to compute its key, whether it
is complete, how to run it in this process, and its command line. The data-stage CLI
(``python -m eagle3.run.stages``), the ``eagle3`` console script (its ``stage``, ``export`` and ``eval``
commands and ``--until``), the Prefect tasks (cache keys, runs), the pipeline flow's ``until`` choices and
the run report all iterate over ``STAGES`` here; the run directory's folders are eagle3.run.layout's.

Nothing here imports a stage's module until that stage is asked for (the registry loads without torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eagle3.run.layout import FORMAT_VERSIONS

if TYPE_CHECKING:
    from eagle3.config import RunConfig
    from eagle3.run.stage import StageOutcome

ONLINE_SKIP = "skipped: train.features=online computes the target's states inside each training step (no feature disk)"
"""Why capture does not run for a run that trains online (the capture CLI, the pipeline flow and the run report)."""


def _lazy(ref: str, *bound: Any) -> Callable[..., Any]:
    """``module:function``, imported at the first call; ``bound`` is appended to the positional arguments."""
    module, _, name = ref.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, *bound, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"{ref} (imported when called)"
    return call


@dataclass(frozen=True)
class StageSpec:
    """One stage of the pipeline."""

    name: str
    description: str
    section: str | None
    """The RunConfig section whose fields the key hashes (None: the key reads other facts only)."""
    key_fn: Callable[[RunConfig], str]
    """The stage key (eagle3.run.stage); Prefect's cache key for the stage's task is built from it."""
    run_fn: Callable[..., StageOutcome | None] | None
    """``run(cfg, progress=None, force=False)`` in this process; None where the stage runs as its own process
    group (training: ``cli`` under torchrun)."""
    cli: str
    """``python -m <cli>`` runs the stage without Prefect."""
    data: bool = False
    """A data stage: run by ``python -m eagle3.run.stages <name>`` and the pipeline's data tasks."""
    command: str | None = None
    """The ``eagle3`` subcommand that forwards to ``cli`` (None: reached through ``eagle3 stage``, or none)."""
    complete_fn: Callable[[RunConfig], bool] | None = None
    """Completeness when it is more than the manifest matching the key (capture also checks its shards)."""

    @property
    def version(self) -> int:
        """Format version of the stage's output (eagle3.run.layout.FORMAT_VERSIONS)."""
        return FORMAT_VERSIONS[self.name]

    def key(self, cfg: RunConfig) -> str:
        """The stage key of ``cfg`` (raises MissingInputError while an input stage is incomplete)."""
        return self.key_fn(cfg)

    def run(self, cfg: RunConfig, **options: Any) -> StageOutcome | None:
        """Run the stage in this process (skipped when complete); ``options``: progress, force."""
        if self.run_fn is None:
            raise ValueError(f"stage {self.name} runs as its own process: python -m {self.cli}")
        return self.run_fn(cfg, **options)

    def is_complete(self, cfg: RunConfig) -> bool:
        """True when the stage's manifest matches its current inputs (a re-run would skip it)."""
        if self.complete_fn is not None:
            return self.complete_fn(cfg)
        from eagle3.run.layout import run_layout
        from eagle3.run.stage import manifest_matches

        path = run_layout(cfg).manifest(self.name)
        return path.is_file() and manifest_matches(path, self.key(cfg))


def _data_stage(name: str, description: str, section: str | None) -> StageSpec:
    return StageSpec(name, description, section, key_fn=_lazy("eagle3.run.stages:key_for", name),
                     run_fn=_lazy(f"eagle3.run.stages:run_{name}"), cli="eagle3.run.stages", data=True)


STAGES: tuple[StageSpec, ...] = (
    _data_stage("synthesize", "let the target write and answer the records of the synthetic sources", None),
    _data_stage("merge", "read, validate, dedupe, shuffle and split every source into data/merged.parquet", "data"),
    _data_stage("regenerate", "re-answer every user turn with the target", "regenerate"),
    _data_stage("tokenize", "render with the target's chat template and compute assistant loss masks", "tokenize"),
    _data_stage("vocab", "build the draft vocab map from the train split's assistant tokens", "vocab"),
    StageSpec("capture", "capture the target's hidden states of every tokenized sample, in shards", "capture",
              key_fn=_lazy("eagle3.features.capture:stage_key_of"), run_fn=_lazy("eagle3.features.capture:run_capture"),
              cli="eagle3.features.capture", complete_fn=_lazy("eagle3.features.capture:is_captured")),
    StageSpec("train", "train the drafter (torchrun; resumes from the latest checkpoint)", "train",
              key_fn=_lazy("eagle3.train.build:key_for"), run_fn=None, cli="eagle3.train"),
    StageSpec("export", "export the trained drafter (SGLang, speculators)", "export",
              key_fn=_lazy("eagle3.export.stage:key_for"), run_fn=_lazy("eagle3.export.stage:run_export"),
              cli="eagle3.export", command="export"),
    StageSpec("evaluate", "measure acceptance length by speculative decoding", "evaluate",
              key_fn=_lazy("eagle3.evaluate.stage:stage_key_of"), run_fn=_lazy("eagle3.evaluate.stage:run_evaluate"),
              cli="eagle3.evaluate.stage", command="eval"),
    # The SGLang deploy benchmark (baseline vs EAGLE-3 servers) writes no manifest yet: it is the last `until`
    # choice below. Its entry goes here once it is a core stage with a key; its folder is RunLayout.deploy.
)
BY_NAME: dict[str, StageSpec] = {s.name: s for s in STAGES}
DATA_STAGES: tuple[str, ...] = tuple(s.name for s in STAGES if s.data)

DEPLOY = "deploy"
UNTIL_CHOICES: tuple[str, ...] = (DATA_STAGES[-1], *(s.name for s in STAGES if not s.data), DEPLOY)
"""Where a pipeline run may stop: after the data stages (all or none), after any later stage, or after the
SGLang benchmark (the last)."""


def get_stage(name: str) -> StageSpec:
    """The registry entry of stage ``name`` (KeyError listing the stages)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown stage {name!r}; stages: {', '.join(BY_NAME)}") from None
