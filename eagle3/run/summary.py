"""The run summary: one row per stage of a pipeline run (state, duration, outputs, link), as markdown.

A pipeline run's own page in the Prefect UI shows its run-summary artifact; the stages' task runs and subflow
runs sit elsewhere (a subflow's tasks only on the subflow's page). So the summary names, per stage, what became
of it, how long the pipeline waited for it, where its outputs are in the run directory and a link to the run that
did the work. The orchestrator (flows/pipeline.py) times the stages and builds the links; everything here is plain
data and text, so it is tested without Prefect.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.run.layout import RunLayout, run_relative

COMPLETED = "Completed"
CACHED = "Cached (up to date)"
FAILED = "Failed"
SKIPPED = "Skipped"
NOT_STARTED = "Not started"
PREFECT_CACHED = "Cached"
"""Prefect's name for a task answered from its cache: what every up-to-date stage shows (tasks.stage_cache)."""

SUMMARY_COLUMNS = ("stage", "state", "seconds", "outputs", "result", "run")


@dataclass(frozen=True)
class StageRun:
    """One stage of a pipeline run as the summary shows it."""

    stage: str
    state: str
    """COMPLETED, CACHED, FAILED, SKIPPED, NOT_STARTED, or another end state's name (Crashed, Cancelled)."""
    duration_s: float | None
    """Wall time the pipeline waited for the stage (Prefect's bookkeeping included); None when it did not run."""
    outputs: str = ""
    """Where its outputs are, relative to the run directory ("" when outside it, e.g. the target check)."""
    url: str | None = None
    """Its task run or subflow run in the Prefect UI (None: no single run does the stage, or no UI is known)."""
    run_kind: str = ""
    """What ``url`` shows: "task run", "subflow run" or "flow run" (the link's text)."""
    note: str = ""
    """Why it was skipped, or what it produced (counts, figures)."""

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (what a subflow returns to the pipeline)."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StageRun:
        return cls(
            str(doc["stage"]),
            str(doc["state"]),
            doc.get("duration_s"),
            str(doc.get("outputs") or ""),
            doc.get("url"),
            str(doc.get("run_kind") or ""),
            str(doc.get("note") or ""),
        )


def state_label(state_name: str | None, computed: bool | None = None) -> str:
    """The summary's state of a stage from its Prefect state's name, or (``state_name`` None: a fan-out with no run
    of its own) from whether it computed: every up-to-date stage reads CACHED, as Prefect's Cached state does."""
    if state_name is None:
        return CACHED if computed is False else COMPLETED
    return CACHED if state_name == PREFECT_CACHED else state_name


def stage_output(layout: RunLayout, stage: str) -> str:
    """Where registry stage ``stage`` writes (eagle3.run.registry: StageSpec.output), relative to the run directory
    (folders end in '/'); "" for a row that is no registry stage (the target check prepares the target in its
    cache)."""
    from eagle3.run.registry import BY_NAME

    if stage not in BY_NAME:
        return ""
    path = BY_NAME[stage].output(layout.root)
    rel = run_relative(layout.root, path)
    return rel if path.suffix else rel + "/"


def headline(stage: str, result: Mapping[str, Any] | None) -> str:
    """The main counts of a stage's result (its task's JSON): what the summary's 'result' cell says. A registry
    stage says them itself (eagle3.run.registry: StageSpec.headline); otherwise, and for a row that is no registry
    stage, the cell lists the result's outputs."""
    from eagle3.run.registry import BY_NAME

    if not isinstance(result, Mapping) or not result:
        return ""
    if result.get("skipped"):
        return str(result["skipped"])
    said = BY_NAME[stage].headline(result) if stage in BY_NAME else None
    return said if said is not None else ", ".join(f"`{k}`" for k in result.get("outputs") or {})


