"""The online feature cache (eagle3.train.state_cache): what comes out is what went in, prefixes of longer
documents, a byte budget that is never exceeded, and copies that nothing outside can change."""

from __future__ import annotations

import pytest
import torch

from eagle3.train.online import OnlineFeatures
from eagle3.train.state_cache import HostSlabs, StateCache


def _states(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"aux": torch.randn(n, 12, generator=g), "final": torch.randn(n, 4, generator=g)}  # [n, A*H], [n, H]


def test_a_kept_document_comes_back_equal_and_as_a_prefix_for_fewer_tokens():
    """get returns the stored states exactly; for fewer tokens their first rows; for more tokens a miss."""
    cache, states = StateCache(1 << 20), _states(10)
    assert cache.get("a", 10) is None and cache.put("a", states)
    whole, prefix = cache.get("a", 10), cache.get("a", 6)
    assert all(torch.equal(whole[k], states[k]) and torch.equal(prefix[k], states[k][:6]) for k in states)
    assert cache.get("a", 11) is None
    assert (cache.stats.hits, cache.stats.misses, cache.documents) == (2, 2, 1)


def test_the_budget_is_never_exceeded_and_a_longer_copy_replaces_a_shorter():
    """A document that would pass the budget is not kept (counted as full); replacing one frees its bytes."""
    per_token = (12 + 4) * 4
    cache = StateCache(10 * per_token)
    assert cache.put("a", _states(6)) and not cache.put("b", _states(5))
    assert cache.stats.bytes == 6 * per_token and cache.stats.full == 1 and cache.get("b", 5) is None
    assert cache.put("a", _states(10, seed=1)) and cache.stats.bytes == 10 * per_token
    assert cache.documents == 1 and torch.equal(cache.get("a", 10)["aux"], _states(10, seed=1)["aux"])
    assert "1 documents" in cache.describe() and "1 over the budget" in cache.describe()


def test_the_cache_keeps_copies():
    """Writing into the tensors put in (or into a row built from them) leaves the cached states unchanged."""
    cache, states = StateCache(1 << 20), _states(4)
    want = states["aux"].clone()
    cache.put("a", states)
    states["aux"].zero_()
    assert torch.equal(cache.get("a", 4)["aux"], want)


def test_no_cache_without_a_budget_or_with_a_sharded_target():
    """A zero budget is an error; so is a cache beside an FSDP-sharded target, whose ranks must all run forwards."""
    with pytest.raises(ValueError, match="positive budget"):
        StateCache(0)
    with pytest.raises(ValueError, match="positive budget"):
        StateCache(0, 0)

    class Backend:
        model = torch.nn.Linear(1, 1)

    with pytest.raises(ValueError, match="target_sharding=replicate"):
        OnlineFeatures(Backend(), spec=None, sharded=True, cache=StateCache(1))


def test_a_device_out_of_memory_caps_the_budget_at_what_is_kept(monkeypatch):
    """If the device cannot hold a copy the budget allowed, the document is not kept, the budget shrinks to the
    bytes already kept (no later put tries again), and what was kept stays."""
    cache = StateCache(1 << 20)
    assert cache.put("a", _states(4))
    kept = cache.stats.bytes

    def no_memory(self):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(torch.Tensor, "clone", no_memory)
    assert not cache.put("b", _states(2))
    monkeypatch.undo()
    assert cache.budget == kept and cache.stats.full == 1 and not cache.put("c", _states(1))
    assert cache.get("a", 4) is not None and cache.get("b", 2) is None


def test_documents_the_device_budget_cannot_hold_go_to_host_memory_and_come_back_equal():
    """Past the device budget, documents are kept in host memory (logged as such) and come back equal, as prefixes
    too; a longer copy that fits neither budget leaves the shorter kept; a device copy replaced by a host copy frees
    its device bytes; only what fits neither budget counts as over it."""
    per_token = (12 + 4) * 4
    cache = StateCache(10 * per_token, 1 << 20)
    a, b = _states(6), _states(5, seed=1)
    assert cache.put("a", a) and cache.put("b", b)
    assert cache.stats.bytes == 6 * per_token and cache.stats.full == 0 and cache.documents == 2
    got = cache.get("b", 3)
    assert all(torch.equal(got[k], b[k][:3]) for k in b) and cache.stats.host_hits == 1
    assert "(+ 1 documents in" in cache.describe() and "1 hits from there" in cache.describe()
    assert cache.put("a", _states(12, seed=2)) and cache.stats.bytes == 0  # moved to host memory
    assert torch.equal(cache.get("a", 12)["aux"], _states(12, seed=2)["aux"]) and cache.stats.host_hits == 2
    small = StateCache(6 * per_token, 64)
    assert small.put("a", a) and not small.put("a", _states(12, seed=2)) and small.stats.full == 1
    assert torch.equal(small.get("a", 6)["aux"], a["aux"]) and small.get("a", 12) is None


def test_host_slabs_never_pass_their_budget_and_align_every_piece():
    """Slabs are allocated only within the budget; every piece starts aligned in its slab, so views of any dtype
    work; a state too big for what is left is refused without touching what was kept."""
    slabs = HostSlabs(budget=4096, slab_bytes=2048)
    one = slabs.keep({"x": torch.arange(10, dtype=torch.float32), "y": torch.ones(3, dtype=torch.int64)})
    assert one is not None and torch.equal(one["x"], torch.arange(10, dtype=torch.float32))
    assert one["y"].dtype == torch.int64 and all(
        (t.data_ptr() - t.untyped_storage().data_ptr()) % HostSlabs.ALIGN == 0 for t in one.values()
    )
    assert slabs.allocated == 2048
    assert slabs.keep({"z": torch.zeros(512, dtype=torch.float32)}) is not None and slabs.allocated == 4096
    assert slabs.keep({"w": torch.zeros(1, dtype=torch.float32)}) is None and slabs.allocated == 4096
    assert torch.equal(one["x"], torch.arange(10, dtype=torch.float32))
