"""benchmarks/curve_journals.py: a data run's generation journals survive the trip to another host byte for byte,
in parts of bounded size; a missing part or an empty run is an error that names the folder."""

from __future__ import annotations

import os

import pytest

from benchmarks import curve_journals


def _journals(run_dir):
    """A regeneration journal and two synthesis journals of incompressible bytes (several parts when packed)."""
    files = {"data/regenerate.journal.jsonl": os.urandom(300_000),
             "data/synthetic/journal.jsonl": b'{"seed": 0, "text": "hello"}\n' * 500,
             "data/synthetic/sub/part.jsonl": os.urandom(50_000)}
    for rel, data in files.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_bytes(data)
    return files


def test_pack_then_unpack_restores_every_journal_byte_for_byte(tmp_path):
    """Packed in 0.1 MiB parts and unpacked into an empty run, every journal file is identical; other files of the
    run are not carried."""
    files = _journals(tmp_path / "here")
    (tmp_path / "here" / "data" / "merged.parquet").write_bytes(b"not a journal")
    parts = curve_journals.pack(tmp_path / "here", tmp_path / "carry", part_mib=0.1)
    assert len(parts) >= 3 and all(p.stat().st_size <= int(0.1 * (1 << 20)) for p in parts)
    names = curve_journals.unpack(tmp_path / "there", tmp_path / "carry")
    for rel, data in files.items():
        assert (tmp_path / "there" / rel).read_bytes() == data
    assert "data/regenerate.journal.jsonl" in names
    assert not (tmp_path / "there" / "data" / "merged.parquet").exists()


def test_a_missing_part_or_no_journal_is_an_error_naming_the_folder(tmp_path):
    """Without its middle part the archive does not unpack (the error names the folder and its parts), and packing
    a run with no journal says so."""
    _journals(tmp_path / "here")
    parts = curve_journals.pack(tmp_path / "here", tmp_path / "carry", part_mib=0.1)
    parts[1].unlink()
    with pytest.raises(SystemExit, match="do not form a whole archive"):
        curve_journals.unpack(tmp_path / "there", tmp_path / "carry")
    with pytest.raises(SystemExit, match="no journals.tar.xz"):
        curve_journals.unpack(tmp_path / "there", tmp_path / "nothing")
    with pytest.raises(SystemExit, match="no generation journal"):
        curve_journals.pack(tmp_path / "empty", tmp_path / "out")
