"""Locks that the kernel releases when their holder dies: ``flock`` on a file that is never unlinked.

``run_lock`` gives one writer a run directory. Holding is the ``flock`` on ``<run>/.lock``, not the
file's existence, so there is no stale lock to clear: a killed holder's lock is released by the kernel,
and two processes racing for a lock left by a dead one cannot both get it (the old read-holder, unlink,
create sequence was not atomic). The file also carries the holder's record (pid, host, owner) for the
error message of a second writer; an empty or partial record (being written, or left by a crash)
never blocks anyone, since only the ``flock`` counts.

The holder's children (torchrun under a flow, node flows of a multi-node training) may write too, but only by
proving it: at acquisition the holder draws a random token, keeps it in memory and in its environment (which
its children inherit; /proc/<pid>/environ is readable by its owner alone), and writes only the token's sha256
into the world-readable record. The visible ``host:pid`` proves nothing. A child that presents the token takes
the next level's lock file (``.lock.1``, ``.lock.2`` ...) in turn, so two children of one holder (a node wrongly
marked Crashed beside its re-submitted twin) never write side by side, and hands a token of its own down.
Node flows of another process get theirs through ``hand_down_file``: a fresh token in a 0600 file, revoked when
the round that uses it ends.

``file_lock`` is the blocking form, for work that must happen once however many processes ask for it
(the GGUF conversion into the shared target cache).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCK_FILE = ".lock"
LOCK_TOKEN_ENV = "EAGLE3_RUN_LOCK_TOKEN"
"""``<level>:<secret token>``, set while a lock is held, so child processes (torchrun workers) prove they are the
holder's. Never a pid: the holder's id is public in the lock file."""
LOCK_HOLDER_ENV = LOCK_TOKEN_ENV
"""The former name, kept for importers."""
_PRIVATE_KEYS = ("token_sha256", "delegates")
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


def _read_record(lock: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(lock).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def read_holder(lock: Path) -> dict[str, Any]:
    """The run lock's holder record (pid, host, owner); {} when there is none or it is not (yet) whole JSON."""
    return {k: v for k, v in _read_record(lock).items() if k not in _PRIVATE_KEYS}


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _level_file(lock: Path, level: int) -> Path:
    return lock if level == 0 else lock.with_name(f"{lock.name}.{level}")


def _presented() -> tuple[int, str] | None:
    """The (level, token) this process was handed, or None."""
    level, _, token = os.environ.get(LOCK_TOKEN_ENV, "").partition(":")
    return (int(level), token) if level.isdigit() and len(token) >= 32 else None


def _vouched(lock: Path, level: int, token: str) -> bool:
    """``token`` is the live secret of the holder of ``lock``'s level ``level`` (or one it handed down)."""
    path = _level_file(lock, level)
    digest = _digest(token)
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:  # a holder rewriting its record (a hand-down starting or ending) leaves it briefly unreadable
        record = _read_record(path)
        if record or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    known = [record.get("token_sha256"), *(record.get("delegates") or [])]
    if not any(isinstance(k, str) and hmac.compare_digest(k, digest) for k in known):
        return False
    if level == 0:
        return True  # the caller found .lock held
    fd = _open_lock_file(path)
    try:
        return not _try_flock(fd)  # free: that holder is gone, its token with it
    finally:
        os.close(fd)


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
        return LockHeldError(
            f"run directory {run_dir} is locked by a process whose record in {lock} is empty or "
            "unreadable; wait for it to finish"
        )
    return LockHeldError(
        f"run directory {run_dir} is locked by pid {holder.get('pid')} on host {holder.get('host')}"
        f" ({holder.get('owner') or 'unknown owner'}); wait for it to finish or stop it (the lock "
        "goes with the process, so nothing needs removing)"
    )


@dataclass
class _Held:
    pid: int
    fd: int
    level: int
    record: dict[str, Any]


def _write_record(fd: int, record: dict[str, Any]) -> None:
    """Replace the record in place, never leaving it empty or cut (padding, then trimming, a shorter one)."""
    data = json.dumps(record).encode("utf-8")
    old = os.fstat(fd).st_size
    os.pwrite(fd, data + b" " * max(0, old - len(data)), 0)
    os.ftruncate(fd, len(data))


