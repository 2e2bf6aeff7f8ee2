"""Work split into slices of about equal weight: what sliced capture and sliced regeneration hand to N hosts."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def split_balanced(weights: Mapping[K, int], num_slices: int) -> list[list[K]]:
    """Split the keys of ``weights`` into at most ``num_slices`` disjoint lists of about equal total weight.

    Heaviest item first onto the slice with the least weight so far (ties: the earlier item, the lower slice),
    so no slice exceeds an even split by more than one item's weight; each list keeps the mapping's order, and
    empty slices are dropped (fewer items than slices)."""
    if num_slices < 1:
        raise ValueError(f"num_slices must be at least 1, got {num_slices}")
    position = {key: i for i, key in enumerate(weights)}
    slices: list[list[K]] = [[] for _ in range(num_slices)]
    lightest = [(0, k) for k in range(num_slices)]  # heap of (weight so far, slice): pops the least, then lowest
    for key in sorted(weights, key=lambda k: (-weights[k], position[k])):
        load, k = heapq.heappop(lightest)
        slices[k].append(key)
        heapq.heappush(lightest, (load + weights[key], k))
    return [sorted(s, key=position.__getitem__) for s in slices if s]
