"""infra.storage: atomic writes, hashes, free-space check, run lock."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time

import pytest

import infra.storage as storage
from infra.storage import (
    DiskSpaceError,
    LockHeldError,
    atomic_open,
    atomic_write_json,
    check_free_space,
    publish_dir,
    read_holder,
    remove_stale_temps,
    run_lock,
    sha256_file,
    sha256_file_cached,
    temp_path_for,
)


def test_atomic_write_leaves_old_content_when_the_writer_fails(tmp_path):
    """An exception inside the write keeps the previous file and leaves no temp file behind."""
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_open(target) as fh:
        fh.write(b"partial")
        raise RuntimeError("crash mid-write")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_atomic_write_is_invisible_until_complete_after_sigkill(tmp_path):
    """A process killed mid-write never leaves a file at the final path."""
    target = tmp_path / "x.json"
    code = (
        "import os,sys; from infra.storage import atomic_open\n"
        f"with atomic_open({str(target)!r}) as fh:\n    fh.write(b'{{'); fh.flush(); os.kill(os.getpid(), 9)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=False)
    assert not target.exists()


def test_sha256_file_matches_hashlib(tmp_path):
    """sha256_file agrees with hashlib on a multi-chunk file."""
    data = os.urandom(9 << 20)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_free_space_check_names_both_numbers(tmp_path):
    """Asking for more than the disk has raises with the needed and the free byte counts."""
    with pytest.raises(DiskSpaceError, match=r"need .* bytes .* only .* are free"):
        check_free_space(tmp_path, need_bytes=1 << 62)
    assert check_free_space(tmp_path, need_bytes=1, margin_bytes=0) > 0


def test_second_writer_is_refused_with_the_holder_named(tmp_path):
    """A lock held by another live process makes a second writer fail, naming pid and host."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys,time; from infra.storage import run_lock\n"
                f"with run_lock({str(tmp_path)!r}, owner='other'):\n    print('held', flush=True); time.sleep(30)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockHeldError, match=rf"pid {holder.pid} .*other"), run_lock(tmp_path):
            pass
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    """A lock left by a SIGKILLed writer does not block the next run; the lock file stays, its record emptied."""
    code = (
        f"import os; from infra.storage import run_lock\nwith run_lock({str(tmp_path)!r}):\n"
        "    os.kill(os.getpid(), 9)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=False)
    assert read_holder(tmp_path / ".lock")["pid"] != os.getpid()
    with run_lock(tmp_path, owner="next"):
        assert read_holder(tmp_path / ".lock") == {"pid": os.getpid(), "host": socket.gethostname(), "owner": "next"}
    assert (tmp_path / ".lock").read_text() == ""


def test_lock_is_reentrant_in_one_process(tmp_path):
    """Nested stages of one flow run can take the lock again."""
    with run_lock(tmp_path):
        with run_lock(tmp_path):
            pass
        assert (tmp_path / ".lock").exists()


def test_atomic_write_json_is_sorted_and_newline_terminated(tmp_path):
    """JSON outputs are canonical (sorted keys), so equal content gives equal bytes."""
    path = atomic_write_json(tmp_path / "a.json", {"b": 1, "a": 2})
    assert path.read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'


def test_child_process_of_the_holder_may_take_the_lock(tmp_path):
    """A subprocess started while the lock is held (torchrun under a flow) counts as the holder."""
    code = f"from infra.storage import run_lock\nwith run_lock({str(tmp_path)!r}):\n    print('ok')\n"
    with run_lock(tmp_path, owner="flow"):
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr
    stranger = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import time; from infra.storage import run_lock\n"
                f"with run_lock({str(tmp_path)!r}, owner='other'):\n    print('held', flush=True); time.sleep(30)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "EAGLE3_RUN_LOCK_HOLDER"},
    )
    try:
        assert stranger.stdout.readline().strip() == "held"
        refused = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert refused.returncode != 0 and "locked by pid" in refused.stderr
    finally:
        stranger.kill()
        stranger.wait()


def test_publish_dir_replaces_an_older_folder_whole(tmp_path):
    """The new folder takes the name with all its files; the old one is gone and no aside copy is left."""
    final, tmp = tmp_path / "step-5", tmp_path / ".step-5.tmp"
    final.mkdir()
    (final / "old.bin").write_bytes(b"old")
    tmp.mkdir()
    (tmp / "new.bin").write_bytes(b"new")
    assert publish_dir(tmp, final) == final
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]
    assert [p.name for p in final.iterdir()] == ["new.bin"] and (final / "new.bin").read_bytes() == b"new"


def test_cached_hash_is_computed_once_per_file_version(tmp_path, monkeypatch):
    """A settled file is hashed once per process; a same-size rewrite (new mtime/ctime) is hashed again."""
    calls: list[str] = []
    real = storage.sha256_file
    monkeypatch.setattr(storage, "sha256_file", lambda p: calls.append(str(p)) or real(p))
    path = tmp_path / "blob"
    path.write_bytes(b"a" * 1000)
    old = time.time() - 10
    os.utime(path, (old, old))
    time.sleep(1.1)  # the ctime set by utime must settle too (RACY_NS)
    first = sha256_file_cached(path)
    assert sha256_file_cached(path) == first == hashlib.sha256(b"a" * 1000).hexdigest() and len(calls) == 1
    with open(path, "r+b") as fh:
        fh.write(b"b")
    os.utime(path, (old, old))  # same size and same mtime: only the ctime tells
    assert sha256_file_cached(path) == hashlib.sha256(b"b" + b"a" * 999).hexdigest() and len(calls) == 2


def test_freshly_written_file_is_not_cached(tmp_path, monkeypatch):
    """A file changed within RACY_NS of its hashing is hashed again: a rewrite in the same tick keeps its stamp."""
    calls: list[str] = []
    real = storage.sha256_file
    monkeypatch.setattr(storage, "sha256_file", lambda p: calls.append(str(p)) or real(p))
    path = tmp_path / "fresh"
    path.write_bytes(b"x")
    sha256_file_cached(path)
    sha256_file_cached(path)
    assert len(calls) == 2


def test_stale_temps_of_a_killed_writer_are_removed_and_nothing_else(tmp_path):
    """Only ``.<name>.<random>.tmp`` files of the given finals go; other files, and a newer temp, stay."""
    final = tmp_path / "merged.parquet"
    code = (
        "import os; from infra.storage import atomic_open\n"
        f"with atomic_open({str(final)!r}) as fh:\n"
        "    fh.write(b'x' * 4096); fh.flush(); os.kill(os.getpid(), 9)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=False)
    killed = [p.name for p in tmp_path.iterdir()]
    assert len(killed) == 1 and killed[0].startswith(".merged.parquet.") and killed[0].endswith(".tmp")
    keep = [tmp_path / ".other.parquet.abc123.tmp", tmp_path / "merged.parquet.tmp", tmp_path / ".merged.parquet.old"]
    for path in keep:
        path.write_bytes(b"keep")
    cutoff = time.time_ns()
    newer = temp_path_for(final)  # a writer that started after the cutoff
    os.utime(newer, ns=(cutoff + 10**9, cutoff + 10**9))
    assert [p.name for p in remove_stale_temps([final], older_than_ns=cutoff)] == killed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(p.name for p in keep), newer.name])
