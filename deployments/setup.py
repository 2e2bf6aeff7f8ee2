"""Idempotent server-side setup: work pools, concurrency limits, crash-recovery automations.

    eagle3 setup                 (or: python -m deployments.setup)

* Work pools `cpu` and `gpu` (process type): one worker per host, `--pool gpu` on GPU hosts.
* Tag concurrency limits `gpu` (tasks that hold GPUs: training, in-process capture) and `inference`
  (capture shards and regeneration hitting the servers). Prefect 3 stores them as global limits
  named `tag:gpu` and `tag:inference`; re-running setup updates the slot counts.
* Two automations for VM loss (a flow whose process died with its machine stays Running forever):
  `eagle3-heartbeat-missing` marks a run Crashed when no heartbeat arrived within 3 heartbeat
  periods; `eagle3-retry-crashed` puts a Crashed run of a deployment tagged `eagle3` back to
  AwaitingRetry, so a live worker picks the same run up again and completed stages are skipped
  from their manifests. The flows refuse to loop forever (run_count guard in flows/common.py).
* The deployments of prefect.yaml (apply_deployments): a missing one is created as prefect.yaml says; an
  existing one is left alone when its definition (prefect.yaml entry, pull steps, parameter schema) is unchanged
  since setup last applied it (the fingerprint is kept in the deployment's `version`), and otherwise updated
  without its schedules. Setup never switches a schedule on or off, never edits or deletes a schedule or its
  per-schedule parameters, and never deletes upcoming runs: a schedule switched on in the UI stays on. (Prefect
  itself replaces a deployment's upcoming auto-scheduled runs when the deployment is updated; setup re-creates
  them at once.) A schedule of prefect.yaml that the server lacks is added, switched as prefect.yaml says.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

from prefect.automations import Automation
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

WORK_POOLS = ("cpu", "gpu")
DEPLOYMENT_TAG = "eagle3"
HEARTBEAT_FREQUENCY_S = 30
"""Must match PREFECT_FLOWS_HEARTBEAT_FREQUENCY in prefect.yaml's job variables."""
VERSION_PREFIX = "eagle3-setup:"
"""A deployment's `version` as setup applied it: this prefix and the fingerprint of its definition."""


def ensure_work_pools(client) -> list[str]:
    """Create the process work pools that do not exist yet; returns the names created."""
    created = []
    for name in WORK_POOLS:
        try:
            client.create_work_pool(
                WorkPoolCreate(name=name, type="process", description=f"eagle3 {name} hosts (one worker per host)")
            )
            created.append(name)
        except ObjectAlreadyExists:
            pass
    return created


def ensure_tag_limits(client, limits: dict[str, int]) -> dict[str, int]:
    """Create or update tag concurrency limits (stored as global limits `tag:<tag>`)."""
    for tag, slots in limits.items():
        client.create_concurrency_limit(tag=tag, concurrency_limit=slots)
    return {tag: client.read_concurrency_limit_by_tag(tag).concurrency_limit for tag in limits}


def _heartbeat_automation(within_s: int) -> Automation:
    return Automation(
        name="eagle3-heartbeat-missing",
        description="A flow run that sent no heartbeat for 3 periods is marked Crashed (its VM is gone).",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.*"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message="No heartbeat: marked Crashed")],
    )


def _retry_automation() -> Automation:
    return Automation(
        name="eagle3-retry-crashed",
        description="A Crashed run of an eagle3 deployment goes back to AwaitingRetry (same run id, same params).",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            match_related=ResourceSpecification(
                {"prefect.resource.id": f"prefect.tag.{DEPLOYMENT_TAG}", "prefect.resource.role": "tag"}
            ),
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.SCHEDULED, name="AwaitingRetry", message="Automatic retry after a crash", force=True
            )
        ],
    )


def ensure_automations(heartbeat_frequency_s: int = HEARTBEAT_FREQUENCY_S) -> list[str]:
    """(Re)create both automations so their definitions always match this code."""
    wanted = [_heartbeat_automation(3 * heartbeat_frequency_s), _retry_automation()]
    for automation in wanted:
        with contextlib.suppress(ValueError, ObjectNotFound):
            cast(Automation, Automation.read(name=automation.name)).delete()  # (sync_compatible: sync here)
        automation.create()
    return [a.name for a in wanted]


