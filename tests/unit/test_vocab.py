"""The draft vocab map: exact selection on hand-counted data, tie-break, forced ids, validation, round trip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from eagle3.data.tokenize import TOKENIZED_SCHEMA
from eagle3.data.vocab import (
    INFO_FILE,
    MAP_FILE,
    VocabMapError,
    build_vocab_map,
    coverage_at,
    load_vocab_map,
    maps_from_used,
    rank_tokens,
    validate_maps,
)

TARGET_VOCAB = 16


def _write_tokenized(path: Path, rows: list[tuple[str, list[int], list[int]]]) -> Path:
    """A tokenized.parquet from (split, input_ids, loss_mask) triples."""
    table = pa.Table.from_pylist(
        [
            {
                "id": f"r{i}",
                "split": split,
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": len(ids),
                "num_loss_tokens": sum(mask),
                "truncated": False,
            }
            for i, (split, ids, mask) in enumerate(rows)
        ],
        schema=TOKENIZED_SCHEMA,
    )
    pq.write_table(table, path)
    return path


@pytest.fixture()
def counted(tmp_path: Path) -> Path:
    """Supervised train counts: id 5 x4, id 3 x3, id 9 x3, id 7 x2, id 12 x1; unmasked and val tokens must not count."""
    rows = [
        ("train", [1, 5, 5, 3, 9, 2], [0, 1, 1, 1, 1, 0]),  # 1 and 2 are unmasked: never counted
        ("train", [5, 5, 3, 3, 9, 9, 7], [1, 1, 1, 1, 1, 1, 1]),
        ("train", [7, 12, 4, 4, 4], [1, 1, 0, 0, 0]),  # 4 appears 3 times, all unmasked
        ("val", [11, 11, 11, 11, 11, 11], [1, 1, 1, 1, 1, 1]),  # val: ignored however frequent
    ]
    return _write_tokenized(tmp_path / "tokenized.parquet", rows)


def test_exact_selection_and_maps(counted: Path, tmp_path: Path) -> None:
    """Top-4 by (count desc, id asc) is {5, 3, 9, 7}; d2t/t2d are the exact offsets and mask."""
    _, info = build_vocab_map(counted, TARGET_VOCAB, 4, [], tmp_path / "v", "fp")
    d2t, t2d = load_vocab_map(tmp_path / "v")
    assert d2t.tolist() == [3 - 0, 5 - 1, 7 - 2, 9 - 3]
    assert t2d.nonzero().flatten().tolist() == [3, 5, 7, 9] and t2d.dtype == torch.bool and len(t2d) == TARGET_VOCAB
    assert d2t.dtype == torch.int64
    assert info["num_distinct_tokens"] == 5 and info["num_train_rows"] == 3
    assert info["num_train_loss_tokens"] == 13 and info["coverage"] == pytest.approx(12 / 13)


def test_ties_are_broken_by_lower_id(counted: Path, tmp_path: Path) -> None:
    """3 and 9 both occur 3 times: with room for only two tokens, 5 and the lower id 3 are kept."""
    build_vocab_map(counted, TARGET_VOCAB, 2, [], tmp_path / "v", "fp")
    _, t2d = load_vocab_map(tmp_path / "v")
    assert t2d.nonzero().flatten().tolist() == [3, 5]


def test_ranking_does_not_depend_on_row_order(counted: Path, tmp_path: Path) -> None:
    """Reversing the row order gives the same map (unlike Counter.most_common insertion-order ties)."""
    table = pq.read_table(counted)
    reversed_path = tmp_path / "reversed.parquet"
    pq.write_table(table.take(list(reversed(range(table.num_rows)))), reversed_path)
    build_vocab_map(counted, TARGET_VOCAB, 3, [], tmp_path / "a", "fp")
    build_vocab_map(reversed_path, TARGET_VOCAB, 3, [], tmp_path / "b", "fp")
    assert (tmp_path / "a" / MAP_FILE).read_bytes() == (tmp_path / "b" / MAP_FILE).read_bytes()


def test_forced_ids_replace_the_lowest_ranked(counted: Path, tmp_path: Path) -> None:
    """A forced EOS id (never supervised here) is included, pushing out the lowest-ranked token (7)."""
    _, info = build_vocab_map(counted, TARGET_VOCAB, 4, [2], tmp_path / "v", "fp")
    _, t2d = load_vocab_map(tmp_path / "v")
    assert t2d.nonzero().flatten().tolist() == [2, 3, 5, 9]
    assert info["forced_ids"] == [2] and info["coverage"] == pytest.approx(10 / 13)


def test_forced_id_already_selected_takes_no_extra_slot(counted: Path, tmp_path: Path) -> None:
    """Forcing a token that is already in the top-k changes nothing."""
    build_vocab_map(counted, TARGET_VOCAB, 4, [5, 5], tmp_path / "v", "fp")
    assert load_vocab_map(tmp_path / "v")[1].nonzero().flatten().tolist() == [3, 5, 7, 9]


def test_val_rows_are_ignored(counted: Path, tmp_path: Path) -> None:
    """Id 11 is the most frequent token overall but only in val rows, so it is not selected."""
    _, info = build_vocab_map(counted, TARGET_VOCAB, 5, [], tmp_path / "v", "fp")
    _, t2d = load_vocab_map(tmp_path / "v")
    assert not t2d[11] and t2d.nonzero().flatten().tolist() == [3, 5, 7, 9, 12]
    assert info["coverage"] == 1.0


def test_fewer_distinct_tokens_fill_with_lowest_unused_ids(counted: Path, tmp_path: Path) -> None:
    """Only 5 distinct supervised ids for a draft of 8: the 3 lowest unused ids (0, 1, 2) fill the rest."""
    _, info = build_vocab_map(counted, TARGET_VOCAB, 8, [], tmp_path / "v", "fp")
    d2t, t2d = load_vocab_map(tmp_path / "v")
    assert t2d.nonzero().flatten().tolist() == [0, 1, 2, 3, 5, 7, 9, 12]
    assert (d2t + torch.arange(8)).tolist() == [0, 1, 2, 3, 5, 7, 9, 12]
    assert info["draft_vocab_size"] == 8 and info["coverage"] == 1.0


def test_draft_size_is_clipped_to_target_vocab(counted: Path, tmp_path: Path) -> None:
    """A draft vocab larger than the target's becomes the whole target vocab (d2t all zeros)."""
    _, info = build_vocab_map(counted, TARGET_VOCAB, 1000, [], tmp_path / "v", "fp")
    d2t, t2d = load_vocab_map(tmp_path / "v")
    assert info["draft_vocab_size"] == TARGET_VOCAB and bool(t2d.all()) and not bool(d2t.any())


