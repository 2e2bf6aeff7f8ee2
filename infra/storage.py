"""Files that are either complete or absent: atomic writes, content hashes, temp clean-up, disk preflight.

Every output of the pipeline goes through ``atomic_write*`` (temp file in the same directory,
fsync, rename, fsync of the directory), so a crash leaves the previous version or nothing,
never half a file that a later stage could mistake for a complete one. A writer killed mid-write leaves
its temp file; the next run of the same stage removes it (``remove_stale_temps``). The run lock lives in
infra/locks.py and is re-exported here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from infra.locks import LOCK_HOLDER_ENV, LockHeldError, read_holder, run_lock  # noqa: F401 (re-exported)

CHUNK_BYTES = 8 << 20
TEMP_SUFFIX = ".tmp"
"""Temp files are ``.<final name>.<random>.tmp`` beside the final file (``temp_name_re`` matches them)."""
RACY_NS = 1_000_000_000
"""A file modified less than this before it was hashed is not cached: a second write within one timestamp tick
could otherwise keep its stamp (git's "racily clean" problem)."""


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
def atomic_open(path: Path | str, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp file beside ``path``; on clean exit fsync and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
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


FileStamp = tuple[int, int, int, int, int]
_HASHES: dict[FileStamp, str] = {}
_HASHES_LOCK = threading.Lock()


def file_stamp(path: Path | str) -> FileStamp:
    """(device, inode, size, mtime_ns, ctime_ns): changes whenever the file's bytes can have changed."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def sha256_file_cached(path: Path | str) -> str:
    """sha256_file, computed once per process per version of the file (keyed by ``file_stamp``).

    A file changed less than RACY_NS before hashing is hashed again next time rather than cached, so a
    rewrite within one timestamp tick (same size, same mtime) is still seen.
    """
    stamp = file_stamp(path)
    with _HASHES_LOCK:
        cached = _HASHES.get(stamp)
    if cached is not None:
        return cached
    started_ns = time.time_ns()
    digest = sha256_file(path)
    settled = max(stamp[3], stamp[4]) < started_ns - RACY_NS
    if settled and file_stamp(path) == stamp:
        with _HASHES_LOCK:
            _HASHES[stamp] = digest
    return digest


def forget_hashes() -> None:
    """Drop the process's hash cache (what a new process starts with)."""
    with _HASHES_LOCK:
        _HASHES.clear()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of a canonical JSON rendering (sorted keys, no spaces)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_text(text: str) -> str:
    """Hex sha256 of a UTF-8 string."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def temp_name_re(name: str) -> re.Pattern[str]:
    """Names of the temp files that ``atomic_open``/``temp_path_for`` create for a final file called ``name``."""
    return re.compile(re.escape(f".{name}.") + r"[A-Za-z0-9_]+" + re.escape(TEMP_SUFFIX))


def remove_stale_temps(paths: Iterable[Path | str], older_than_ns: int | None = None) -> list[Path]:
    """Delete the temp files a killed writer of these final files left in their folders; returns what went.

    Only names of the form ``.<final name>.<random>.tmp`` beside each final path are touched, and with
    ``older_than_ns`` only those last modified before it (a writer still at work keeps touching its file).
    """
    removed: list[Path] = []
    for final in {Path(p) for p in paths}:
        pattern = temp_name_re(final.name)
        try:
            entries = list(os.scandir(final.parent))
        except FileNotFoundError:
            continue
        for entry in entries:
            if not pattern.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            if older_than_ns is not None and entry.stat(follow_symlinks=False).st_mtime_ns >= older_than_ns:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return sorted(removed)


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


def private_write_text(path: Path | str, text: str) -> Path:
    """Write a secret atomically as a 0600 file (mkstemp's mode, kept): only this user can read it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
