"""lab/curve_carry.py: a data run's generation journals and a curve's results survive the trip to another
host byte for byte, in parts of bounded size; a missing part or an empty run is an error that names the folder."""

from __future__ import annotations

import os

import pytest

from lab import curve_carry


def _journals(run_dir):
    """A regeneration journal and the journals of two synthetic sources, of incompressible bytes (several parts when
    packed), beside the sources' records files."""
    files = {
        "data/regenerate.journal.jsonl": os.urandom(300_000),
        "data/synthetic/magpie.journal.jsonl": b'{"seed": 0, "text": "hello"}\n' * 500,
        "data/synthetic/magpie-more.journal.jsonl": os.urandom(50_000),
    }
    for rel, data in files.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_bytes(data)
    for name in ("magpie", "magpie-more"):  # the records files the synthesize stage writes from the journals
        (run_dir / f"data/synthetic/{name}.jsonl").write_bytes(b'{"id": "0"}\n')
    return files


def test_pack_then_unpack_restores_every_journal_byte_for_byte(tmp_path):
    """Packed in 0.1 MiB parts and unpacked into an empty run, every journal file is identical, those of every
    synthetic source included; other files of the run, the synthetic records files among them, are not carried."""
    files = _journals(tmp_path / "here")
    (tmp_path / "here" / "data" / "merged.parquet").write_bytes(b"not a journal")
    parts = curve_carry.pack_journals(tmp_path / "here", tmp_path / "carry", part_mib=0.1)
    assert len(parts) >= 3 and all(p.stat().st_size <= int(0.1 * (1 << 20)) for p in parts)
    names = curve_carry.unpack_journals(tmp_path / "there", tmp_path / "carry")
    for rel, data in files.items():
        assert (tmp_path / "there" / rel).read_bytes() == data
    assert sorted(names) == sorted(files)
    assert not (tmp_path / "there" / "data" / "merged.parquet").exists()
    assert not (tmp_path / "there" / "data" / "synthetic" / "magpie.jsonl").exists()


def test_a_missing_part_or_no_journal_is_an_error_naming_the_folder(tmp_path):
    """Without its middle part the archive does not unpack (the error names the folder and its parts), and packing
    a run with no journal says so."""
    _journals(tmp_path / "here")
    parts = curve_carry.pack_journals(tmp_path / "here", tmp_path / "carry", part_mib=0.1)
    parts[1].unlink()
    with pytest.raises(SystemExit, match="do not form a whole archive"):
        curve_carry.unpack_journals(tmp_path / "there", tmp_path / "carry")
    with pytest.raises(SystemExit, match="no journals.tar.xz"):
        curve_carry.unpack_journals(tmp_path / "there", tmp_path / "nothing")
    with pytest.raises(SystemExit, match="no generation journal"):
        curve_carry.pack_journals(tmp_path / "empty", tmp_path / "out")


def _curve(runs):
    """A data run, a size run whose data/ is a link to it (as quality_curve.py makes them), and an unrelated run."""
    files = {
        "smollm2-curve/data/stats.json": b'{"kept": 3}',
        "smollm2-curve-3M/config.json": b"{}",
        "smollm2-curve-3M/eval/results.json": b'{"rows": []}',
        "smollm2-curve-3M/eval/prompts.jsonl": os.urandom(200_000),
        "smollm2-curve-3M/eval/evaluate.journal.jsonl": b'{"index": 0}\n',  # a cut-short evaluation's records
        "smollm2-curve-3M/export/sglang/README.md": b"# card",
        "smollm2-curve-3M/export/sglang/model.safetensors": os.urandom(100_000),
        "smollm2-curve-3M/train/checkpoints/step-1/state.pt": b"optimizer state",
        "other-run/eval/results.json": b"{}",
    }
    for rel, data in files.items():
        (runs / rel).parent.mkdir(parents=True, exist_ok=True)
        (runs / rel).write_bytes(data)
    (runs / "smollm2-curve-3M" / "data").symlink_to(runs / "smollm2-curve" / "data", target_is_directory=True)
    return files