def summary_rows(runs: Sequence[StageRun]) -> list[dict[str, str]]:
    """The summary table's rows (SUMMARY_COLUMNS), one per stage run, in call order."""
    return [
        {
            "stage": r.stage,
            "state": r.state,
            "seconds": "" if r.duration_s is None else f"{r.duration_s:.2f}",
            "outputs": f"`{r.outputs}`" if r.outputs else "",
            "result": r.note.replace("|", "/").replace("\n", " "),
            "run": f"[{r.run_kind or 'run'}]({r.url})" if r.url else "",
        }
        for r in runs
    ]


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> list[str]:
    """Lines of a markdown table of ``columns``."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [
        "| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows
    ]


def render_summary(
    run_name: str, run_dir: Path, runs: Sequence[StageRun], target: str = "", failure: tuple[str, str] | None = None
) -> str:
    """Markdown run summary: for a failed run first ``failure`` = (stage, "ExceptionType: message"), then the run
    directory, the target, and one table row per stage (summary_rows)."""
    lines = [f"# Run `{run_name}`" + (" failed" if failure else ""), ""]
    if failure:
        lines += [
            f"**Failed at stage `{failure[0]}`**:",
            "",
            "```",
            failure[1][:4000],
            "```",
            "",
            "The failed stage's run (linked below) and the flow run's Logs tab hold the traceback.",
            "",
        ]
    lines.append(f"* run directory: `{run_dir}` (the outputs below are relative to it)")
    if target:
        lines.append(f"* target: {target}")
    total = sum(r.duration_s or 0.0 for r in runs)
    lines += [f"* stages: {total:.1f} s in all", ""] + markdown_table(summary_rows(runs), SUMMARY_COLUMNS)
    return "\n".join(lines) + "\n"


def write_stage_runs(path: Path, flow_run_id: str, runs: Sequence[StageRun]) -> None:
    """Save the rows of flow run ``flow_run_id`` (atomically) for the command that follows the run from another
    process (the demo's client): it prints them at the end."""
    from infra.storage import atomic_write_json

    atomic_write_json(path, {"flow_run_id": flow_run_id, "stages": [r.to_json() for r in runs]})


def read_stage_runs(path: Path, flow_run_id: str) -> list[StageRun] | None:
    """The rows ``write_stage_runs`` saved for flow run ``flow_run_id``; None when the file is missing, unreadable
    or another run's (a run that crashed before writing must not show an earlier run's seconds)."""
    import json

    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("flow_run_id") != flow_run_id:
        return None
    return [StageRun.from_json(row) for row in doc.get("stages", [])]


def duration_lines(runs: Sequence[StageRun]) -> list[str]:
    """Plain-text lines of the seconds each stage took (the summary table's stage, state and seconds columns), and
    their total: what a terminal shows at the end of a run."""
    rows = summary_rows(runs)
    width = max([len(r["stage"]) for r in rows] + [5])
    lines = [f"  {r['stage']:<{width}}  {r['state']:<20} {r['seconds'] or '-':>9}" for r in rows]
    total = sum(r.duration_s or 0.0 for r in runs)
    return lines + [f"  {'total':<{width}}  {'':<20} {total:>9.2f}"]


def render_early_failure(
    run_name: str, title: str, why: str, message: str, preset: str, overrides: Sequence[str], advice: str
) -> str:
    """Markdown run summary of a run that stopped before any stage (an invalid config, a preset that needs a GPU
    host on a host without one, a crash loop): ``title`` names it, ``why`` says it in a sentence, ``message`` is
    the error, ``advice`` the fix."""
    given = "\n".join(f"* `{o}`" for o in overrides) or "* (none)"
    return (
        "\n".join(
            [
                f"# Run `{run_name}` failed: {title}",
                "",
                f"**Failed before any stage**: {why}",
                "",
                "```",
                message[:4000],
                "```",
                "",
                f"preset: `{preset}`; overrides:",
                "",
                given,
                "",
                advice,
            ]
        )
        + "\n"
    )
