"""What the flows share: the preset parameter type and the crash-loop guard every flow starts with, and the fan-out
that multi-node training (flows/train_nodes.py), sliced capture (flows/capture.py) and sliced regeneration
(flows/regenerate.py) share: flow runs of a deployment, submitted without waiting and then polled.

`run_deployment(..., timeout=0)` returns as soon as the run is scheduled, so a parent can hand N runs to N
workers at once; the parent then polls their states (a flow run's state lives on the server, so a run whose
worker died ends Crashed there, marked by the heartbeat automation) and decides what to submit again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast
from uuid import UUID

from pydantic import BaseModel

from eagle3.config import RunConfig, list_presets

if TYPE_CHECKING:  # a Literal built at run time is no type to a type checker: it checks a str
    from prefect.client.schemas.objects import FlowRun

    PresetName = str
else:
    PresetName = Literal[tuple(list_presets())]
"""A flow's ``preset`` parameter: one of the presets in configs/ (the UI shows them as a drop-down)."""


def gpu_needs(cfg: RunConfig) -> list[str]:
    """The settings of ``cfg`` that need a CUDA device (empty: the run can go on a CPU-only host): a stage whose
    device is cuda, or SGLang (capture or regeneration), which runs on GPUs only."""
    regenerates = cfg.regenerate.enabled
    needs = [
        f"{name}.device={device}"
        for name, device in (
            ("regenerate", cfg.regenerate.device if regenerates and cfg.regenerate.backend == "hf" else "cpu"),
            ("train", cfg.train.device),
            ("capture", cfg.capture.device),
            ("evaluate", cfg.evaluate.device),
        )
        if str(device).startswith("cuda")
    ]
    needs += ["capture.backend=sglang"] if cfg.capture.backend == "sglang" else []
    return needs + (["regenerate.backend=sglang"] if regenerates and cfg.regenerate.backend == "sglang" else [])


def gpu_presets() -> list[str]:
    """The presets in configs/ that need a GPU host (gpu_needs of their config, as written)."""
    from eagle3.config import ConfigError, load_config

    found = []
    for preset in list_presets():
        try:
            if gpu_needs(load_config(preset)):
                found.append(preset)
        except ConfigError:  # a broken preset fails where it is run, with its own message
            continue
    return found


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def preset_gpu_note(fn: _Fn) -> _Fn:
    """Decorator (under @flow): append to the ``preset:`` line of the docstring's Args the presets that need a GPU
    host, so the run form's description of the drop-down says which ones cannot run on a CPU-only machine."""
    note = f" Needs a CUDA GPU host (refused at once without one): {', '.join(gpu_presets())}." if gpu_presets() else ""
    lines = (fn.__doc__ or "").split("\n")
    for i, line in enumerate(lines):
        if line.strip().startswith("preset:"):
            j = i + 1  # the description may wrap onto deeper-indented lines
            indent = len(line) - len(line.lstrip())
            while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > indent:
                j += 1
            lines[j - 1] = lines[j - 1].rstrip() + note
            break
    fn.__doc__ = "\n".join(lines)
    return fn


class NeedsGpuError(RuntimeError):
    """A run whose config needs a CUDA device was started on a host without one."""


def refuse_without_gpu(cfg: RunConfig, what: str, cuda_available: Callable[[], bool] | None = None) -> None:
    """NeedsGpuError naming the settings when ``cfg`` needs a GPU and this host has no CUDA device (before any
    download, model load or process start)."""
    needs = gpu_needs(cfg)
    if not needs:
        return
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available
    if not cuda_available():
        raise NeedsGpuError(
            f"{what} needs a CUDA GPU host ({', '.join(needs)}) and this host has no CUDA device; "
            "run it on a GPU worker, or pick a CPU preset (tiny, smollm2-demo) or override those "
            "settings"
        )


def _flow_config() -> tuple[RunConfig, str] | None:
    """The run config the current flow run's parameters describe (config, else preset + overrides) and how to name
    it; None when they name none or an invalid one (the flow reports a config error itself)."""
    from prefect.runtime import flow_run

    from eagle3.config import ConfigError, load_config

    params = flow_run.parameters or {}
    config = params.get("config")
    try:
        if isinstance(config, RunConfig):
            return config, f"run {config.run.name!r}"
        if isinstance(config, dict):
            cfg = RunConfig.model_validate(config)
            return cfg, f"run {cfg.run.name!r}"
        if isinstance(params.get("preset"), str):
            return load_config(params["preset"], list(params.get("overrides") or [])), f"preset {params['preset']!r}"
    except (ConfigError, ValueError, RecursionError, OSError):
        return None
    return None


MAX_CRASH_RETRIES = 3

MAX_SLICE_ROUNDS = 3
"""Submissions of one slice in all (the first and two more after a Crashed or Failed run)."""
RESUBMIT_STATES = ("CRASHED", "FAILED")
"""Endings after which a slice is submitted again (a lost host, an error); Cancelled stops the fan-out."""


def as_json(result: Any) -> Any:
    """A task's or subflow's result as the JSON a flow returns (typed records through their ``to_json``)."""
    return result.to_json() if hasattr(result, "to_json") else result