def test_outputs_round_trip_and_summary(counted: Path, tmp_path: Path) -> None:
    """The safetensors file reloads to the same tensors; the JSON summary carries the documented fields."""
    paths, info = build_vocab_map(counted, TARGET_VOCAB, 4, [2], tmp_path / "v", "tok-sha")
    assert paths == {"vocab_map": tmp_path / "v" / MAP_FILE, "info": tmp_path / "v" / INFO_FILE}
    d2t, t2d = load_vocab_map(paths["vocab_map"])
    expected_d2t, expected_t2d = maps_from_used(np.array([2, 3, 5, 9]), TARGET_VOCAB)
    assert torch.equal(d2t, expected_d2t) and torch.equal(t2d, expected_t2d)
    on_disk = json.loads(paths["info"].read_text())
    assert on_disk == json.loads(json.dumps(info))
    for key in (
        "draft_vocab_size",
        "target_vocab_size",
        "coverage",
        "num_distinct_tokens",
        "forced_ids",
        "tokenizer_fingerprint",
        "num_train_rows",
    ):
        assert key in on_disk
    assert on_disk["tokenizer_fingerprint"] == "tok-sha"
    assert not list((tmp_path / "v").glob(".*.tmp")), "no temp files may be left behind"


def test_out_of_range_ids_are_rejected(tmp_path: Path) -> None:
    """A supervised id beyond the target vocab (wrong tokenizer) or a bad forced id raises VocabMapError."""
    path = _write_tokenized(tmp_path / "t.parquet", [("train", [3, 20], [1, 1])])
    with pytest.raises(VocabMapError, match="outside the target vocab"):
        build_vocab_map(path, TARGET_VOCAB, 4, [], tmp_path / "v", "fp")
    ok = _write_tokenized(tmp_path / "ok.parquet", [("train", [3], [1])])
    with pytest.raises(VocabMapError, match="forced ids"):
        build_vocab_map(ok, TARGET_VOCAB, 4, [99], tmp_path / "v", "fp")
    with pytest.raises(VocabMapError, match="do not fit"):
        build_vocab_map(ok, TARGET_VOCAB, 1, [1, 2], tmp_path / "v", "fp")


def test_no_supervised_train_tokens_is_an_error_not_a_map(tmp_path: Path) -> None:
    """With no supervised train token (only val rows, or every mask 0) the build fails naming the file."""
    only_val = _write_tokenized(tmp_path / "t.parquet", [("val", [3, 4], [1, 1])])
    unmasked = _write_tokenized(tmp_path / "u.parquet", [("train", [3, 4], [0, 0])])
    for path in (only_val, unmasked):
        with pytest.raises(VocabMapError, match=f"{path.name}: no supervised tokens in the train split"):
            build_vocab_map(path, TARGET_VOCAB, 3, [7], tmp_path / "v", "fp")
    assert not (tmp_path / "v" / MAP_FILE).exists()


def test_load_rejects_inconsistent_maps(tmp_path: Path) -> None:
    """load_vocab_map refuses a file whose t2d disagrees with d2t, or whose ids are unsorted."""
    d2t, t2d = maps_from_used(np.array([1, 4, 6]), 8)
    bad_t2d = t2d.clone()
    bad_t2d[0] = True
    save_file({"d2t": d2t, "t2d": bad_t2d}, str(tmp_path / "a.safetensors"))
    with pytest.raises(VocabMapError, match="disagree"):
        load_vocab_map(tmp_path / "a.safetensors")
    unsorted = torch.tensor([4, 0, 4], dtype=torch.int64)  # used = [4, 1, 6]
    with pytest.raises(VocabMapError, match="strictly increasing"):
        validate_maps(unsorted, t2d)
    save_file({"d2t": d2t}, str(tmp_path / "b.safetensors"))
    with pytest.raises(VocabMapError, match="missing"):
        load_vocab_map(tmp_path / "b.safetensors")


def test_rank_and_coverage_helpers() -> None:
    """rank_tokens orders by (count desc, id asc); coverage_at reports the top-k share for each k."""
    counts = np.array([0, 5, 2, 5, 1])
    assert rank_tokens(counts).tolist() == [1, 3, 2, 4, 0]
    assert coverage_at(counts, [1, 2, 4, 100]) == {1: 5 / 13, 2: 10 / 13, 4: 1.0, 100: 1.0}
    assert coverage_at(np.zeros(3, dtype=np.int64), [2]) == {2: 0.0}