def _flow_and_schema(entrypoint: str, cwd: Path) -> tuple[str, dict[str, Any]]:
    """The flow name and parameter schema of ``entrypoint`` (as `prefect deploy` computes them)."""
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema

    path, _, func = entrypoint.partition(":")
    flow: Any = load_flow_from_entrypoint(f"{(cwd / path).resolve()}:{func}")
    return flow.name, parameter_schema(flow).model_dump(mode="json")


def deployment_fingerprint(doc: dict[str, Any], spec: dict[str, Any], schema: dict[str, Any], cwd: Path) -> str:
    """What setup applies of one deployment, schedules excluded (setup never re-applies those): its
    prefect.yaml entry, the project's build/push/pull steps, the flow's parameter schema and the working
    directory `prefect deploy` records. Equal fingerprints: re-applying would change nothing."""
    import prefect

    owned = {
        "deployment": {k: v for k, v in spec.items() if k != "schedules"},
        "steps": {k: doc.get(k) for k in ("build", "push", "pull")},
        "schema": schema,
        "cwd": str(cwd.resolve()),
        "prefect": prefect.__version__,
    }
    return VERSION_PREFIX + hashlib.sha256(json.dumps(owned, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _schedule_text(schedule: Any) -> str:
    """'0 3 * * * UTC', 'every 3600 s' or the rrule, for setup's report."""
    if getattr(schedule, "cron", None):
        return f"{schedule.cron} {schedule.timezone or 'UTC'}"
    if getattr(schedule, "interval", None):
        return f"every {schedule.interval.total_seconds():.0f} s"
    return str(getattr(schedule, "rrule", schedule))


def _wanted_schedules(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """prefect.yaml's schedules of one deployment as DeploymentScheduleCreate keyword dicts."""
    from prefect.cli.deploy._schedules import _construct_schedules

    if not spec.get("schedules"):
        return []
    return (
        _construct_schedules(
            spec,
            {},
            console=None,  # type: ignore[arg-type]  # not interactive: prints nothing
            is_interactive=lambda: False,
        )
        or []
    )


def _upcoming_runs(client, deployment_id) -> list[Any]:
    """The deployment's runs still waiting in Scheduled."""
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )

    return client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
        flow_run_filter=FlowRunFilter(
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))
        ),
    )


def _keep_schedules(client, deployment: Any, spec: dict[str, Any]) -> list[str]:
    """Add prefect.yaml's schedules that the deployment lacks (as prefect.yaml switches them); describe every
    schedule the deployment keeps. Never changes, switches or deletes an existing schedule."""
    from prefect.client.schemas.actions import DeploymentScheduleCreate

    have = client.read_deployment_schedules(deployment.id)
    notes = []
    for wanted in _wanted_schedules(spec):
        if not any(s.schedule == wanted["schedule"] for s in have):
            client.create_deployment_schedules(deployment.id, [DeploymentScheduleCreate(**wanted)])
            notes.append(
                f"added schedule {_schedule_text(wanted['schedule'])} "
                f"({'on' if wanted.get('active', True) else 'off'}, as prefect.yaml says)"
            )
    for s in have:
        params = f", its parameters {json.dumps(s.parameters)}" if s.parameters else ""
        notes.append(f"kept schedule {_schedule_text(s.schedule)} as it is ({'on' if s.active else 'off'}{params})")
    return notes


