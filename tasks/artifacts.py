"""Artifacts: live progress, tables and reports in the Prefect UI."""

from __future__ import annotations

import base64
import re
import time
from pathlib import Path
from typing import Any, cast
from uuid import UUID

from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from eagle3.config import RunConfig
from eagle3.run.progress import eta_text, fmt


def markdown_image(path: Path) -> str:
    """A PNG embedded as a data URI (the UI renders markdown artifacts without file access)."""
    return f"![{path.stem}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})"


def artifact_key(cfg: RunConfig, name: str) -> str:
    """'<run>-<name>' reduced to the lowercase letters, digits and dashes Prefect accepts."""
    return run_artifact_key(cfg.run.name, name)


def run_artifact_key(run_name: str, name: str) -> str:
    """artifact_key for a run known only by name (a run whose config is invalid has no RunConfig)."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_name}-{name}".lower()).strip("-")


MAX_TABLE_COLUMNS = 8
"""Widest table an artifact or report shows: wider ones are cut off on the right of the UI's page."""


def narrow_tables(
    rows: list[dict[str, Any]], index: int = 1, max_columns: int = MAX_TABLE_COLUMNS
) -> list[list[dict[str, Any]]]:
    """``rows`` as tables of at most ``max_columns`` columns.

    One row becomes a two-column field/value table; several rows are split by columns, each part
    repeating the first ``index`` columns (the ones that say which row it is).
    """
    if not rows:
        return []
    if len(rows) == 1:
        return [[{"field": k, "value": v} for k, v in rows[0].items()]]
    columns = list(dict.fromkeys(k for r in rows for k in r))
    keys, rest = columns[:index], columns[index:]
    width = max(1, max_columns - index)
    groups = [rest[i : i + width] for i in range(0, len(rest), width)] or [[]]
    return [[{k: r.get(k, "") for k in keys + group} for r in rows] for group in groups]


def publish_table(cfg: RunConfig, name: str, rows: list[dict[str, Any]], description: str, index: int = 1) -> None:
    """Keyed table artifacts (versioned under the key on the Artifacts page), at most MAX_TABLE_COLUMNS wide:
    a wider table is published as parts `<name>`, `<name>-2`, ... (see narrow_tables)."""
    parts = narrow_tables(rows, index)
    for i, part in enumerate(parts, start=1):
        suffix = "" if i == 1 else f"-{i}"
        text = description if len(parts) == 1 else f"{description} (part {i} of {len(parts)})"
        create_table_artifact(table=part, key=artifact_key(cfg, name + suffix), description=text)


class ProgressArtifact:
    """A progress artifact updated from a core Progress callback, at most every ``min_interval_s``."""

    def __init__(self, key: str, description: str, min_interval_s: float = 2.0):
        self.key, self.description, self.min_interval_s = key, description, min_interval_s
        self.artifact_id: UUID | None = None
        self._last = 0.0

    def __enter__(self) -> ProgressArtifact:
        # Called from sync code, Prefect's async_dispatch returns the id itself (its type also names a coroutine).
        self.artifact_id = cast(
            UUID, create_progress_artifact(progress=0.0, key=f"{self.key}-progress", description=self.description)
        )
        return self

    def callback(self, done: int, total: int, info: dict[str, Any]) -> None:
        """eagle3.run.progress.ProgressFn: update the artifact with percent done and the rate."""
        now = time.monotonic()
        if now - self._last < self.min_interval_s and done < total:
            return
        self._last = now
        percent = 100.0 * done / total if total else 100.0
        rate = fmt(info.get("rate_per_s"), ",.1f")  # unknown (None, NaN): left out, never "nan"
        text = f"{self.description}: {done:,}/{total:,}" + (f" at {rate}/s" if rate and info["rate_per_s"] > 0 else "")
        if "eta_s" in info:
            text += f", {eta_text(info['eta_s'])}"
        update_progress_artifact(
            self.artifact_id,  # type: ignore[arg-type]  # set by __enter__: called inside the with
            progress=min(percent, 100.0),
            description=text,
        )

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None and self.artifact_id is not None:
            update_progress_artifact(self.artifact_id, progress=100.0, description=f"{self.description}: done")
