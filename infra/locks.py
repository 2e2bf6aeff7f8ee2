"""Locks that the kernel releases when their holder dies: ``flock`` on a file that is never unlinked.

``run_lock`` gives one writer a run directory. Holding is the ``flock`` on ``<run>/.lock``, not the
file's existence, so there is no stale lock to clear: a killed holder's lock is released by the kernel,
and two processes racing for a lock left by a dead one cannot both get it (the old read-holder, unlink,
create sequence was not atomic). The file also carries the holder's record (pid, host, owner) for the
error message of a second writer; an empty or partial record (being written, or left by a crash)
never blocks anyone, since only the ``flock`` counts.

``file_lock`` is the blocking form, for work that must happen once however many processes ask for it
(the GGUF conversion into the shared target cache).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LOCK_FILE = ".lock"
LOCK_HOLDER_ENV = "EAGLE3_RUN_LOCK_HOLDER"
"""Set while a lock is held, so child processes (torchrun workers, stage subprocesses) count as its holder."""
RECORD_WAIT_S = 1.0
"""How long a refused writer waits for a holder record that is empty or partial (being written) to be readable."""


class LockHeldError(RuntimeError):
    """Another writer holds the run directory."""


def _open_lock_file(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _try_flock(fd: int) -> bool:
    """Take the exclusive flock without waiting; False when another open file holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


@contextlib.contextmanager
def file_lock(path: Path | str) -> Iterator[Path]:
    """Hold an exclusive flock on ``path`` (created if needed, never removed), waiting for it if another holds it."""
    path = Path(path)
    fd = _open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        os.close(fd)  # closing the last descriptor releases the flock


def read_holder(lock: Path) -> dict[str, Any]:
    """The run lock's holder record (pid, host, owner); {} when there is none or it is not (yet) whole JSON."""
    try:
        doc = json.loads(Path(lock).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _holder_id(holder: dict[str, Any]) -> str:
    return f"{holder.get('host')}:{holder.get('pid')}"


def _handed_down(holder: dict[str, Any]) -> bool:
    """An ancestor holds the lock and handed it down through the environment (torchrun under a flow)."""
    return bool(holder) and os.environ.get(LOCK_HOLDER_ENV) == _holder_id(holder)


def _holder_of_held_lock(fd: int, lock: Path) -> dict[str, Any] | None:
    """The record of the process that holds the flock, or None when the flock turned out to be free (now ours).

    A holder writes its record just after taking the flock, and empties it just before releasing it, so
    an unreadable record means "being written" or "just released": wait a little, trying the flock again.
    """
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        holder = read_holder(lock)
        if holder or time.monotonic() > deadline:
            return holder
        time.sleep(0.01)
        if _try_flock(fd):
            return None


def _refusal(run_dir: Path, lock: Path, holder: dict[str, Any]) -> LockHeldError:
    if not holder:
        return LockHeldError(f"run directory {run_dir} is locked by a process whose record in {lock} is empty or "
                             "unreadable; wait for it to finish")
    return LockHeldError(f"run directory {run_dir} is locked by pid {holder.get('pid')} on host {holder.get('host')}"
                         f" ({holder.get('owner') or 'unknown owner'}); wait for it to finish or stop it (the lock "
                         "goes with the process, so nothing needs removing)")


@contextlib.contextmanager
def _holding(fd: int, lock: Path, me: dict[str, Any]) -> Iterator[Path]:
    """We hold the flock on ``fd``: write our record, hand the lock to children, empty the record on the way out."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode("utf-8"), 0)
    previous = os.environ.get(LOCK_HOLDER_ENV)
    os.environ[LOCK_HOLDER_ENV] = _holder_id(me)
    try:
        yield lock
    finally:
        if previous is None:
            os.environ.pop(LOCK_HOLDER_ENV, None)
        else:
            os.environ[LOCK_HOLDER_ENV] = previous
        os.ftruncate(fd, 0)  # still under the flock: nobody reads our record after we are gone


_HELD: dict[str, int] = {}
"""Lock files this process holds (path -> pid, so a forked child does not inherit the claim). Re-entry looks here
rather than taking the flock on a second descriptor: where flock is emulated with POSIX locks (NFS), closing
any descriptor of the file would drop the lock."""


@contextlib.contextmanager
def run_lock(run_dir: Path | str, owner: str = "") -> Iterator[Path]:
    """Hold ``<run_dir>/.lock`` while writing; a second writer fails at once with a message naming the holder.

    Re-entrant for the same process and for its children (through EAGLE3_RUN_LOCK_HOLDER), so a
    flow that holds the lock can run stages and torchrun underneath it without deadlocking.
    """
    lock = Path(run_dir) / LOCK_FILE
    me = {"pid": os.getpid(), "host": socket.gethostname(), "owner": owner}
    lock.parent.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(lock)
    if _HELD.get(key) == os.getpid():
        yield lock
        return
    fd = _open_lock_file(lock)
    try:
        holder = None if _try_flock(fd) else _holder_of_held_lock(fd, lock)
        if holder is not None:
            if not _handed_down(holder):
                raise _refusal(Path(run_dir), lock, holder)
            yield lock
            return
        _HELD[key] = os.getpid()
        try:
            with _holding(fd, lock, me) as path:
                yield path
        finally:
            _HELD.pop(key, None)
    finally:
        os.close(fd)
