"""lab/curve_assets.py: the curve's files travel to a bare host in bundles and assemble there sha256-checked."""

from __future__ import annotations

import json

import pytest

from lab import curve_assets


def test_assets_travel_in_bundles_and_assemble_checked(tmp_path):
    """Files cut over several bundles come back byte-identical (text via xz); a damaged chunk is an error."""
    blob, text = tmp_path / "w.gguf", tmp_path / "d.json"
    blob.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    text.write_text(json.dumps([{"x": "hello " * 50}] * 30))
    bundles = curve_assets.pack({"pkg_a/w.gguf": blob, "pkg_b/data/d.json": text}, tmp_path / "out", limit=4096)
    assert len(bundles) >= 3 and all(
        sum(f.stat().st_size for f in b.iterdir() if f.name != "assets.json") <= 4096 for b in bundles
    )
    site, stage = tmp_path / "site", tmp_path / "stage"
    missing = []
    for bundle in bundles:
        missing = curve_assets.unpack(bundle, stage, site)
    assert missing == []
    assert (site / "pkg_a/w.gguf").read_bytes() == blob.read_bytes()
    assert (site / "pkg_b/data/d.json").read_bytes() == text.read_bytes()
    (site / "pkg_a/w.gguf").unlink()
    damaged = next(p for p in stage.iterdir() if not p.name.endswith(".joined"))
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    with pytest.raises(ValueError, match="sha256"):
        for bundle in bundles:
            curve_assets.unpack(bundle, stage, site)
