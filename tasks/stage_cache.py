"""One way for every stage task to show that its stage was up to date: Prefect's ``Cached`` state.

Every stage task (synthesize, merge, regenerate, tokenize, vocab, capture-finalize, train, export, evaluate)
takes its cache key from ``stage_cache_key``: the stage key (eagle3.run.stage) and the run directory when the
stage's manifest matches it on disk, else no key at all (the task runs; nothing stale can come from Prefect's
cache, whoever calls the task, and ``force=True`` does the same). When the stage is up to date and Prefect holds no
record under the key yet (a stage completed by the command line, or a record written elsewhere), the key function
writes one, the stage's own outcome marked not computed, so Prefect answers ``Cached`` and never runs the task's
body: an up-to-date train starts no torchrun and publishes no progress. The capture subflow ends in a state of the
same name (``UP_TO_DATE``) when it finds its stage complete.

The key is computed once per run of a task: the key function keeps what it computed under the task run's id and the
task's body takes it with ``computed_key()`` and passes it to the stage as ``known_key`` (Prefect calls the key
function in the task run's own thread, right before the body, on every attempt). A flow that computed the key
before calling the task (capture: to skip its shard tasks) passes it as the task's ``known_key`` parameter, and the
key function takes it from there.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any, TypedDict
from uuid import UUID

from prefect.context import TaskRunContext

from eagle3.config import RunConfig
from eagle3.run.registry import get_stage

log = logging.getLogger(__name__)


class CacheOptions(TypedDict):
    """The @task keywords of STAGE_CACHE (typed, so that ``@task(**STAGE_CACHE)`` type-checks)."""

    persist_result: bool
    cache_result_in_memory: bool


STAGE_CACHE: CacheOptions = {"persist_result": True, "cache_result_in_memory": False}
RESULT_VERSION = 2
"""Part of the stage tasks' cache keys: bumped when what they return changes type (2: StageOutcome, not a dict),
so a result cached by an older version is not handed to code that expects the new type."""
UP_TO_DATE = "Cached"
"""The state name of a stage task (or the capture subflow) whose stage was up to date: Prefect's own name for a
task answered from its cache, so every skipped stage reads the same in the UI."""

SkippedFn = Callable[[RunConfig, str], Any]
"""What a skipped stage's task returns, built from the run's config and the stage key."""


def stage_outcome(stage: str) -> SkippedFn:
    """The outcome an up-to-date stage's run would return: its manifest's, marked not computed."""

    def skipped(cfg: RunConfig, key: str) -> Any:
        from eagle3.run.stage import StageOutcome, read_manifest

        manifest = get_stage(stage).manifest(cfg.run_dir)
        doc = read_manifest(manifest)
        assert doc is not None  # (called for a stage whose manifest matches its key)
        return StageOutcome.from_manifest(stage, key, manifest, doc, computed=False)

    return skipped


_COMPUTED: dict[UUID, str] = {}
"""The stage key each task run's key function computed, by task run id, until the run's body takes it (a run
answered ``Cached`` never runs its body: its key is not kept)."""


def key_and_state(stage: str, cfg: RunConfig, known_key: str | None = None) -> tuple[str | None, bool]:
    """(the stage key of ``cfg``, whether the stage is complete on disk with it); (None, False) when the key cannot
    be computed (the task then runs and says why). ``known_key``: the key when the caller computed it already (a
    flow that checked the stage before calling its task), so it is not computed again."""
    spec = get_stage(stage)
    try:
        key = known_key or spec.key(cfg)
        return key, spec.is_complete(cfg, key)
    except Exception as exc:  # an input stage missing or corrupt, a target not prepared: the task reports it
        log.info("%s: not checked for being up to date (%s: %s); the task runs", stage, type(exc).__name__, exc)
        return None, False


def up_to_date_key(stage: str, cfg: RunConfig) -> str | None:
    """The stage key of ``cfg`` when the stage is complete on disk (its manifest matches, and whatever else the
    stage checks), else None; None too when the key cannot be computed (the task then runs and says why)."""
    key, complete = key_and_state(stage, cfg)
    return key if complete else None


def computed_key() -> str | None:
    """The stage key this task run's key function computed (None outside a task run, or when it computed none: the
    stage computes it); for the task's body to pass to the stage as ``known_key``."""
    ctx = TaskRunContext.get()
    return None if ctx is None else _COMPUTED.pop(ctx.task_run.id, None)


def run_tag(cfg: RunConfig) -> str:
    """12 hex digits naming the run directory in a cache key: two runs whose stage has the same key (same inputs,
    other names) keep records of their own, each pointing at its own manifest."""
    return hashlib.sha256(str(cfg.run_dir.resolve()).encode()).hexdigest()[:12]


def stage_cache_key(
    stage: str, skipped: SkippedFn | None = None
) -> Callable[[TaskRunContext, dict[str, Any]], str | None]:
    """A ``cache_key_fn`` for the task of ``stage`` (see module doc); ``skipped(cfg, key)`` is the value a skipped
    run returns (default: the stage's outcome from its manifest). A task with a ``known_key`` parameter gets the key
    its caller computed and passes it on (the capture flow's finalize task)."""
    skipped = skipped or stage_outcome(stage)

    def key_fn(ctx: TaskRunContext, params: dict[str, Any]) -> str | None:
        cfg = params["cfg"]
        if params.get("force"):
            return None
        key, complete = key_and_state(stage, cfg, params.get("known_key"))
        if key is None:
            return None
        if not complete:
            _COMPUTED[ctx.task_run.id] = key  # the body runs: it passes the key on (computed_key)
            return None
        cache_key = f"eagle3-{stage}-v{RESULT_VERSION}-{key}-{run_tag(cfg)}"
        store = ctx.result_store
        if not store.exists(cache_key):
            store.write(skipped(cfg, key), key=cache_key)
        return cache_key

    return key_fn
