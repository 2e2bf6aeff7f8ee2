"""Artifacts: live progress, tables and reports in the Prefect UI."""

from __future__ import annotations

import base64
import re
import time
from pathlib import Path
from typing import Any

from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from eagle3.config import RunConfig


def markdown_image(path: Path) -> str:
    """A PNG embedded as a data URI (the UI renders markdown artifacts without file access)."""
    return f"![{path.stem}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})"


def artifact_key(cfg: RunConfig, name: str) -> str:
    """'<run>-<name>' reduced to the lowercase letters, digits and dashes Prefect accepts."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{cfg.run.name}-{name}".lower()).strip("-")


def publish_table(cfg: RunConfig, name: str, rows: list[dict[str, Any]], description: str) -> None:
    """A keyed table artifact (versioned under the key on the Artifacts page)."""
    create_table_artifact(table=rows, key=artifact_key(cfg, name), description=description)


class ProgressArtifact:
    """A progress artifact updated from a core Progress callback, at most every ``min_interval_s``."""

    def __init__(self, key: str, description: str, min_interval_s: float = 2.0):
        self.key, self.description, self.min_interval_s = key, description, min_interval_s
        self.artifact_id = None
        self._last = 0.0

    def __enter__(self) -> ProgressArtifact:
        self.artifact_id = create_progress_artifact(progress=0.0, key=f"{self.key}-progress",
                                                    description=self.description)
        return self

    def callback(self, done: int, total: int, info: dict[str, Any]) -> None:
        """eagle3.progress.ProgressFn: update the artifact with percent done and the rate."""
        now = time.monotonic()
        if now - self._last < self.min_interval_s and done < total:
            return
        self._last = now
        percent = 100.0 * done / total if total else 100.0
        rate = info.get("rate_per_s")
        text = f"{self.description}: {done:,}/{total:,}" + (f" at {rate:,.1f}/s" if rate else "")
        update_progress_artifact(self.artifact_id, progress=min(percent, 100.0), description=text)

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None and self.artifact_id is not None:
            update_progress_artifact(self.artifact_id, progress=100.0, description=f"{self.description}: done")