def _prefect_deploy(doc: dict[str, Any], names: list[str], cwd: Path, env: dict[str, str]) -> None:
    """`prefect --no-prompt deploy --name ...` of ``doc`` (a prefect.yaml document) run in ``cwd``."""
    import yaml

    with tempfile.TemporaryDirectory(prefix="eagle3-setup-") as tmp:
        prefect_file = Path(tmp) / "prefect.yaml"
        prefect_file.write_text(yaml.safe_dump(doc, sort_keys=False))
        argv = [
            str(Path(sys.executable).with_name("prefect")),
            "--no-prompt",
            "deploy",
            "--prefect-file",
            str(prefect_file),
        ] + [a for n in names for a in ("--name", n)]
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"prefect deploy failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def apply_deployments(names: list[str], cwd: Path, env: dict[str, str] | None = None) -> list[str]:
    """Register the deployments ``names`` of ``cwd``/prefect.yaml on the server this process talks to (``env``:
    the environment of the `prefect deploy` subprocess, by default this process's with its API URL), keeping
    every existing schedule, its switch, its parameters and the upcoming runs. Returns one line per deployment
    saying what was created, kept or updated."""
    import yaml
    from prefect.settings import PREFECT_API_URL

    env = env or {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    doc = yaml.safe_load((cwd / "prefect.yaml").read_text())
    specs = {d["name"]: d for d in doc["deployments"]}
    plan: dict[str, tuple[str, Any, str]] = {}  # name -> (fingerprint, existing deployment or None, flow name)
    with get_client(sync_client=True) as client:
        for name in names:
            flow_name, schema = _flow_and_schema(specs[name]["entrypoint"], cwd)
            try:
                existing = client.read_deployment_by_name(f"{flow_name}/{name}")
            except ObjectNotFound:
                existing = None
            plan[name] = (deployment_fingerprint(doc, specs[name], schema, cwd), existing, flow_name)
        stale = [n for n, (fp, existing, _) in plan.items() if existing is None or existing.version != fp]
        upcoming = {
            n: _upcoming_runs(client, existing.id)
            for n, (_, existing, _) in plan.items()
            if n in stale and existing is not None
        }
    if stale:
        entries = []
        for spec in doc["deployments"]:
            if spec["name"] in stale:
                fp, existing, _ = plan[spec["name"]]
                # an existing deployment is updated without schedules: Prefect then keeps them as they are
                entries.append({**spec, "version": fp} | ({"schedules": None} if existing is not None else {}))
        _prefect_deploy({**doc, "deployments": entries}, stale, cwd, env)
    lines = []
    with get_client(sync_client=True) as client:
        for name, (_fp, existing, flow_name) in plan.items():
            deployment = client.read_deployment_by_name(f"{flow_name}/{name}")
            if existing is None:
                wanted = ", ".join(
                    f"{_schedule_text(s.schedule)} {'on' if s.active else 'off'}"
                    for s in client.read_deployment_schedules(deployment.id)
                )
                lines.append(f"created deployment {name}" + (f" (schedules: {wanted})" if wanted else ""))
                continue
            notes = _keep_schedules(client, deployment, specs[name])
            if name in stale:
                gone = len(upcoming[name])
                if gone and any(s.active for s in client.read_deployment_schedules(deployment.id)):
                    # Prefect deleted the auto-scheduled runs of the old definition; schedule them again now
                    client.request("POST", "/deployments/{id}/schedule", path_params={"id": deployment.id}, json={})
                now = len(_upcoming_runs(client, deployment.id))
                lines.append(
                    f"updated deployment {name} (its definition changed)"
                    + "".join(f"; {n}" for n in notes)
                    + (f"; {gone} upcoming runs before, {now} now" if gone or now else "")
                )
            else:
                now = len(_upcoming_runs(client, deployment.id))
                lines.append(
                    f"kept deployment {name} as it is (unchanged since setup applied it)"
                    + "".join(f"; {n}" for n in notes)
                    + (f"; kept its {now} upcoming runs" if now else "")
                )
    return lines


def setup(gpu_slots: int = 1, inference_slots: int = 4) -> dict[str, object]:
    """Everything above, in order; safe to run any number of times."""
    with get_client(sync_client=True) as client:
        pools = ensure_work_pools(client)
        limits = ensure_tag_limits(client, {"gpu": gpu_slots, "inference": inference_slots})
    return {"work_pools_created": pools, "tag_limits": limits, "automations": ensure_automations()}


def main(argv: list[str] | None = None) -> None:
    """python -m deployments.setup [--gpu-slots N] [--inference-slots N]"""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-slots", type=int, default=1, help="GPU-tagged tasks at once (GPUs per pool)")
    parser.add_argument("--inference-slots", type=int, default=4, help="inference-tagged tasks at once")
    args = parser.parse_args(argv)
    print(setup(args.gpu_slots, args.inference_slots))


if __name__ == "__main__":
    main()
