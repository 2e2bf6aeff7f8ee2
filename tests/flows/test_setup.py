"""deployments.setup against a real (test-harness) Prefect server: idempotent pools, limits, automations."""

from __future__ import annotations

from prefect.automations import Automation
from prefect.client.orchestration import get_client

from deployments.setup import setup


def test_setup_twice_gives_one_of_each():
    """Running setup again creates nothing new and updates the slot counts."""
    first = setup(gpu_slots=1, inference_slots=4)
    second = setup(gpu_slots=2, inference_slots=8)
    assert set(first["work_pools_created"]) <= {"cpu", "gpu"} and second["work_pools_created"] == []
    assert second["tag_limits"] == {"gpu": 2, "inference": 8}
    with get_client(sync_client=True) as client:
        pools = {p.name for p in client.read_work_pools()}
        assert {"cpu", "gpu"} <= pools
        limits = [lim.tag for lim in client.read_concurrency_limits(limit=100, offset=0)]
    assert sorted(limits).count("gpu") == 1 and sorted(limits).count("inference") == 1
    for name in ("eagle3-heartbeat-missing", "eagle3-retry-crashed"):
        assert Automation.read(name=name).name == name


def test_heartbeat_window_is_three_periods():
    """The zombie window is 3 x the heartbeat frequency (a shorter one marks healthy runs Crashed)."""
    setup()
    trigger = Automation.read(name="eagle3-heartbeat-missing").trigger
    assert trigger.within.total_seconds() == 90


def _crashed_event(tags: list[str]):
    """The `prefect.flow-run.Crashed` event of a run whose deployment carries ``tags`` (as the server relates them)."""
    from uuid import uuid4

    from prefect.server.events.schemas.events import ReceivedEvent
    from prefect.types._datetime import now

    related = [{"prefect.resource.id": f"prefect.tag.{t}", "prefect.resource.role": "tag"} for t in tags]
    return ReceivedEvent(occurred=now("UTC"), event="prefect.flow-run.Crashed", id=uuid4(),
                         resource={"prefect.resource.id": f"prefect.flow-run.{uuid4()}"}, related=related)


def test_retry_automation_reruns_top_level_runs_but_not_fanout_runs():
    """The retry trigger covers a Crashed run of every prefect.yaml deployment except the slice and node runs,
    which their parent re-submits (a node re-run alone by the automation would wait at a left rendezvous)."""
    from pathlib import Path

    import yaml
    from prefect.server.events.schemas.automations import EventTrigger

    from deployments.setup import _retry_automation

    trigger = EventTrigger.model_validate(_retry_automation().trigger.model_dump())
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "prefect.yaml").read_text())
    covered = {d["name"]: trigger.covers(_crashed_event(d["tags"])) for d in doc["deployments"]}
    fanout = {"eagle3-capture-slice", "eagle3-train-node"}
    assert {n for n, c in covered.items() if not c} == fanout
    assert len(covered) >= 7 and all(covered[n] for n in covered if n not in fanout)
