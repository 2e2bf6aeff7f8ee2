"""The target's states of documents already seen, kept on the training device (``train.feature_cache_gib``).

Online training runs the frozen target on every row of every epoch, and a row's documents come back in later
epochs (repacked with others) and in every validation pass, so with several epochs the target recomputes states it
computed once (what the cache saves: docs/train.md). This cache keeps each document's states (the tensors
``OnlineFeatures`` fills a row with: aux [n, A*H] and final [n, H], or top-K) as they were computed the first time,
keyed by sample id, up to a byte budget; a document that does not fit is computed every time, as without a cache.
Where the device's budget cannot hold every document, ``train.feature_cache_host_gib`` keeps the rest in pinned host
memory, copied to the device when a row takes them: a row with one document not kept runs the target's forward,
which costs nearly a whole row's (docs/train.md).

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
    bytes: int = 0  # on the training device
    full: int = 0  # documents not kept because the budgets were spent
    host_hits: int = 0  # of the hits, those served from host memory

    @property
    def hit_rate(self) -> float:
        """Share of lookups the cache answered."""
        looked = self.hits + self.misses
        return self.hits / looked if looked else 0.0


def _nbytes(states: States) -> int:
    return sum(t.numel() * t.element_size() for t in states.values())


class HostSlabs:
    """Host memory for states, pinned where CUDA runs, handed out from slabs of ``slab_bytes`` and never given back.

    One pinned allocation per slab, not per document: torch's caching host allocator rounds each pinned tensor up to
    a power of two (up to twice the memory) and pinning is slow per call. ``budget`` bounds the slabs allocated.
    """

    ALIGN = 512  # every piece starts at a multiple of this, so any dtype can view it

    def __init__(self, budget: int, slab_bytes: int = 1 << 30):
        self.budget, self.slab_bytes = budget, slab_bytes
        self.allocated = 0  # bytes of slabs allocated (what the budget bounds)
        self._slab: Tensor | None = None  # [slab] uint8, the one being filled
        self._offset = 0

    def _piece(self, nbytes: int) -> Tensor | None:
        need = -(-nbytes // self.ALIGN) * self.ALIGN
        if self._slab is None or self._offset + need > self._slab.numel():
            size = min(max(self.slab_bytes, need), self.budget - self.allocated)
            if size < need:
                return None
            try:
                slab = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            except RuntimeError:  # the host cannot pin that much: keep what is kept, add no more
                self.budget = self.allocated
                return None
            self._slab, self._offset = slab, 0
            self.allocated += size
        piece = self._slab[self._offset : self._offset + nbytes]
        self._offset += need
        return piece

    def keep(self, states: States) -> States | None:
        """Host copies of ``states``, or None when the budget cannot hold them. From a GPU the copy is queued on the
        current stream without waiting: only that stream ever reads the slab again (``StateCache.get``'s copy back)."""
        pieces = {}
        for name, t in states.items():
            piece = self._piece(t.numel() * t.element_size())
            if piece is None:
                return None  # pieces already taken stay allocated: they count against the budget, as they should
            pieces[name] = piece.view(t.dtype).view(t.shape)
        for name, t in states.items():
            pieces[name].copy_(t.detach(), non_blocking=True)
        return pieces


class StateCache:
    """Documents' states by sample id: ``budget_bytes`` on the training device, then ``host_budget_bytes`` of host
    memory for those the device cannot hold (module docstring)."""

    def __init__(self, budget_bytes: int, host_budget_bytes: int = 0):
        if budget_bytes < 0 or host_budget_bytes < 0 or budget_bytes + host_budget_bytes <= 0:
            raise ValueError(
                f"a state cache needs a positive budget, got {budget_bytes} bytes on the device and "
                f"{host_budget_bytes} in host memory"
            )
        self.budget = budget_bytes
        self.host = HostSlabs(host_budget_bytes) if host_budget_bytes else None
        self.stats = CacheStats()
        self._states: dict[str, States] = {}
        self._on_host: dict[str, torch.device] = {}  # documents kept in host memory -> the device they go back to

    @property
    def documents(self) -> int:
        """Documents kept."""
        return len(self._states)

    def describe(self) -> str:
        """One line for the trainer's log: documents kept, memory used of the budgets, the hit rate so far."""
        st = self.stats
        host = ""
        if self.host is not None:
            host = (
                f" (+ {len(self._on_host):,} documents in {self.host.allocated / 2**30:.2f} of "
                f"{self.host.budget / 2**30:.2f} GiB of host memory, {st.host_hits:,} hits from there)"
            )
        return (
            f"feature cache: {self.documents - len(self._on_host):,} documents, {st.bytes / 2**30:.2f} of "
            f"{self.budget / 2**30:.2f} GiB{host}, {st.hit_rate:.1%} of {st.hits + st.misses:,} lookups hit, "
            f"{st.full:,} over the budget"
        )

    def get(self, sample_id: str, num_tokens: int) -> States | None:
        """The first ``num_tokens`` rows of the document's states (on the training device), or None when they are
        not kept."""
        states = self._states.get(sample_id)
        if states is None or next(iter(states.values())).shape[0] < num_tokens:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        home = self._on_host.get(sample_id)
        if home is None:
            return {name: t[:num_tokens] for name, t in states.items()}
        self.stats.host_hits += 1
        # pinned -> asynchronous; the slab is never written again, so the copy may finish later
        return {name: t[:num_tokens].to(home, non_blocking=True) for name, t in states.items()}

    def put(self, sample_id: str, states: States) -> bool:
        """Keep a document's states if a budget allows (a longer copy replaces a shorter); True when kept."""
        size = _nbytes(states)
        old = self._states.get(sample_id)
        freed = _nbytes(old) if old is not None and sample_id not in self._on_host else 0
        copy = None
        if self.stats.bytes - freed + size <= self.budget:
            try:  # a copy: the row's tensor these are views of must not stay alive, and nothing may write into it
                copy = {name: t.detach().clone() for name, t in states.items()}
            except torch.OutOfMemoryError:  # the device holds less than the budget said: keep what is kept
                self.budget = self.stats.bytes
        if copy is not None:
            self._on_host.pop(sample_id, None)  # a shorter host copy stays allocated in its slab
            self.stats.bytes += size - freed
        elif self.host is not None and (copy := self.host.keep(states)) is not None:
            self._on_host[sample_id] = next(iter(states.values())).device
            self.stats.bytes -= freed  # a shorter device copy is dropped
        else:
            self.stats.full += 1
            return False
        self._states[sample_id] = copy
        return True
