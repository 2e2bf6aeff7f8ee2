"""Lab: lab/sglang_levers.py (a draft vocab cut to its most frequent tokens) and lab/sglang_trace.py."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from eagle3.config import load_config
from eagle3.export.sglang import check_sglang_export
from eagle3.run.layout import write_run_config
from lab.sglang_lab import new_flags
from lab.sglang_levers import main, parse_variant, shrink_export, summarize
from lab.sglang_trace import busy_us, summarize_trace
from tests.unit.test_export import sglang_export


def tokenized(path, rows: list[list[int]], split: str = "train"):
    """A tokenized.parquet whose train rows supervise every token of ``rows``."""
    table = pa.table({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows], "split": [split] * len(rows)})
    pq.write_table(table, path)
    return path


def test_shrink_export_keeps_the_most_frequent_draft_tokens_and_their_head_rows(tmp_path):
    """The cut export holds the k most frequent draft tokens (ties by id), their lm_head rows, and passes the check."""
    src, _, _, dims = sglang_export(tmp_path)  # draft vocab = odd target ids 1, 3, ..., 47
    before = load_file(str(src / "model.safetensors"))
    used = (before["d2t"] + torch.arange(len(before["d2t"]))).tolist()
    # 45 x5, 3 x4, 47 x4 (tie with 3: the lower id wins over nothing else), 7 x1; 2 is not a draft token
    data = tokenized(tmp_path / "tok.parquet", [[45] * 5 + [3] * 4 + [47] * 4 + [7, 2, 2, 2, 2, 2, 2]])
    info = shrink_export(src, tmp_path / "cut", data, keep=3)
    after = load_file(str(tmp_path / "cut" / "model.safetensors"))
    kept = (after["d2t"] + torch.arange(3)).tolist()
    assert kept == [3, 45, 47]
    assert after["t2d"].sum() == 3 and after["t2d"][kept].all()
    for row, target_id in enumerate(kept):
        assert torch.equal(after["lm_head.weight"][row], before["lm_head.weight"][used.index(target_id)])
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["draft_vocab_size"] == 3
    check_sglang_export(tmp_path / "cut")
    assert info["coverage_kept"] == pytest.approx(13 / 20) and info["coverage_full"] == pytest.approx(14 / 20)


def test_saved_token_counts_cut_the_same_as_counting_the_tokenized_data_and_a_wrong_file_is_refused(tmp_path):
    """Counts saved by lab/token_counts.py (the run's data on another host) give the same cut; a wrong-sized file
    is named."""
    import numpy as np

    src, _, _, _ = sglang_export(tmp_path)
    data = tokenized(tmp_path / "tok.parquet", [[45] * 5 + [3] * 4 + [47] * 4 + [7, 2]])
    from lab.token_counts import save_counts

    assert save_counts(data, src, tmp_path / "counts.npy") == (15, 1)
    shrink_export(src, tmp_path / "a", data, keep=3)
    shrink_export(src, tmp_path / "b", tmp_path / "absent.parquet", keep=3, saved_counts=tmp_path / "counts.npy")
    assert torch.equal(
        load_file(str(tmp_path / "a" / "model.safetensors"))["d2t"],
        load_file(str(tmp_path / "b" / "model.safetensors"))["d2t"],
    )
    np.save(tmp_path / "short.npy", np.zeros(5, dtype=np.int64))
    with pytest.raises(ValueError, match="short.npy: expected int64 counts"):
        shrink_export(src, tmp_path / "c", data, keep=3, saved_counts=tmp_path / "short.npy")


def test_shrink_export_refuses_to_cut_to_the_size_it_has(tmp_path):
    """Asking for as many tokens as the export holds is an error, not a silent copy."""
    src, _, _, dims = sglang_export(tmp_path)
    with pytest.raises(ValueError, match="nothing to cut"):
        shrink_export(src, tmp_path / "cut", tokenized(tmp_path / "t.parquet", [[1, 3]]), keep=dims.draft_vocab_size)


def test_a_dflash_run_is_refused_before_any_server_starts(tmp_path):
    """The levers' trios and vocab cuts are EAGLE-3's: a DFlash run's config stops the script at once, naming the
    lease's skip, and writes nothing."""
    cfg = load_config("tiny", [f"run.workdir={tmp_path}", "drafter.family=dflash"])
    config = write_run_config(cfg)
    out = tmp_path / "levers" / "bench-levers.json"
    with pytest.raises(SystemExit, match="LEASE_SKIP=levers"):
        main(["--config", str(config), "--out", str(out)])
    assert not out.exists()


def test_variants_parse_by_name_and_unknown_ones_are_named():
    """vocab-K carries K, 7-1-8 its trio, baseline no trio; an unknown name lists the known ones."""
    assert parse_variant("vocab-4096").draft_vocab == 4096 and parse_variant("7-1-8").trio == "7-1-8"
    assert parse_variant("baseline").trio is None
    again = parse_variant("vocab-4096#2")
    assert again.name == "vocab-4096-2" and again.draft_vocab == 4096
    with pytest.raises(ValueError, match="attn-decode"):
        parse_variant("fast")


def test_combined_variants_take_one_trio_every_flag_and_the_cut_and_clashes_are_refused():
    """7-1-8+vocab-4096+attn-decode is chain 7 with the cut and the flag; two trios or a baseline part are errors."""
    v = parse_variant("7-1-8+vocab-4096+attn-decode")
    assert (v.name, v.trio, v.draft_vocab) == ("7-1-8+vocab-4096+attn-decode", "7-1-8", 4096)
    assert v.extra_args == ("--speculative-attention-mode", "decode")
    assert parse_variant("vocab-4096+compile").trio == "3-1-4"
    with pytest.raises(ValueError, match="two trios"):
        parse_variant("7-1-8+3-1-4+vocab-4096+vocab-2048")
    with pytest.raises(ValueError, match="no drafter"):
        parse_variant("baseline+vocab-4096")
    with pytest.raises(ValueError, match="no drafter"):
        parse_variant("ngram+attn-decode")
    assert parse_variant("ngram").trio == "ngram"


def test_a_combined_lever_is_compared_with_its_own_trios_plain_server():
    """7-1-8+vocab-4096 at 3 ms against 7-1-8's 4 ms reads -25.0% vs 7-1-8, not against 3-1-4."""
    records = [
        {"variant": "baseline", "trio": None, "ms_per_round": 1.0, "accept_length": None, "tok_per_s": 1000.0},
        {"variant": "3-1-4", "trio": "3-1-4", "ms_per_round": 2.0, "accept_length": 2.0, "tok_per_s": 900.0},
        {"variant": "7-1-8", "trio": "7-1-8", "ms_per_round": 4.0, "accept_length": 3.0, "tok_per_s": 700.0},
        {"variant": "7-1-8+vocab-4096", "trio": "7-1-8", "ms_per_round": 3.0, "accept_length": 3.0, "tok_per_s": 950.0},
    ]
    lines = summarize(records)
    assert " vs " not in lines[2]  # 7-1-8 is its own trio's control
    assert "-25.0% vs 7-1-8" in lines[3] and "speed-up 1.00x" in lines[3]


def test_summary_reads_round_cost_in_target_steps_and_speedup():
    """2 ms rounds against a 1 ms step at accept 3 read as 2.00 target steps and a 1.50x speed-up."""
    records = [
        {"variant": "baseline", "ms_per_round": 1.0, "accept_length": None, "tok_per_s": 1000.0},
        {"variant": "3-1-4", "ms_per_round": 2.0, "accept_length": 3.0, "tok_per_s": 1500.0},
        {"variant": "vocab-4096", "ms_per_round": 1.5, "accept_length": 3.0, "tok_per_s": 2000.0},
        {"variant": "7-1-8", "error": "ServerStartError: boom"},
    ]
    lines = summarize(records)
    assert "2.00 target steps" in lines[1] and "speed-up 1.50x" in lines[1]
    assert "-25.0% vs 3-1-4" in lines[2] and "speed-up 2.00x" in lines[2]
    assert lines[3] == "7-1-8: FAILED ServerStartError: boom"


def test_trace_summary_counts_overlapping_kernels_once_and_rounds_by_verify_steps(tmp_path):
    """Busy time is the union of kernel intervals; per-round figures divide by the TARGET_VERIFY annotations."""
    assert busy_us([(0, 10), (5, 15), (20, 30)]) == 25
    events = [
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 5, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 90, "dur": 10},
        {"ph": "X", "cat": "user_annotation", "name": "step[TARGET_VERIFY bs=1]", "ts": 0, "dur": 40},
        {"ph": "X", "cat": "user_annotation", "name": "step[TARGET_VERIFY bs=1]", "ts": 50, "dur": 20},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1, "dur": 1},
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    from lab.sglang_trace import load_events

    s = summarize_trace(load_events(path))
    assert s["rounds"] == 2 and s["gpu_busy_share"] == pytest.approx(25 / 100)
    assert s["cpu_ms_per_round"]["step[TARGET_VERIFY"] == pytest.approx(0.030)
    assert s["top_kernels_ms"]["k1"] == pytest.approx(0.020) and s["launches_per_round"]["cudaGraphLaunch"] == 0.5
    assert s["launches_per_round_by_phase"] == {"step[TARGET_VERIFY: cudaGraphLaunch": 0.5}


def test_lab_flags_the_run_already_sets_are_dropped_with_their_values():
    """--attention-backend (a server field) and --grammar-backend (in extra_args) are not repeated; others stay."""
    from eagle3.config import load_config

    cfg = load_config("tiny", ["server.attention_backend=triton", 'server.extra_args=["--grammar-backend","none"]'])
    given = ["--attention-backend", "triton", "--grammar-backend", "none", "--sampling-backend", "pytorch"]
    assert new_flags(cfg, given) == ["--sampling-backend", "pytorch"]
