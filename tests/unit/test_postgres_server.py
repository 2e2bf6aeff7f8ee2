"""The Prefect server on a real PostgreSQL (scripts/postgres.sh): the tiny pipeline's flow run completes through it
and is stored in PostgreSQL, not in SQLite. Slow (~1 min: two Prefect imports, migrations, the data stages)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "postgres.sh")


@dataclass(frozen=True)
class Postgres:
    """A running throw-away cluster: its URL, its binaries and the environment that names it."""

    url: str
    bin_dir: Path
    env: dict[str, str]
    port: int


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    """scripts/postgres.sh start in a temp folder on a free port; stopped and removed afterwards."""
    found = subprocess.run([SCRIPT, "bin"], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip(f"no PostgreSQL server binaries found ({found.stderr.strip()})")
    folder = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
    folder.chmod(0o755)  # as root the cluster runs as `postgres`, which must be able to enter the folder
    port = _free_port()
    env = {**os.environ, "EAGLE3_PG_DIR": str(folder / "pg"), "EAGLE3_PG_PORT": str(port)}
    try:
        started = subprocess.run([SCRIPT, "start"], env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr
        yield Postgres(started.stdout.strip(), Path(found.stdout.strip()), env, port)
    finally:
        subprocess.run([SCRIPT, "stop"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


def _eagle3(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _psql(pg: Postgres, sql: str) -> list[list[str]]:
    out = subprocess.run([str(pg.bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(pg.port), "-U", "prefect",
                          "prefect", "-Atc", sql], capture_output=True, text=True, check=True).stdout
    return [line.split("|") for line in out.splitlines()]


def test_tiny_pipeline_runs_on_a_postgres_backed_server(postgres, tmp_path):
    """`eagle3 server start --database URL` + `eagle3 run --preset tiny --until vocab`: Completed, and in PostgreSQL."""
    workdir, port = tmp_path / "runs", _free_port()
    env = {k: v for k, v in postgres.env.items() if not k.startswith("PREFECT_")}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    server_args = ["--workdir", str(workdir), "--port", str(port)]
    started = _eagle3(["server", "start", *server_args, "--database", postgres.url], env)
    try:
        assert f"on {postgres.url}" in started.stdout
        _eagle3(["run", "--preset", "tiny", "--until", "vocab", "--port", str(port), "--no-progress",
                 "--set", f"run.workdir={workdir}"], env)
        api = httpx.post(f"http://127.0.0.1:{port}/api/flow_runs/filter", json={}, timeout=30).json()
        status = _eagle3(["server", "status", *server_args], env).stdout
    finally:
        _eagle3(["server", "stop", *server_args], env)
    pipeline = [r for r in api if r["parent_task_run_id"] is None]
    assert [r["state_type"] for r in pipeline] == ["COMPLETED"]
    rows = _psql(postgres, "select r.id, f.name, r.state_type from flow_run r join flow f on f.id = r.flow_id "
                           "where r.parent_task_run_id is null")
    assert rows == [[pipeline[0]["id"], "eagle3-pipeline", "COMPLETED"]]
    tasks = {name for [name] in _psql(postgres, "select name from task_run where state_type = 'COMPLETED'")}
    assert {"merge-tiny", "tokenize-tiny", "vocab-tiny"} <= tasks
    assert f'"database": "{postgres.url}"' in status
    assert not list((workdir / ".prefect").glob("*.db"))  # no SQLite database was made beside it
