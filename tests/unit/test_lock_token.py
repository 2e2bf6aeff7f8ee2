"""The run lock's holder proves itself with a secret token, never with its visible id (issue 39, item 13)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from infra.locks import LOCK_FILE, LockHeldError, run_lock

HOLD = (
    "import sys, time; from infra.locks import run_lock\n"
    "with run_lock(sys.argv[1], owner=sys.argv[2]):\n    print('held', flush=True); time.sleep(30)\n"
)
TAKE = "import sys; from infra.locks import run_lock\nwith run_lock(sys.argv[1]):\n    print('ok')\n"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_RUN_LOCK")}
    return {**env, **extra}


def _take(run_dir, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TAKE, str(run_dir)], capture_output=True, text=True, env=env)


def test_a_process_presenting_the_visible_holder_id_is_refused(tmp_path):
    """Anyone can read host:pid in the lock file; presenting it (in the old or the new variable) proves nothing."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path), "flow"], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        visible = f"{record['host']}:{record['pid']}"
        for name in ("EAGLE3_RUN_LOCK_HOLDER", "EAGLE3_RUN_LOCK_TOKEN"):
            for value in (visible, f"0:{visible}", f"0:{record.get('token_sha256', 'x' * 64)}"):
                claimed = _take(tmp_path, _env(**{name: value}))
                assert claimed.returncode != 0 and "locked by pid" in claimed.stderr, (name, value, claimed.stdout)
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_file_holds_no_secret_and_the_holders_children_still_get_in(tmp_path):
    """The record keeps only a hash of the token; a child of the holder (torchrun under a flow) is let in."""
    with run_lock(tmp_path, owner="flow"):
        token = os.environ["EAGLE3_RUN_LOCK_TOKEN"].partition(":")[2]
        assert len(token) >= 32 and token not in (tmp_path / LOCK_FILE).read_text()
        child = _take(tmp_path, dict(os.environ))
        assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr
    assert "EAGLE3_RUN_LOCK_TOKEN" not in os.environ


def test_two_children_of_the_holder_cannot_write_side_by_side(tmp_path):
    """A node wrongly marked Crashed still trains: its re-submitted twin, carrying the same token, is refused."""
    with run_lock(tmp_path, owner="flow"):
        first = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(tmp_path), "node try1"],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        try:
            assert first.stdout.readline().strip() == "held"
            twin = _take(tmp_path, dict(os.environ))
            assert twin.returncode != 0 and f"pid {first.pid}" in twin.stderr and "node try1" in twin.stderr, twin
        finally:
            first.kill()
            first.wait()
        assert _take(tmp_path, dict(os.environ)).returncode == 0  # the first one gone, the next child gets in


def test_node_token_file_is_private_and_revoked_after_its_round(tmp_path):
    """Node flows get the token through a 0600 file made per round; a node of a finished round is refused."""
    from infra.locks import adopt_token_file, hand_down_file

    with run_lock(tmp_path, owner="flow"):
        with hand_down_file(tmp_path) as path:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            value = path.read_text()
            node = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    (
                        "import sys; from infra.locks import adopt_token_file, run_lock\n"
                        "adopt_token_file(sys.argv[2])\n" + TAKE.split("\n", 1)[1]
                    ),
                    str(tmp_path),
                    str(path),
                ],
                capture_output=True,
                text=True,
                env=_env(),
            )
            assert node.returncode == 0 and node.stdout.strip() == "ok", node.stderr
        assert not path.exists()
        late = _take(tmp_path, _env(EAGLE3_RUN_LOCK_TOKEN=value))  # a node of that round starting late
        assert late.returncode != 0 and "locked by pid" in late.stderr
    with pytest.raises(FileNotFoundError):
        adopt_token_file(path)


def test_a_stranger_without_a_token_is_refused_in_process(tmp_path, monkeypatch):
    """The refusal also holds in-process: a token for another run directory opens nothing here."""
    other = tmp_path / "other"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "run"), "flow"], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with run_lock(other), pytest.raises(LockHeldError, match="locked by pid"), run_lock(tmp_path / "run"):
            pass
    finally:
        holder.kill()
        holder.wait()
