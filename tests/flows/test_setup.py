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
