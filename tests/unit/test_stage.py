"""eagle3.run.stage: manifests written last, keys from inputs, skipping only what is really complete."""

from __future__ import annotations

import json

import pytest

from eagle3.run.stage import manifest_matches, run_stage, stage_key


def _writer(tmp_path, calls: list[int], payload: bytes = b"rows"):
    def compute():
        calls.append(1)
        out = tmp_path / "out.bin"
        out.write_bytes(payload)
        return {"out": out}, {"num_rows": 1}

    return compute


def test_second_call_with_same_key_skips(tmp_path):
    """A matching manifest makes the stage a no-op that reports computed=False and the old stats."""
    calls: list[int] = []
    manifest = tmp_path / "merge.manifest.json"
    first = run_stage("merge", manifest, "k1", _writer(tmp_path, calls))
    second = run_stage("merge", manifest, "k1", _writer(tmp_path, calls))
    assert (first.computed, second.computed, len(calls)) == (True, False, 1)
    assert second.stats == {"num_rows": 1}


def test_changed_key_or_missing_output_recomputes(tmp_path):
    """A new key, or an output that vanished or changed size, runs the stage again."""
    calls: list[int] = []
    manifest = tmp_path / "merge.manifest.json"
    run_stage("merge", manifest, "k1", _writer(tmp_path, calls))
    run_stage("merge", manifest, "k2", _writer(tmp_path, calls))
    (tmp_path / "out.bin").write_bytes(b"truncated-or-longer")
    assert not manifest_matches(manifest, "k2")
    run_stage("merge", manifest, "k2", _writer(tmp_path, calls))
    (tmp_path / "out.bin").unlink()
    run_stage("merge", manifest, "k2", _writer(tmp_path, calls))
    assert len(calls) == 4


def test_failed_compute_leaves_no_manifest(tmp_path):
    """A stage that dies half-way has no manifest, so the next call computes again."""
    manifest = tmp_path / "tokenize.manifest.json"
    run_stage("tokenize", manifest, "k", _writer(tmp_path, []))

    def boom():
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_stage("tokenize", manifest, "k2", boom)
    assert not manifest.exists()


def test_manifest_records_size_and_sha256(tmp_path):
    """The manifest names each output with its relative path, byte count and sha256."""
    manifest = tmp_path / "vocab.manifest.json"
    run_stage("vocab", manifest, "k", _writer(tmp_path, [], b"abc"))
    entry = json.loads(manifest.read_text())["outputs"]["out"]
    assert entry == {
        "path": "out.bin",
        "bytes": 3,
        "sha256": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
    }


def test_key_depends_on_config_inputs_and_version(tmp_path):
    """The key changes with the config section and with the upstream manifest, nothing else."""
    manifest = tmp_path / "merge.manifest.json"
    run_stage("merge", manifest, "k1", _writer(tmp_path, []))
    base = stage_key("tokenize", {"max_len": 8}, [manifest])
    assert base == stage_key("tokenize", {"max_len": 8}, [manifest])
    assert base != stage_key("tokenize", {"max_len": 9}, [manifest])
    run_stage("merge", manifest, "k2", _writer(tmp_path, [], b"other rows"))
    assert base != stage_key("tokenize", {"max_len": 8}, [manifest])


def test_missing_upstream_is_a_clear_error(tmp_path):
    """Keying a stage whose input stage never completed names the missing stage."""
    from eagle3.run.stage import MissingInputError

    with pytest.raises(MissingInputError, match="needs merge to be complete first"):
        stage_key("tokenize", {}, [tmp_path / "merge.manifest.json"])
