"""lab/answer_lengths.py: the per-cap figures derived from measured lengths."""

from __future__ import annotations

import pytest

from lab.answer_lengths import Lengths, batch_row_steps, cap_figures


def _lengths(tokens: list[int], ended: list[bool], limit: int = 40) -> Lengths:
    return Lengths("t", tokens, ended, limit, [5] * len(tokens), 0.0)


def test_equal_lengths_use_every_slot_and_nothing_is_cut():
    """Rows that all end at the same step fill every slot of every batch."""
    f = cap_figures(_lengths([12, 12, 12], [True] * 3), cap=20, batch=8, draws=10, seed=0)
    assert (f.mean_kept, f.cut_share, f.slot_use) == (12.0, 0.0, 1.0)


def test_cap_cuts_long_and_unended_rows_and_sets_the_batch_length():
    """A row longer than the cap, or one that never ended, keeps cap tokens and counts as cut; with both lengths in
    every large batch, the slot use is the mean kept over the cap."""
    f = cap_figures(_lengths([10, 30, 40], [True, True, False]), cap=20, batch=256, draws=50, seed=1)
    assert f.mean_kept == pytest.approx((10 + 20 + 20) / 3)
    assert f.cut_share == pytest.approx(2 / 3)
    assert f.slot_use == pytest.approx(f.mean_kept / 20, abs=0.02)


def test_single_row_batches_never_waste_a_slot():
    """A batch of one row runs exactly as long as that row."""
    f = cap_figures(_lengths([3, 40, 17], [True, True, True]), cap=40, batch=1, draws=30, seed=2)
    assert f.slot_use == 1.0


def test_a_cap_above_the_measured_limit_is_refused():
    """Lengths were only measured up to the limit, so a larger cap has no honest figure."""
    with pytest.raises(ValueError, match="above the measured limit 40"):
        cap_figures(_lengths([5], [True]), cap=64, batch=4, draws=1, seed=0)


def test_straggler_batch_row_steps_golden():
    """Rows 2,3,9,10 with 2 stragglers: 4 rows for 3 steps, then 2 rows for 7 more (26), against 4 x 10 (40)."""
    assert batch_row_steps([9, 2, 10, 3], 2) == 4 * 3 + 2 * 7
    assert batch_row_steps([9, 2, 10, 3], 0) == 40
    assert batch_row_steps([9, 2, 10, 3], 4) == 40  # a straggler batch as large as the batch shrinks nothing
