"""The online feature cache (eagle3.train.state_cache): what comes out is what went in, prefixes of longer
documents, a byte budget that is never exceeded, and copies that nothing outside can change."""

from __future__ import annotations

import pytest
import torch

from eagle3.train.online import OnlineFeatures
from eagle3.train.state_cache import StateCache


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