@contextlib.contextmanager
def _holding(key: str, fd: int, lock: Path, level: int, owner: str) -> Iterator[Path]:
    """We hold the flock on ``fd`` (level ``level``): write our record, hand a fresh token to children, empty the
    record on the way out."""
    token = secrets.token_urlsafe(32)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "owner": owner, "token_sha256": _digest(token)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode("utf-8"), 0)
    previous = os.environ.get(LOCK_TOKEN_ENV)
    os.environ[LOCK_TOKEN_ENV] = f"{level}:{token}"
    _HELD[key] = _Held(os.getpid(), fd, level, me)
    try:
        yield lock
    finally:
        _HELD.pop(key, None)
        if previous is None:
            os.environ.pop(LOCK_TOKEN_ENV, None)
        else:
            os.environ[LOCK_TOKEN_ENV] = previous
        os.ftruncate(fd, 0)  # still under the flock: nobody reads our record after we are gone


_HELD: dict[str, _Held] = {}
"""Run locks this process holds (realpath of .lock -> pid, descriptor, level and record; the pid so a forked
child does not inherit the claim). Re-entry looks here rather than taking the flock on a second descriptor:
where flock is emulated with POSIX locks (NFS), closing any descriptor of the file would drop the lock."""


@contextlib.contextmanager
def _delegated(key: str, run_dir: Path, lock: Path, level: int, owner: str) -> Iterator[Path]:
    """A child of the holder (token checked) takes level ``level``: refused while another child holds it."""
    path = _level_file(lock, level)
    fd = _open_lock_file(path)
    try:
        if not _try_flock(fd):
            other = _holder_of_held_lock(fd, path)
            if other is not None:
                raise LockHeldError(
                    f"run directory {run_dir} is already written by pid {other.get('pid')} on host "
                    f"{other.get('host')} ({other.get('owner') or 'unknown owner'}), another process of the same "
                    f"holder (a node still running beside its re-submitted twin, say); stop it first"
                )
        with _holding(key, fd, path, level, owner):
            yield lock
    finally:
        os.close(fd)


@contextlib.contextmanager
def hand_down_file(run_dir: Path | str) -> Iterator[Path | None]:
    """A fresh token for processes that are not our children (node flows on other hosts), in a 0600 file in
    ``run_dir`` (every node sees it); valid, and the file there, only inside this block. None when this process
    does not hold the run lock (nothing to hand down)."""
    lock = Path(run_dir) / LOCK_FILE
    held = _HELD.get(os.path.realpath(lock))
    if held is None or held.pid != os.getpid():
        yield None
        return
    token = secrets.token_urlsafe(32)
    path = Path(run_dir) / f"{LOCK_FILE}.token-{secrets.token_hex(4)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, f"{held.level}:{token}".encode("ascii"))
    finally:
        os.close(fd)
    digest = _digest(token)
    held.record.setdefault("delegates", []).append(digest)
    _write_record(held.fd, held.record)
    try:
        yield path
    finally:
        held.record["delegates"].remove(digest)
        if not held.record["delegates"]:
            del held.record["delegates"]
        _write_record(held.fd, held.record)
        path.unlink(missing_ok=True)


def adopt_token_file(path: Path | str) -> None:
    """Take the token of ``hand_down_file`` (a node flow), so this process and its children count as the holder's.
    FileNotFoundError once that round is over."""
    os.environ[LOCK_TOKEN_ENV] = Path(path).read_text().strip()


@contextlib.contextmanager
def run_lock(run_dir: Path | str, owner: str = "") -> Iterator[Path]:
    """Hold ``<run_dir>/.lock`` while writing; a second writer fails at once with a message naming the holder.

    Re-entrant for the same process, and open to its children that present its secret token (inherited through
    EAGLE3_RUN_LOCK_TOKEN), one child at a time, so a flow that holds the lock can run torchrun underneath it.
    """
    lock = Path(run_dir) / LOCK_FILE
    lock.parent.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(lock)
    held = _HELD.get(key)
    if held is not None and held.pid == os.getpid():
        yield lock
        return
    fd = _open_lock_file(lock)
    try:
        holder = None if _try_flock(fd) else _holder_of_held_lock(fd, lock)
        if holder is None:
            with _holding(key, fd, lock, 0, owner) as path:
                yield path
            return
        presented = _presented()
        if presented is None or not _vouched(lock, *presented):
            raise _refusal(Path(run_dir), lock, {k: v for k, v in holder.items() if k not in _PRIVATE_KEYS})
        with _delegated(key, Path(run_dir), lock, presented[0] + 1, owner) as path:
            yield path
    finally:
        os.close(fd)
