"""Splitting a capture plan's pending shards into slices: disjoint, covering, balanced by tokens."""

from __future__ import annotations

import random

import pytest

from eagle3.features.plan import ShardPlan, plan_shards, split_slices


def _shards(tokens: list[int]) -> list[ShardPlan]:
    return [ShardPlan(i, [f"s{i}"], n, i, i + 1) for i, n in enumerate(tokens)]


@pytest.mark.parametrize("seed", range(20))
def test_slices_are_disjoint_cover_pending_and_balance_tokens(seed):
    """Every pending shard lands in exactly one slice, none other does, and the heaviest slice exceeds an even
    split by at most one shard's tokens."""
    rng = random.Random(seed)
    shards = _shards([rng.randint(1, 1000) for _ in range(rng.randint(1, 60))])
    pending = sorted(rng.sample(range(len(shards)), rng.randint(1, len(shards))))
    n = rng.randint(1, 8)
    slices = split_slices(shards, pending, n)
    flat = [i for s in slices for i in s]
    assert sorted(flat) == pending and len(flat) == len(set(flat))
    assert len(slices) == min(n, len(pending)) and all(s == sorted(s) for s in slices)
    loads = [sum(shards[i].num_tokens for i in s) for s in slices]
    even = sum(loads) / len(slices)
    assert max(loads) <= even + max(shards[i].num_tokens for i in pending)


def test_equal_shards_split_evenly_and_one_slice_is_everything():
    """Ten equal shards over 3 slices: 4/3/3 shards; with 1 slice the one slice is the pending list itself."""
    shards = _shards([100] * 10)
    assert sorted(len(s) for s in split_slices(shards, range(10), 3)) == [3, 3, 4]
    assert split_slices(shards, [7, 2, 5], 1) == [[2, 5, 7]]


def test_golden_split_of_a_real_plan():
    """Greedy largest-first over a plan from plan_shards: golden slices and token loads."""
    shards = plan_shards([f"s{i}" for i in range(8)], [50, 60, 200, 10, 90, 30, 80, 40], 100)
    assert [s.num_tokens for s in shards] == [50, 60, 200, 100, 30, 80, 40]
    slices = split_slices(shards, [s.index for s in shards], 3)
    assert slices == [[2], [0, 3, 4], [1, 5, 6]]
    assert [sum(shards[i].num_tokens for i in s) for s in slices] == [200, 180, 180]


def test_bad_input_is_refused_with_the_reason():
    """A shard index outside the plan, or fewer than one slice, is an error naming it."""
    shards = _shards([10, 20])
    with pytest.raises(ValueError, match=r"\[5\] are not in the plan"):
        split_slices(shards, [0, 5], 2)
    with pytest.raises(ValueError, match="at least 1"):
        split_slices(shards, [0], 0)