@pytest.mark.parametrize("weights", [False, True])
def test_a_curves_results_come_back_byte_for_byte_without_checkpoints_links_or_other_runs(tmp_path, weights):
    """pack_results then unpack_results restores every result file of the data run and its sizes exactly; the
    drafter's weights only when asked; never checkpoints, a file reached through a size's data/ link, or a run
    of another name."""
    files = _curve(tmp_path / "here")
    parts = curve_carry.pack_results(tmp_path / "here" / "smollm2-curve", tmp_path / "carry", weights, part_mib=0.1)
    assert all(p.stat().st_size <= int(0.1 * (1 << 20)) for p in parts)
    names = set(curve_carry.unpack_results(tmp_path / "there", tmp_path / "carry"))
    weight = "smollm2-curve-3M/export/sglang/model.safetensors"
    carried = {rel for rel in files if "checkpoints" not in rel and not rel.startswith("other")}
    assert names == (carried if weights else carried - {weight})
    for rel in names:
        assert (tmp_path / "there" / rel).read_bytes() == files[rel]
    assert "smollm2-curve-3M/data/stats.json" not in names


def test_an_unpacked_sglang_only_drafter_passes_the_input_checks_of_the_stages_after_export(tmp_path):
    """unpack-results of a run with weights but no speculators layout moves that layout's manifest entries under
    left_behind (kept as recorded) and notes it, so the export manifest's outputs are all on disk; nothing is noted
    once that layout is there or when no weights came."""
    import json

    from eagle3.run.stage import output_problem

    _curve(tmp_path / "here")
    run = tmp_path / "here" / "smollm2-curve"
    manifest = tmp_path / "here" / "smollm2-curve-3M" / "export" / "export.manifest.json"
    sglang, speculators = (
        {"path": f"{d}/model.safetensors", "bytes": 1, "sha256": "x"} for d in ("sglang", "speculators")
    )
    manifest.write_text(json.dumps({"stage": "export", "outputs": {"sglang": sglang, "speculators": speculators}}))
    curve_carry.pack_results(run, tmp_path / "carry", weights=True)
    out = curve_carry.run("unpack-results", tmp_path / "there" / "smollm2-curve", tmp_path / "carry", False)
    there = tmp_path / "there" / "smollm2-curve-3M"
    assert out[-1].startswith("note: smollm2-curve-3M: the drafter came in the SGLang layout only") and (
        "speculators under left_behind" in out[-1]
    )
    doc = json.loads((there / "export" / "export.manifest.json").read_text())
    assert doc["outputs"] == {"sglang": sglang} and doc["left_behind"] == {"speculators": speculators}
    assert output_problem(doc, there / "export" / "export.manifest.json") == (
        f"{there / 'export/sglang/model.safetensors'} has 100000 bytes where export.manifest.json recorded 1"
    )  # the files that came are still checked
    (there / "export" / "speculators").mkdir()
    assert curve_carry.sglang_only_exports(tmp_path / "there", out[:-1]) == []
    curve_carry.pack_results(run, tmp_path / "carry", weights=False)
    assert not [
        n
        for n in curve_carry.run("unpack-results", tmp_path / "else" / "smollm2-curve", tmp_path / "carry", False)
        if n.startswith("note")
    ]


def test_repacking_into_the_same_folder_leaves_no_stale_part(tmp_path):
    """A second, smaller pack into the folder of a larger one unpacks to the second's files alone."""
    _curve(tmp_path / "here")
    run = tmp_path / "here" / "smollm2-curve"
    assert len(curve_carry.pack_results(run, tmp_path / "carry", weights=True, part_mib=0.05)) > 2
    (tmp_path / "here" / "smollm2-curve-3M" / "eval" / "prompts.jsonl").unlink()
    curve_carry.pack_results(run, tmp_path / "carry", weights=False, part_mib=0.05)
    names = curve_carry.unpack_results(tmp_path / "there", tmp_path / "carry")
    assert "smollm2-curve-3M/eval/prompts.jsonl" not in names and "smollm2-curve-3M/eval/results.json" in names
