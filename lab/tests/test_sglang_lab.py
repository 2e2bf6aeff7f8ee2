"""Pure functions of the SGLang lab benchmarks (lab/sglang_capture.py, lab/sglang_regenerate.py).

No server and no model: the comparison arithmetic the GPU-host runs rely on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from lab.sglang_capture import BlockSums, block_sums, compare_states, offenders, split_blocks
from lab.sglang_regenerate import answers, identity_shares

REPO = Path(__file__).resolve().parents[2]


def test_identical_states_have_zero_error_in_every_block():
    """Comparing a capture with itself gives rel RMS 0 and max abs 0 for each aux layer and the final state."""
    rng = np.random.default_rng(0)
    aux, final = rng.standard_normal((7, 3 * 4)).astype(np.float32), rng.standard_normal((7, 4)).astype(np.float32)
    figures = compare_states(aux, aux.copy(), 3, final, final.copy())
    assert list(figures) == ["aux0", "aux1", "aux2", "final"]
    assert all(s.rel_rms == 0.0 and s.max_abs == 0.0 and s.nonfinite == 0 for s in figures.values())
    assert offenders(figures, 1e-2) == []


def test_an_error_in_one_block_shows_only_in_that_block_with_its_relative_size():
    """Adding 1% of layer 1's block to it gives rel RMS 0.01 there and 0 in the other blocks."""
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((5, 3 * 8))
    got = ref.copy()
    got[:, 8:16] *= 1.01
    figures = compare_states(ref, got, 3, None, None)
    assert figures["aux0"].rel_rms == 0.0 and figures["aux2"].rel_rms == 0.0
    assert figures["aux1"].rel_rms == pytest.approx(0.01, rel=1e-9)
    assert "final" not in figures


def test_blocks_split_columns_in_layer_order():
    """[T, K*H] splits into K blocks; block k holds columns k*H .. (k+1)*H - 1."""
    aux = np.arange(2 * 6).reshape(2, 6)
    blocks = split_blocks(aux, 3)
    assert [b.tolist() for b in blocks] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    with pytest.raises(ValueError, match="equal blocks"):
        split_blocks(aux, 4)


def test_sums_over_samples_give_the_overall_rel_rms_weighted_by_size():
    """Overall rel RMS is sqrt(sum diff^2 / sum ref^2) over samples, not the mean of per-sample figures."""
    a = block_sums(np.ones((1, 4)), np.ones((1, 4)) * 1.1)  # diff^2 0.04, ref^2 4
    b = block_sums(np.ones((3, 4)) * 2, np.ones((3, 4)) * 2)  # diff^2 0, ref^2 48
    total = BlockSums()
    total.add(a)
    total.add(b)
    assert total.rel_rms == pytest.approx(math.sqrt(0.04 / 52))
    assert total.max_abs == pytest.approx(0.1)


def test_non_finite_values_are_counted_and_fail_the_goal():
    """A NaN in either capture makes the block's rel RMS nan, counted, and an offender whatever the tolerance."""
    ref = np.zeros((2, 4), dtype=np.float32) + 1
    got = ref.copy()
    got[1, 2] = np.nan
    sums = block_sums(ref, got)
    assert sums.nonfinite == 1 and math.isnan(sums.rel_rms)
    assert offenders({"aux0": sums}, 1e9) == ["aux0"]
    assert sums.to_json()["rel_rms"] == "nan"


def test_shape_mismatch_is_an_error_not_a_number():
    """States of different shapes cannot be compared: ValueError naming both shapes."""
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(3, 4\)"):
        block_sums(np.zeros((2, 4)), np.zeros((3, 4)))


def test_identity_shares_count_rows_both_sides_answered():
    """Shares are over common rows; a row is identical only if every answer is; rows on one side are counted apart."""
    tokenize = lambda text: [ord(c) for c in text]  # noqa: E731 - one token per character
    a = {"r1": ["same"], "r2": ["abcdefXX"], "r3": ["x", "y"], "r4": ["only a"]}
    b = {"r1": ["same"], "r2": ["abcdefYY"], "r3": ["x"], "r5": ["only b"]}
    shares = identity_shares(a, b, tokenize, first_tokens=6)
    assert shares["rows_compared"] == 3 and shares["only_a"] == 1 and shares["only_b"] == 1
    assert shares["identical_text"] == 1 and shares["identical_text_share"] == pytest.approx(1 / 3)
    assert shares["identical_first_6_tokens"] == 2  # r1, and r2 (differs after 6 tokens); r3 has another count
    assert identity_shares({}, {}, tokenize)["identical_text_share"] is None


def test_answers_keep_only_the_asked_rows_assistant_turns():
    """answers() returns each asked row's assistant contents in order and skips rows not asked for."""
    rows = [
        {"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]},
        {"id": "b", "messages": [{"role": "assistant", "content": "orig"}]},
    ]
    assert answers(rows, {"a"}) == {"a": ["x"]}


def test_sigterm_runs_the_benchmarks_finally_blocks_and_records_the_interruption(tmp_path):
    """A SIGTERM'd benchmark stops what its body started (its finally runs) and its results JSON says why it ended."""
    import signal
    import subprocess
    import sys
    import time

    script = f"""
import sys, time
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from lab.sglang_lab import run_and_record

def body():
    try:
        Path({str(tmp_path / "started")!r}).touch()
        time.sleep(60)
    finally:
        Path({str(tmp_path / "cleaned")!r}).touch()
    return []

sys.exit(run_and_record(Path({str(tmp_path / "out.json")!r}), {{}}, body))
"""
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert (tmp_path / "cleaned").exists()
    assert json.loads((tmp_path / "out.json").read_text())["error"] == f"interrupted (exit {128 + signal.SIGTERM})"
