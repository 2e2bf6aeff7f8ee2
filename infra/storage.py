"""Files that are either complete or absent: atomic writes, content hashes, disk preflight, run locks.

Every output of the pipeline goes through ``atomic_write*`` (temp file in the same directory,
fsync, rename, fsync of the directory), so a crash leaves the previous version or nothing,
never half a file that a later stage could mistake for a complete one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from infra.process import pid_alive

CHUNK_BYTES = 8 << 20


def umask_mode() -> int:
    """Permissions a new file gets under the process umask (0o666 & ~umask)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: Path | str, mode: str = "wb") -> Iterator[BinaryIO]:
    """Open a temp file beside ``path``; on clean exit fsync and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, umask_mode())  # mkstemp creates 0600; outputs get the usual permissions
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path | str, data: bytes) -> Path:
    """Write bytes atomically; returns the path."""
    with atomic_open(path, "wb") as fh:
        fh.write(data)
    return Path(path)


def atomic_write_text(path: Path | str, text: str) -> Path:
    """Write UTF-8 text atomically; returns the path."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path | str, obj: Any) -> Path:
    """Write JSON (indented, sorted keys, trailing newline) atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def temp_path_for(path: Path | str) -> Path:
    """A unique temp name beside ``path`` for writers that need a file name (pyarrow, safetensors)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, umask_mode())
    os.close(fd)
    return Path(tmp)


def commit_temp(tmp: Path, path: Path | str) -> Path:
    """fsync ``tmp`` and rename it over ``path`` (the second half of ``temp_path_for``)."""
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)
    return Path(path)


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temp path to write to; it replaces ``path`` only if the block exits cleanly."""
    tmp = temp_path_for(path)
    try:
        yield tmp
        commit_temp(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def seal_dir(tmp: Path | str) -> None:
    """Make a folder of finished files durable and readable: each file gets the umask's usual mode (some writers
    create 0600 files; a server running as another user must read them) and is fsynced, then the folder."""
    mode = umask_mode()
    for path in Path(tmp).iterdir():
        os.chmod(path, mode)
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(Path(tmp))


def publish_dir(tmp: Path | str, final: Path | str) -> Path:
    """Rename a finished (fsynced) temp folder to ``final``; an older ``final`` is moved aside first and
    deleted only once the new one has its name, so a crash leaves one whole folder under that name."""
    tmp, final = Path(tmp), Path(final)
    trash = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(tmp, final)
    shutil.rmtree(trash, ignore_errors=True)
    fsync_dir(final.parent)
    return final


def sha256_file(path: Path | str) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of a canonical JSON rendering (sorted keys, no spaces)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_text(text: str) -> str:
    """Hex sha256 of a UTF-8 string."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class DiskSpaceError(RuntimeError):
    """Not enough free space for a planned write."""


def check_free_space(path: Path | str, need_bytes: int, margin_bytes: int = 1 << 30) -> int:
    """Raise DiskSpaceError unless ``need_bytes + margin_bytes`` fit under ``path``; returns free bytes."""
    probe = Path(path)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free - margin_bytes < need_bytes:
        raise DiskSpaceError(
            f"not enough disk space under {path}: need {need_bytes:,} bytes plus a margin of "
            f"{margin_bytes:,}, but only {free:,} are free"
        )
    return free


class LockHeldError(RuntimeError):
    """Another writer holds the run directory."""


def read_holder(lock: Path) -> dict[str, Any]:
    """The run lock's holder record (pid, host, owner); {} when there is none."""
    try:
        return json.loads(lock.read_text())
    except (OSError, ValueError):
        return {}


def _is_stale(holder: dict[str, Any]) -> bool:
    """A holder on this host whose process is gone left a stale lock; other hosts are trusted."""
    return holder.get("host") == socket.gethostname() and not pid_alive(int(holder.get("pid", -1)))


LOCK_HOLDER_ENV = "EAGLE3_RUN_LOCK_HOLDER"
"""Set while a lock is held, so child processes (torchrun workers, stage subprocesses) count as its holder."""


def _holder_id(holder: dict[str, Any]) -> str:
    return f"{holder.get('host')}:{holder.get('pid')}"


def _held_by_us(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    """Our own process, or an ancestor that handed the lock down through the environment."""
    same_process = holder.get("pid") == me["pid"] and holder.get("host") == me["host"]
    return same_process or (bool(holder) and os.environ.get(LOCK_HOLDER_ENV) == _holder_id(holder))


@contextlib.contextmanager
def run_lock(run_dir: Path | str, owner: str = "") -> Iterator[Path]:
    """Hold ``<run_dir>/.lock`` while writing; a second writer fails with a message naming the holder.

    Re-entrant for the same process and for its children (through EAGLE3_RUN_LOCK_HOLDER), so a
    flow that holds the lock can run stages and torchrun underneath it without deadlocking.
    """
    lock = Path(run_dir) / ".lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "owner": owner}
    holder = read_holder(lock) if lock.exists() else {}
    if _held_by_us(holder, me):
        yield lock
        return
    if holder and _is_stale(holder):
        lock.unlink(missing_ok=True)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        holder = read_holder(lock)
        raise LockHeldError(
            f"run directory {run_dir} is locked by pid {holder.get('pid')} on host {holder.get('host')}"
            f" ({holder.get('owner') or 'unknown owner'}); remove {lock} only if that process is gone"
        ) from None
    with os.fdopen(fd, "w") as fh:
        json.dump(me, fh)
    previous = os.environ.get(LOCK_HOLDER_ENV)
    os.environ[LOCK_HOLDER_ENV] = _holder_id(me)
    try:
        yield lock
    finally:
        if previous is None:
            os.environ.pop(LOCK_HOLDER_ENV, None)
        else:
            os.environ[LOCK_HOLDER_ENV] = previous
        lock.unlink(missing_ok=True)
