"""Flow run names after the stage and the run: ``capture-<run>``, ``deploy-<run>``, ``train-<run>``.

Prefect names a run it is not told how to name with two random words ("mauve-hyena"), so the subflows of a pipeline
run could not be told apart on its page. ``stage_run_name(stage)`` is a ``flow_run_name`` callable: Prefect calls
it with the flow run's parameters in context, and it reads the run's name from them (``config``, or ``preset`` +
``overrides`` as eagle3.config.intended_run_name reads them, so an invalid config is still named).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_name_of(parameters: dict[str, Any]) -> str:
    """The run name that a flow's parameters (config, or preset + overrides) describe."""
    from eagle3.config import RunConfig, intended_run_name

    config = parameters.get("config")
    if isinstance(config, RunConfig):
        return config.run.name
    if isinstance(config, dict):
        name = (config.get("run") or {}).get("name") if isinstance(config.get("run"), dict) else None
        if isinstance(name, str) and name:
            return name
    preset = parameters.get("preset")
    return intended_run_name(preset if isinstance(preset, str) else "", list(parameters.get("overrides") or []))


def stage_run_name(stage: str) -> Callable[[], str]:
    """A ``flow_run_name`` callable giving ``<stage>-<run name>``."""

    def name() -> str:
        from prefect.runtime import flow_run

        return f"{stage}-{run_name_of(flow_run.parameters or {})}"

    name.__name__ = name.__qualname__ = f"{stage}_run_name"
    return name
