"""The run lock under races and crash leftovers: exactly one holder, never blocked by an empty or partial record."""

from __future__ import annotations

import fcntl
import os
import socket

import pytest

from infra.storage import LockHeldError, read_holder, run_lock
from tests.unit.lock_race import STALE_KINDS, make_stale, race


def test_four_processes_racing_for_a_stale_lock_get_exactly_one_holder_every_time(tmp_path):
    """Over 24 trials (each stale kind 6 times), 4 racers released at once: one holds, three are refused."""
    result = race(tmp_path, trials=6 * len(STALE_KINDS), racers=4)
    assert result.bad_trials == [], list(zip(result.holders, result.kinds))
    assert result.holders == [1] * 24


@pytest.mark.parametrize("content", ["", '{"pid": 12', "null", "[1, 2]"])
def test_empty_or_partial_lock_file_does_not_block(tmp_path, content):
    """A lock file whose record is empty, cut short or not an object (a crash while writing it) is free."""
    (tmp_path / ".lock").write_text(content)
    with run_lock(tmp_path, owner="me"):
        assert read_holder(tmp_path / ".lock")["owner"] == "me"


@pytest.mark.parametrize("kind", STALE_KINDS)
def test_every_kind_of_stale_lock_is_taken_over(tmp_path, kind):
    """Whatever a crashed writer left in the lock file, the next writer takes the lock."""
    make_stale(tmp_path, kind)
    with run_lock(tmp_path, owner="next"):
        assert read_holder(tmp_path / ".lock") == {"pid": os.getpid(), "host": socket.gethostname(), "owner": "next"}


def test_a_held_lock_with_an_unreadable_record_still_refuses(tmp_path, monkeypatch):
    """The flock, not the record, decides: a holder whose record is empty still keeps a second writer out."""
    monkeypatch.setattr("infra.locks.RECORD_WAIT_S", 0.05)
    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the open file of another writer that has not written its record
        with pytest.raises(LockHeldError, match="record .* is empty or unreadable"), run_lock(tmp_path):
            pass
    finally:
        os.close(fd)
    with run_lock(tmp_path):
        pass
