"""Timing the stages of a flow run and linking their runs, for the run summary (eagle3.run.summary renders it).

Durations are measured here, in the flow's process, from the call of a stage's task or subflow to its end state:
reading them back from the API after the run would race Prefect's task-run recorder, which writes task-run states
from events a little later. The links are Prefect's own UI addresses, built by
``prefect.utilities.urls.url_for`` (Prefect 3.9.1, src/prefect/utilities/urls.py: ``UI_URL_FORMATS`` maps
"flow-run" to ``runs/flow-run/{id}`` and "task-run" to ``runs/task-run/{id}`` under ``PREFECT_UI_URL``, which
Prefect derives from ``PREFECT_API_URL`` less its ``/api`` when unset: settings/models/_defaults.py
``default_ui_url``). Without an API URL (an ephemeral server) there is no UI to link to and the link is left out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

from prefect.client.schemas.objects import State

from eagle3.run.layout import RunLayout
from eagle3.run.summary import FAILED, NOT_STARTED, SKIPPED, StageRun, stage_output, state_label

RunKind = Literal["task-run", "flow-run"]
LINK_TEXT = {"task-run": "task run", "flow-run": "subflow run"}


def ui_url(kind: RunKind, run_id: UUID | str | None) -> str | None:
    """The UI page of a task run or flow run (None when no id or no UI address is known)."""
    from prefect.utilities.urls import url_for

    return url_for(kind, obj_id=run_id) if run_id else None


def run_id_of(kind: RunKind, state: State) -> UUID | None:
    """The id of the run that ended in ``state``: a task's own task run, or a subflow's flow run (a subflow's state
    also names its stand-in task run in the parent, which has no page of its own worth linking)."""
    details = state.state_details
    return details.task_run_id if kind == "task-run" else details.flow_run_id


class StageClock:
    """The StageRun of every stage a flow calls, in call order (``runs``)."""

    def __init__(self, root: Path, stage_of: Mapping[str, str] | None = None):
        """``stage_of``: the registry stage that a row named otherwise stands for (a flow's step), for its outputs."""
        self.layout = RunLayout(root)
        self.stage_of = dict(stage_of or {})
        self.runs: list[StageRun] = []

    def call(self, stage: str, kind: RunKind, run: Callable[[], State]) -> State:
        """Call ``run`` (a task or subflow called with ``return_state=True``), record the stage and return the state
        (whose ``result()`` raises if it failed)."""
        start = time.monotonic()
        try:
            state = run()
        except BaseException:  # an interrupt, or Prefect failing to start the run: it still shows, failed
            self.add(stage, FAILED, time.monotonic() - start)
            raise
        elapsed = time.monotonic() - start
        self.add(stage, state_label(state.name), elapsed, ui_url(kind, run_id_of(kind, state)), LINK_TEXT[kind])
        return state

    def plain(
        self, stage: str, run: Callable[[], Any], computed: Callable[[Any], bool | None], url: str | None = None
    ) -> Any:
        """Call ``run``, a stage with no single run of its own (a fan-out over deployments), and record it: its state
        from ``computed(result)``, linked to ``url`` (the flow run that fans out). Returns its result."""
        start = time.monotonic()
        try:
            result = run()
        except BaseException:
            self.add(stage, FAILED, time.monotonic() - start, url, "flow run")
            raise
        self.add(stage, state_label(None, computed(result)), time.monotonic() - start, url, "flow run")
        return result

    def skipped(self, stage: str, why: str) -> None:
        """Record a stage that the run's settings leave out (``why``)."""
        self.add(stage, SKIPPED, None, note=why)

    def not_started(self, stages: list[str]) -> None:
        """Record the planned stages a failure left unstarted."""
        for stage in stages:
            self.add(stage, NOT_STARTED, None)

    def add(
        self,
        stage: str,
        state: str,
        duration_s: float | None,
        url: str | None = None,
        run_kind: str = "",
        note: str = "",
    ) -> StageRun:
        """Append the StageRun of ``stage`` (its outputs' place from the registry)."""
        outputs = stage_output(self.layout, self.stage_of.get(stage, stage))
        record = StageRun(
            stage,
            state,
            None if duration_s is None else round(duration_s, 3),
            outputs,
            url,
            run_kind if url else "",
            note,
        )
        self.runs.append(record)
        return record

    def replace_last(self, runs: list[StageRun]) -> None:
        """Replace the last row (a subflow's) by the rows of the stages it ran, which it recorded and returned."""
        self.runs[-1:] = runs

    def to_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.runs]
