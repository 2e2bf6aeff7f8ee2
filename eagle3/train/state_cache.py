"""The target's states of documents already seen, kept on the training device (``train.feature_cache_gib``).

Online training runs the frozen target on every row of every epoch, and a row's documents come back in later
epochs (repacked with others) and in every validation pass, so with several epochs the target recomputes states it
computed once (on an H200, SmolLM2-135M, 20M tokens: epochs 2-6 ran 1.2-1.4x as fast as the first with ~92% of
documents cached; docs/train.md). This cache keeps each document's states (the tensors
``OnlineFeatures`` fills a row with: aux [n, A*H] and final [n, H], or top-K) as they were computed the first time,
keyed by sample id, up to a byte budget; a document that does not fit is computed every time, as without a cache.

What comes out of the cache is exactly what the first forward returned, so a run with the cache equals one without
it wherever the target's forward is deterministic across row layouts (bitwise on a CPU; to the compute dtype's
rounding on a GPU, where the forward itself differs by that much between layouts). A document's states for its
first n tokens are the first n rows of its longer states (the target is causal), so a document cut shorter in a
later row is served from the cache too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

States = dict[str, Tensor]
"""One document's states: name -> [n, ...] (names as OnlineFeatures.row_states returns them)."""


@dataclass
class CacheStats:
    """Counters for the trainer's log."""

    hits: int = 0
    misses: int = 0
    bytes: int = 0
    full: int = 0  # documents not kept because the budget was spent

    @property
    def hit_rate(self) -> float:
        """Share of lookups the cache answered."""
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0


def _nbytes(states: States) -> int:
    return sum(t.numel() * t.element_size() for t in states.values())


class StateCache:
    """Documents' states by sample id, within ``budget_bytes`` (module docstring)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"a state cache needs a positive budget, got {budget_bytes} bytes")
        self.budget = budget_bytes
        self.stats = CacheStats()
        self._states: dict[str, States] = {}

    @property
    def documents(self) -> int:
        """Documents kept."""
        return len(self._states)

    def describe(self) -> str:
        """One line for the trainer's log: documents kept, memory used of the budget, the hit rate so far."""
        st = self.stats
        return (f"feature cache: {self.documents:,} documents, {st.bytes / 2**30:.2f} of {self.budget / 2**30:.2f} "
                f"GiB, {st.hit_rate:.1%} of {st.hits + st.misses:,} lookups hit, {st.full:,} over the budget")

    def get(self, sample_id: str, num_tokens: int) -> States | None:
        """The first ``num_tokens`` rows of the document's states, or None when they are not kept."""
        states = self._states.get(sample_id)
        if states is None or next(iter(states.values())).shape[0] < num_tokens:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return {name: t[:num_tokens] for name, t in states.items()}

    def put(self, sample_id: str, states: States) -> bool:
        """Keep a document's states if the budget allows (a longer copy replaces a shorter); True when kept."""
        size = _nbytes(states)
        old = self._states.get(sample_id)
        freed = _nbytes(old) if old else 0
        if self.stats.bytes - freed + size > self.budget:
            self.stats.full += 1
            return False
        try:  # a copy: the row's tensor these are views of must not stay alive, and nothing may write into it
            copy = {name: t.detach().clone() for name, t in states.items()}
        except torch.OutOfMemoryError:  # the device holds less than the budget said: keep what is kept, add no more
            self.budget = self.stats.bytes
            self.stats.full += 1
            return False
        self._states[sample_id] = copy
        self.stats.bytes += size - freed
        return True
