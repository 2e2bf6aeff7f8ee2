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
"""

from __future__ import annotations

import argparse
from datetime import timedelta

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


def ensure_work_pools(client) -> list[str]:
    """Create the process work pools that do not exist yet; returns the names created."""
    created = []
    for name in WORK_POOLS:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process",
                                                   description=f"eagle3 {name} hosts (one worker per host)"))
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
        trigger=EventTrigger(after={"prefect.flow-run.heartbeat"}, expect={"prefect.flow-run.*"},
                             match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                             for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                             within=timedelta(seconds=within_s)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message="No heartbeat: marked Crashed")],
    )


def _retry_automation() -> Automation:
    return Automation(
        name="eagle3-retry-crashed",
        description="A Crashed run of an eagle3 deployment goes back to AwaitingRetry (same run id, same params).",
        trigger=EventTrigger(expect={"prefect.flow-run.Crashed"},
                             match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
                             match_related=ResourceSpecification({"prefect.resource.id": f"prefect.tag.{DEPLOYMENT_TAG}",
                                                                  "prefect.resource.role": "tag"}),
                             posture=Posture.Reactive, threshold=1, within=timedelta(0)),
        actions=[ChangeFlowRunState(state=StateType.SCHEDULED, name="AwaitingRetry",
                                    message="Automatic retry after a crash", force=True)],
    )


def ensure_automations(heartbeat_frequency_s: int = HEARTBEAT_FREQUENCY_S) -> list[str]:
    """(Re)create both automations so their definitions always match this code."""
    wanted = [_heartbeat_automation(3 * heartbeat_frequency_s), _retry_automation()]
    for automation in wanted:
        try:
            Automation.read(name=automation.name).delete()
        except (ValueError, ObjectNotFound):
            pass
        automation.create()
    return [a.name for a in wanted]


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