def guard_crash_loop() -> None:
    """What every flow starts with: refuse to run again after MAX_CRASH_RETRIES automatic restarts (an OOM every
    time, say); on a retried attempt, mark Crashed the task runs the killed attempt left Running
    (crash_stale_task_runs); and refuse at once a run that needs a GPU on a host without CUDA (refuse_without_gpu)."""
    from prefect.runtime import flow_run

    if flow_run.run_count > MAX_CRASH_RETRIES:
        raise RuntimeError(f"flow run restarted {flow_run.run_count} times; refusing to loop (see its logs)")
    if flow_run.run_count > 1:
        crash_stale_task_runs(flow_run.id, flow_run.run_count)
    found = _flow_config()
    if found is not None:
        refuse_without_gpu(*found)


def crash_stale_task_runs(flow_run_id: Any, attempt: int) -> list[UUID]:
    """Mark Crashed every task run of ``flow_run_id`` that an earlier attempt left Running (or Pending) when attempt
    ``attempt`` starts: that attempt's process was killed, and nobody else would ever end them, so the run page and
    the dashboard would count them as running forever. Subflow stand-ins are left to their subflow. Returns their
    ids."""
    from prefect import get_run_logger
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentTaskRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    stale_types = [StateType.RUNNING, StateType.PENDING]
    with get_client(sync_client=True) as client:
        open_runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[UUID(str(flow_run_id))]),
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=stale_types)),
            )
        )
        open_runs = [r for r in open_runs if r.flow_run_run_count < attempt]
        # A subflow's stand-in task run stays open: the engine re-attaches the subflow run to it (its own first
        # step then does this for its tasks), and a run_deployment child may still run on another worker.
        parents = (
            {
                f.parent_task_run_id
                for f in client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(
                        parent_task_run_id=FlowRunFilterParentTaskRunId(any_=[r.id for r in open_runs])
                    )
                )
            }
            if open_runs
            else set()
        )
        stale = [r for r in open_runs if r.id not in parents]
        for run in stale:
            client.set_task_run_state(
                run.id,
                Crashed(
                    message=f"its flow run's attempt {attempt - 1} was killed; attempt {attempt} started without it"
                ),
                force=True,
            )
    if stale:
        get_run_logger().warning(
            "attempt %d: marked %d task run(s) of the killed attempt Crashed: %s",
            attempt,
            len(stale),
            ", ".join(sorted(r.name for r in stale)),
        )
    return [r.id for r in stale]


def submit_run(deployment: str, parameters: dict[str, Any], name: str) -> UUID:
    """Schedule one flow run of ``deployment`` (a subflow of the calling flow) and return its id at once."""
    from prefect.deployments import run_deployment

    params = {k: json.loads(v.model_dump_json()) if isinstance(v, BaseModel) else v for k, v in parameters.items()}
    run = run_deployment(deployment, parameters=params, timeout=0, as_subflow=True, flow_run_name=name)
    return cast("FlowRun", run).id  # (a sync call: Prefect's sync_compatible returns the run itself)


def wait_runs(
    ids: list[UUID], poll_s: float, deadline_s: float, on_poll: Callable[[], None] | None = None
) -> list[str]:
    """Poll until every flow run is final; their state types, in order (TIMEOUT for any still open at the end).

    ``on_poll`` runs after each look (e.g. to refresh a progress artifact from what is on disk)."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + deadline_s
    with get_client(sync_client=True) as client:
        while True:
            states = [client.read_flow_run(i).state for i in ids]
            if on_poll is not None:
                on_poll()
            if all(s is not None and s.is_final() for s in states) or time.monotonic() > deadline:
                return [s.type.value if s is not None and s.is_final() else "TIMEOUT" for s in states]
            time.sleep(poll_s)


def run_slices(
    deployment: str,
    parameters: dict[int, dict[str, Any]],
    name: str,
    on_poll: Callable[[], None] | None = None,
    poll_s: float = 5.0,
) -> None:
    """Run one flow run of ``deployment`` per slice (``parameters``: slice -> its run's parameters) until all
    complete; a slice whose run ends Crashed or Failed is submitted again with the same parameters
    (MAX_SLICE_ROUNDS submissions in all). Runs are named ``{name}-slice{k}-try{n}``; RuntimeError naming the
    slices when one ends otherwise (Cancelled) or fails every round. Slices must be idempotent: a re-submitted
    one skips the work its first run finished."""
    import math

    from prefect import get_run_logger

    logger, todo = get_run_logger(), dict(parameters)
    for attempt in range(1, MAX_SLICE_ROUNDS + 1):
        ids = {k: submit_run(deployment, params, f"{name}-slice{k}-try{attempt}") for k, params in todo.items()}
        logger.info("attempt %d: slices %s submitted to %s", attempt, sorted(ids), deployment)
        states = dict(zip(ids, wait_runs(list(ids.values()), poll_s, deadline_s=math.inf, on_poll=on_poll)))
        ended = {k: st for k, st in states.items() if st != "COMPLETED"}
        if not ended:
            return
        if any(st not in RESUBMIT_STATES for st in ended.values()):
            raise RuntimeError(f"{name} slice runs ended {ended} (slice -> state); not submitting them again")
        logger.warning("attempt %d: slices %s did not complete (%s)", attempt, sorted(ended), ended)
        todo = {k: todo[k] for k in ended}
    raise RuntimeError(f"{name} slices {sorted(todo)} failed {MAX_SLICE_ROUNDS} times; last states: {ended}")
