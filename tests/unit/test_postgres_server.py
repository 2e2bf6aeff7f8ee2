"""The Prefect server on a real PostgreSQL (scripts/postgres.sh): the tiny pipeline's flow run completes through it
and is stored in PostgreSQL, not in SQLite. Slow (~1 min: two Prefect imports, migrations, the data stages)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.postgres import ROOT, Postgres, free_port, postgres_cluster

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    with postgres_cluster() as pg:
        yield pg


def _eagle3(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_tiny_pipeline_runs_on_a_postgres_backed_server(postgres, tmp_path):
    """`eagle3 server start --database URL` + `eagle3 run --preset tiny --until vocab`: Completed, and in PostgreSQL."""
    workdir, port = tmp_path / "runs", free_port()
    env = {k: v for k, v in postgres.env.items() if not k.startswith("PREFECT_")}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    server_args = ["--workdir", str(workdir), "--port", str(port)]
    started = _eagle3(["server", "start", *server_args, "--database", postgres.url], env)
    try:
        assert f"on {postgres.url}" in started.stdout
        _eagle3(
            [
                "run",
                "--preset",
                "tiny",
                "--until",
                "vocab",
                "--port",
                str(port),
                "--no-progress",
                "--set",
                f"run.workdir={workdir}",
            ],
            env,
        )
        api = httpx.post(f"http://127.0.0.1:{port}/api/flow_runs/filter", json={}, timeout=30).json()
        status = _eagle3(["server", "status", *server_args], env).stdout
    finally:
        _eagle3(["server", "stop", *server_args], env)
    pipeline = [r for r in api if r["parent_task_run_id"] is None]
    assert [r["state_type"] for r in pipeline] == ["COMPLETED"]
    rows = postgres.psql(
        "select r.id, f.name, r.state_type from flow_run r join flow f on f.id = r.flow_id "
        "where r.parent_task_run_id is null"
    )
    assert rows == [[pipeline[0]["id"], "eagle3-pipeline", "COMPLETED"]]
    tasks = {name for [name] in postgres.psql("select name from task_run where state_type = 'COMPLETED'")}
    assert {"merge-tiny", "tokenize-tiny", "vocab-tiny"} <= tasks
    assert f'"database": "{postgres.url}"' in status
    assert not list((workdir / ".prefect").glob("*.db"))  # no SQLite database was made beside it
