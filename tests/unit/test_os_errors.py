"""OS errors of a stage command are one line naming the path and exit 2, never a traceback (issue 39, item 14).

Disk full (merge, capture), a read-only or foreign-owned run directory, a name longer than the file system allows
in bytes, and a preset whose YAML anchor refers to itself. Work done before the error is kept, and a rerun
completes it with the same result as an uninterrupted run.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from eagle3.config import ConfigError, load_config
from infra.storage import sha256_file
from tests.unit.test_hf_capture import tiny_base, tiny_run  # noqa: F401  (module fixture + helper)


def _fail_fsync(monkeypatch, when, code=errno.ENOSPC) -> list[str]:
    """os.fsync raises OSError(code) (no file name, as a write through a descriptor does) for files ``when`` picks."""
    real, hits = os.fsync, []

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if when(target):
            hits.append(target)
            raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return hits


def _one_line_exit_2(capsys, call) -> str:
    with pytest.raises(SystemExit) as exit_:
        call()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]  # progress lines may come before it
    assert exit_.value.code == 2 and errors == lines[-1:] and "Traceback" not in err, err[-3000:]
    return errors[0]


def _merge(workdir: Path, *extra: str) -> None:
    from eagle3.run.stages import main

    main(["merge", "--preset", "tiny", "--set", f"run.workdir={workdir}", *extra])


def _data_hashes(run_dir: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted((run_dir / "data").glob("merged*.parquet"))}


def test_disk_full_during_merge_is_one_line_and_a_rerun_completes(tmp_path, monkeypatch, capsys):
    """ENOSPC while the merged data is written: one line naming the run directory, no manifest, no temp file left;
    the rerun gives the bytes of a clean merge."""
    hits = _fail_fsync(monkeypatch, lambda target: f"{os.sep}data{os.sep}" in target)
    line = _one_line_exit_2(capsys, lambda: _merge(tmp_path / "full"))
    assert hits and "No space left on device" in line and str(tmp_path / "full" / "tiny") in line, line
    data = tmp_path / "full" / "tiny" / "data"
    assert not (data / "merge.manifest.json").exists() and not list(data.glob(".*.tmp"))
    monkeypatch.undo()
    _merge(tmp_path / "full")
    _merge(tmp_path / "clean")
    assert (data / "merge.manifest.json").is_file()
    assert _data_hashes(data.parent) == _data_hashes(tmp_path / "clean" / "tiny") != {}


def test_disk_full_during_capture_is_one_line_and_resume_is_complete(
    tiny_base,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    """ENOSPC on the third shard: one line, exit 2; the shards already committed stay, the rerun completes them."""
    from eagle3.features.capture import features_dir, main, run_capture
    from eagle3.features.shards.reader import ShardReader

    cfg = tiny_run(tiny_base, tmp_path, "capture.tokens_per_shard=2000")
    hits = _fail_fsync(monkeypatch, lambda target: "shard-00002" in target)
    line = _one_line_exit_2(
        capsys,
        lambda: main(
            [
                "--preset",
                "tiny",
                "--set",
                f"run.workdir={tmp_path}",
                "--set",
                f"target.cache_dir={tiny_base / '_targets'}",
                "--set",
                "capture.tokens_per_shard=2000",
            ]
        ),
    )
    assert hits and "No space left on device" in line and str(cfg.run_dir) in line, line
    fdir = features_dir(cfg)
    assert not (fdir / "capture.manifest.json").exists() and sorted(ShardReader(fdir).shards) == [0, 1]
    monkeypatch.undo()
    assert run_capture(cfg).computed
    reader = ShardReader(fdir)
    assert len(reader.shards) > 2 and all(reader.verify(i) for i in reader.shards)
    assert not list(fdir.glob(".*.tmp"))


@pytest.mark.parametrize(
    "code, words",
    [
        (errno.EROFS, "Read-only file system"),
        (errno.EACCES, "owned by uid 4242"),
        (errno.EPERM, "Operation not permitted"),
    ],
)
def test_a_read_only_or_foreign_run_directory_is_one_line(tmp_path, monkeypatch, capsys, code, words):
    """Opening anything in the run directory fails (read-only mount, another user's folder): one line naming it."""
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    os.chown(run_dir, 4242, 4242)  # as root: a folder of another user (the refusal itself is simulated below)
    real = os.open

    def refuse(path, *a, **kw):
        if str(path).startswith(str(run_dir)):
            raise (PermissionError if code != errno.EROFS else OSError)(code, os.strerror(code), str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "open", refuse)
    line = _one_line_exit_2(capsys, lambda: _merge(tmp_path))
    assert words in line and str(run_dir) in line, line


def test_a_name_longer_than_the_file_system_allows_in_bytes_is_one_line(tmp_path, capsys):
    """100 four-byte characters are 400 bytes: a config error naming the field and its byte count, exit 2."""
    with pytest.raises(SystemExit) as exit_:
        _merge(tmp_path, "--set", "run.name=" + "\U0001f600" * 100)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err[-3000:]
    assert "run.name: Value error, must be 1 to 100 bytes in UTF-8 (got 400)" in err, err[-3000:]


def test_a_self_referencing_yaml_anchor_in_a_preset_and_its_base_is_a_config_error(tmp_path, capsys):
    """An anchor whose node contains its own alias (in both the preset and its base) names the file, no
    RecursionError."""
    base = tmp_path / "base.yaml"
    base.write_text("run: &r\n  name: x\n  self: *r\n")
    preset = tmp_path / "preset.yaml"
    preset.write_text(f"base: {base}\nrun: &r\n  name: y\n  self: *r\n")
    with pytest.raises(ConfigError, match=r"preset\.yaml: .*refers to itself.*run\.self"):
        load_config(str(preset))
    line = _one_line_exit_2(capsys, lambda: _merge(tmp_path, "--preset", str(preset)))
    assert "preset.yaml" in line and "refers to itself" in line, line
    with pytest.raises(ConfigError, match=r"base\.yaml: .*refers to itself"):
        load_config(str(base))
    listed = tmp_path / "list.yaml"
    listed.write_text("data:\n  sources: &s\n    - *s\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: .*refers to itself.*data\.sources\.0"):
        load_config(str(listed))
