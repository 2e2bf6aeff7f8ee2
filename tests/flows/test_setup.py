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
    return ReceivedEvent(
        occurred=now("UTC"),
        event="prefect.flow-run.Crashed",
        id=uuid4(),
        resource={"prefect.resource.id": f"prefect.flow-run.{uuid4()}"},
        related=related,
    )


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


def _pipeline_schedule_on():
    """Switch eagle3-pipeline's nightly schedule on and give it per-schedule parameters, as a user does in the UI;
    the scheduler's upcoming runs are made at once (POST /deployments/{id}/schedule, what the scheduler calls).
    Returns (deployment id, schedule id, ids of the upcoming runs)."""
    from deployments.setup import _upcoming_runs

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("eagle3-pipeline/eagle3-pipeline")
        [schedule] = client.read_deployment_schedules(deployment.id)
        client.update_deployment_schedule(
            deployment.id, schedule.id, active=True, parameters={"preset": "tiny", "overrides": []}
        )
        client.request("POST", "/deployments/{id}/schedule", path_params={"id": deployment.id}, json={"min_runs": 3})
        runs = {r.id for r in _upcoming_runs(client, deployment.id)}
    assert len(runs) >= 3
    return deployment.id, schedule.id, runs


def _schedule_and_runs(deployment_id, schedule_id):
    from deployments.setup import _upcoming_runs

    with get_client(sync_client=True) as client:
        schedules = {s.id: s for s in client.read_deployment_schedules(deployment_id)}
        return schedules.get(schedule_id), {r.id for r in _upcoming_runs(client, deployment_id)}


def test_setup_again_keeps_a_schedule_switched_on_and_its_upcoming_runs(tmp_path, capsys):
    """`eagle3 setup` run again after a schedule was switched on in the UI (with per-schedule parameters) leaves
    it on with its parameters, deletes none of its upcoming runs, and says what it kept."""
    from pathlib import Path
    from urllib.parse import urlparse

    from prefect.settings import PREFECT_API_URL

    from flows.cli import setup_local
    from flows.local_server import LocalServer

    server = LocalServer(tmp_path / ".prefect", urlparse(PREFECT_API_URL.value()).port)
    setup_local(server, start_workers=False)
    deployment_id, schedule_id, runs = _pipeline_schedule_on()
    capsys.readouterr()
    setup_local(server, start_workers=False)
    printed = capsys.readouterr().out
    schedule, after = _schedule_and_runs(deployment_id, schedule_id)
    assert schedule is not None and schedule.active and schedule.parameters == {"preset": "tiny", "overrides": []}
    assert runs <= after
    assert "kept deployment eagle3-pipeline as it is" in printed and "0 3 * * * UTC as it is (on" in printed
    with get_client(sync_client=True) as client:  # registered from a copy of prefect.yaml, run in the checkout
        steps = client.read_deployment(deployment_id).pull_steps
    assert steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(Path(__file__).resolve().parents[2])}}
    ], steps


def test_setup_after_a_definition_change_keeps_the_schedule_switched_on():
    """When the deployment must be re-applied (its definition changed since setup applied it), setup updates it
    without its schedules: the switch and the per-schedule parameters stay, and upcoming runs exist again."""
    from pathlib import Path

    from prefect.client.schemas.actions import DeploymentUpdate

    from deployments.setup import apply_deployments

    root = Path(__file__).resolve().parents[2]
    setup()
    apply_deployments(["eagle3-pipeline"], root)
    deployment_id, schedule_id, runs = _pipeline_schedule_on()
    with get_client(sync_client=True) as client:  # as if prefect.yaml had changed since
        client.update_deployment(deployment_id, DeploymentUpdate(version="eagle3-setup:older"))
    deployment_id, schedule_id, runs = _pipeline_schedule_on()  # (the update above removed the upcoming runs)
    lines = apply_deployments(["eagle3-pipeline"], root)
    schedule, after = _schedule_and_runs(deployment_id, schedule_id)
    assert schedule is not None and schedule.active and schedule.parameters == {"preset": "tiny", "overrides": []}
    assert len(after) >= len(runs), lines
    with get_client(sync_client=True) as client:
        assert client.read_deployment(deployment_id).version.startswith("eagle3-setup:")
        assert client.read_deployment(deployment_id).version != "eagle3-setup:older"
    assert any("updated deployment eagle3-pipeline" in line and "as it is (on" in line for line in lines), lines
