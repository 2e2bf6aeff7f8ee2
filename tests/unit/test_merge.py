"""The merge stage: nothing lost, counts add up, seeded split and shuffle, dedupe, caps, Parquet round trip."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3.config import DataConfig, SourceConfig
from eagle3.data import merge
from eagle3.data.merge import MERGED_SCHEMA, content_hash, merge_sources, read_merged, split_for
from eagle3.data.sources import Conversation, SourceError, read_source
from eagle3.run import stages

ASSETS = Path(__file__).resolve().parents[1] / "assets"
MIXED = ASSETS / "bad" / "mixed_openai.jsonl"
TINY = Path(merge.__file__).resolve().parents[1] / "assets" / "tiny_chats.jsonl"
TINY_SG = TINY.with_name("tiny_chats_sharegpt.json")


def src(path: Path, name: str = "src", cap: int | None = None) -> SourceConfig:
    return SourceConfig(name=name, path=str(path), max_records=cap)


def run(tmp_path: Path, sources: list[SourceConfig], seed: int = 0, **data) -> tuple[dict, dict]:
    cfg = DataConfig(**{"max_chars": 500, **data})
    return merge_sources(sources, cfg, seed, tmp_path / f"out-{seed}-{len(list(tmp_path.iterdir()))}")


def rejects_of(paths: dict) -> list[dict]:
    return [json.loads(line) for line in paths["rejects"].read_text(encoding="utf-8").splitlines()]


def test_split_is_a_function_of_seed_and_id_only():
    """Same seed -> same split for every id whatever the order; another seed moves some ids."""
    ids = [f"s:{n}" for n in range(500)]
    forward = {i: split_for(i, 3, 0.2) for i in ids}
    backward = {i: split_for(i, 3, 0.2) for i in reversed(ids)}
    assert forward == backward
    assert forward != {i: split_for(i, 4, 0.2) for i in ids}


def test_val_fraction_is_roughly_honoured():
    """On 1,000 ids the val share is near val_fraction; 0 puts everything in train."""
    ids = [f"src:{n}" for n in range(1000)]
    num_val = sum(split_for(i, 0, 0.1) == "val" for i in ids)
    assert 70 <= num_val <= 130
    assert all(split_for(i, 0, 0.0) == "train" for i in ids)


def test_content_hash_ignores_surrounding_whitespace_only():
    """Hashes match when contents differ by outer whitespace, and differ when a role or word changes."""
    base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    padded = [{"role": "user", "content": "  hi\n"}, {"role": "assistant", "content": "yo "}]
    assert content_hash(base) == content_hash(padded)
    assert content_hash(base) != content_hash([{"role": "system", "content": "hi"}, base[1]])
    assert content_hash(base) != content_hash([base[0], {"role": "assistant", "content": "y o"}])


def test_mixed_file_loses_nothing_and_every_reject_is_explained(tmp_path):
    """Valid lines all become rows; each invalid line is in rejects.jsonl with its reason and line; counts add up."""
    expected = {}
    for num, raw in enumerate(MIXED.read_bytes().splitlines(), 1):
        match = re.search(rb"expect\W+(\w+)", raw)
        if match:
            expected[f"mixed_openai.jsonl:{num}"] = match.group(1).decode()
    paths, stats = run(tmp_path, [src(MIXED)], shuffle=False)
    valid_ids = {c.id for c in read_source(src(MIXED), 500) if isinstance(c, Conversation)}
    rows = read_merged(paths["merged"])
    rejects = rejects_of(paths)
    assert {r["id"] for r in rows} == valid_ids - {"src:copy-of-ok-1"}
    assert {r["location"]: r["reason"] for r in rejects} == {k: v for k, v in expected.items() if v != "ok"}
    assert all(r["source"] == "src" and r["detail"] and r["record"] for r in rejects)
    total = stats["total"]
    assert total["read"] == len(expected) == total["kept"] + total["rejected"]
    assert total["kept"] == len(rows) == total["train"] + total["val"]
    assert total["rejected_by_reason"]["duplicate_id"] == 2 and stats["sources"]["src"] == {
        **stats["sources"]["src"],
        **total,
    }


def test_outputs_are_atomic_files_with_the_documented_schema(tmp_path):
    """merged.parquet has the documented schema and no temp files are left beside the outputs."""
    paths, _ = run(tmp_path, [src(TINY)])
    assert pq.read_schema(paths["merged"]).remove_metadata() == MERGED_SCHEMA
    assert sorted(p.name for p in paths["merged"].parent.iterdir()) == ["merged.parquet", "rejects.jsonl", "stats.json"]
    assert json.loads(paths["stats"].read_text()) is not None


def test_parquet_round_trip_keeps_rows_exactly(tmp_path):
    """read_merged returns the normalized messages the reader produced, with ids, source, split and hash."""
    paths, _ = run(tmp_path, [src(TINY, name="tiny")], shuffle=False, max_chars=200_000)
    convs = list(read_source(src(TINY, name="tiny"), 200_000))
    rows = read_merged(paths["merged"])
    assert [(r["id"], r["messages"]) for r in rows] == [(c.id, c.messages) for c in convs]
    assert all(r["source"] == "tiny" and r["content_hash"] == content_hash(r["messages"]) for r in rows)
    assert all(r["split"] == split_for(r["id"], 0, 0.05) for r in rows)


def test_dedupe_spans_sources_and_can_be_turned_off(tmp_path):
    """Content already kept from one source is rejected in the next (naming the first id); dedupe=False keeps it."""
    sources = [src(TINY, "a"), src(TINY_SG, "b")]
    paths, stats = run(tmp_path, sources, max_chars=200_000)
    assert stats["sources"]["b"]["rejected_by_reason"]["duplicate_content"] == 20
    first = rejects_of(paths)[0]
    assert first["reason"] == "duplicate_content" and first["detail"] == "same content as a:chat-0000"
    _, stats_off = run(tmp_path, sources, max_chars=200_000, dedupe=False)
    assert stats_off["total"]["kept"] == 80


def test_a_source_deduped_within_itself_keeps_others_content_and_its_split(tmp_path):
    """dedupe_scope=source: b keeps what a already has, rejects only its own repeats, and a repeat takes the split
    of the row that came first, so no conversation is in both train and val."""
    records = json.loads(TINY_SG.read_text(encoding="utf-8"))
    repeated = [*records, *({**r, "id": f"again-{r['id']}"} for r in records[:5])]
    doubled = tmp_path / "doubled.json"
    doubled.write_text(json.dumps(repeated), encoding="utf-8")
    b = SourceConfig(name="b", path=str(doubled), dedupe_scope="source")
    paths, stats = run(tmp_path, [src(TINY, "a"), b], max_chars=200_000, val_fraction=0.5)
    assert stats["sources"]["b"]["kept"] == 20 and stats["sources"]["b"]["rejected_by_reason"]["duplicate_content"] == 5
    assert rejects_of(paths)[0]["detail"].startswith("same content as b:")
    rows = read_merged(paths["merged"])
    by_hash: dict[str, set[str]] = {}
    for row in rows:
        by_hash.setdefault(row["content_hash"], set()).add(row["split"])
    shared = [h for h in by_hash if sum(r["content_hash"] == h for r in rows) == 2]
    assert len(shared) == 20 and all(len(by_hash[h]) == 1 for h in shared)
    # Without the shared split, half of those pairs would straddle train and val at val_fraction 0.5.
    assert sum(split_for(r["id"], 0, 0.5) != r["split"] for r in rows if r["source"] == "b") > 0


def test_caps_stop_reading_each_source(tmp_path):
    """A source with max_records=N gives N rows and is not read past its N-th kept record."""
    paths, stats = run(tmp_path, [src(TINY, "a", cap=7), src(MIXED, "m", cap=2)], max_chars=200_000)
    assert stats["sources"]["a"]["kept"] == 7 and stats["sources"]["a"]["read"] == 7
    items = list(read_source(src(MIXED, "m"), 200_000))
    second_valid = [n for n, item in enumerate(items, 1) if isinstance(item, Conversation)][1]
    assert stats["sources"]["m"]["kept"] == 2 and stats["sources"]["m"]["read"] == second_valid < len(items)
    assert stats["sources"]["m"]["stopped_at_cap"] and len(read_merged(paths["merged"])) == 9


def test_shuffle_is_seeded_and_deterministic(tmp_path):
    """Same seed -> same row order; another seed -> another order; shuffle off -> file order."""

    def order(seed: int, shuffle: bool = True) -> list[str]:
        paths, _ = run(tmp_path, [src(TINY)], seed=seed, shuffle=shuffle, max_chars=200_000)
        return [r["id"] for r in read_merged(paths["merged"])]

    assert order(1) == order(1)
    assert order(1) != order(2)
    assert order(1, shuffle=False) == [f"src:chat-{n:04d}" for n in range(60)]


def test_progress_reports_records_read(tmp_path):
    """The progress callback ends with done == number of records read."""
    calls = []
    cfg = DataConfig(max_chars=500)
    _, stats = merge_sources([src(MIXED)], cfg, 0, tmp_path / "p", lambda d, t, info: calls.append(d))
    assert calls and calls[-1] == stats["total"]["read"]


def test_rejects_jsonl_stays_valid_json_with_bad_bytes(tmp_path):
    """Records holding text that is not UTF-8 are written as parseable JSON lines (escaped, not dropped)."""
    paths, _ = run(tmp_path, [src(MIXED)])
    raw = paths["rejects"].read_bytes()
    raw.decode("utf-8")  # the file itself is valid UTF-8
    bad = [r for r in rejects_of(paths) if r["reason"] == "invalid_utf8"]
    assert len(bad) == 2 and "caf\\xe9" in bad[0]["record"]


@pytest.mark.parametrize(
    "sources, needle",
    [
        ([], "no data sources"),
        ([src(TINY, "x"), src(TINY_SG, "x")], "unique"),
        ([src(TINY, "ok"), src(ASSETS / "missing.jsonl", "gone")], "does not exist"),
        ([src(TINY, "ok"), src(ASSETS / "bad" / "table.csv", "csv")], "unknown format"),
    ],
)
def test_bad_source_lists_fail_before_writing(tmp_path, sources, needle):
    """Empty, repeated-name, missing or unreadable sources raise SourceError before any output is written."""
    with pytest.raises(SourceError, match=needle):
        merge_sources(sources, DataConfig(), 0, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_merges_a_preset_and_skips_when_up_to_date(tmp_path, capsys):
    """python -m eagle3.run.stages merge writes data/ and a manifest; a second run finds it complete."""
    preset = tmp_path / "p.yaml"
    preset.write_text(
        f"run: {{workdir: {tmp_path}, name: r}}\n"
        f"data: {{sources: [{{name: tiny, path: 'pkg://eagle3/assets/tiny_chats.jsonl'}}]}}\n"
    )
    stages.main(["merge", "--preset", str(preset), "--set", "data.val_fraction=0.5"])
    first = json.loads(capsys.readouterr().out)
    assert first["computed"] and first["stats"]["total"]["kept"] == 60
    assert 10 < first["stats"]["total"]["val"] < 50
    stages.main(["merge", "--preset", str(preset), "--set", "data.val_fraction=0.5"])
    assert json.loads(capsys.readouterr().out)["computed"] is False
    assert (tmp_path / "r" / "data" / "merged.parquet").is_file()


def test_a_source_edited_in_place_with_the_same_size_and_mtime_is_merged_again(tmp_path, capsys):
    """``cp -p``, ``rsync -a`` or ``tar x`` can replace a source keeping its size and mtime: the merge key follows
    the source's content, so the edit is merged again."""
    source = tmp_path / "chats.jsonl"
    source.write_bytes(TINY.read_bytes())
    preset = tmp_path / "p.yaml"
    preset.write_text(f"run: {{workdir: {tmp_path}, name: r}}\ndata: {{sources: [{{name: s, path: '{source}'}}]}}\n")
    stages.main(["merge", "--preset", str(preset)])
    assert json.loads(capsys.readouterr().out)["computed"]
    stat = source.stat()
    with open(source, "r+b") as fh:  # in place, as cp -p over the file does: same inode, same size
        fh.write(TINY.read_bytes().replace(b"58 + 16 = 74.", b"58 + 16 = 75.", 1))
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert source.stat().st_size == stat.st_size and source.stat().st_mtime_ns == stat.st_mtime_ns
    assert source.read_bytes() != TINY.read_bytes()
    stages.main(["merge", "--preset", str(preset)])
    assert json.loads(capsys.readouterr().out)["computed"]
    stages.main(["merge", "--preset", str(preset)])
    assert json.loads(capsys.readouterr().out)["computed"] is False


def test_merge_key_hashes_each_source_once_per_version(tmp_path, monkeypatch):
    """Sources are hashed through infra.storage's file-stamp cache: asking for the key again reads no source."""
    import infra.storage as storage
    from eagle3.config import load_config

    source = tmp_path / "chats.jsonl"
    source.write_bytes(TINY.read_bytes())
    cfg = load_config("tiny", [f"run.workdir={tmp_path}", f"data.sources=[{{name: s, path: '{source}'}}]"])
    monkeypatch.setattr(storage, "RACY_NS", 0)  # the file is fresh; a real source settled long ago
    hashed = []
    real = storage.sha256_file
    monkeypatch.setattr(storage, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    first = stages.key_for(cfg, "merge")
    assert hashed == ["chats.jsonl"]
    assert stages.key_for(cfg, "merge") == first and hashed == ["chats.jsonl"]
