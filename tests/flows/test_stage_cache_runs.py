"""Prefect's cache records of up-to-date stages are per run directory (tasks/stage_cache.py)."""

from __future__ import annotations

import types

from eagle3.config import RunConfig


class _Store:
    """The two calls the key function makes on Prefect's result store, over a dict."""

    def __init__(self) -> None:
        self.records: dict[str, object] = {}

    def exists(self, key: str) -> bool:
        return key in self.records

    def write(self, value: object, key: str) -> None:
        self.records[key] = value


def test_two_runs_with_the_same_stage_key_get_records_of_their_own(tmp_path, monkeypatch):
    """Same inputs under two run names: two cache keys, each record built from its own run (not the first one's)."""
    import tasks.stage_cache as sc

    monkeypatch.setattr(sc, "key_and_state", lambda stage, cfg, known_key=None: ("k" * 16, True))
    key_fn = sc.stage_cache_key("merge", skipped=lambda cfg, key: str(cfg.run_dir))
    store = _Store()
    keys = []
    for name in ["a", "b", "a"]:
        cfg = RunConfig.model_validate({"run": {"workdir": str(tmp_path), "name": name}})
        ctx = types.SimpleNamespace(task_run=types.SimpleNamespace(id=name), result_store=store)
        keys.append(key_fn(ctx, {"cfg": cfg}))
    assert keys[0] != keys[1] and keys[0] == keys[2]
    assert store.records == {keys[0]: str(tmp_path / "a"), keys[1]: str(tmp_path / "b")}
