"""drafter.family and the DFlash section: EAGLE-3 stays the default and keeps its stage keys; DFlash settings are
keyed once set; bad layer ids are refused with the field named."""

from __future__ import annotations

import types

import pytest

from eagle3.config import ConfigError, load_config
from eagle3.run.layout import run_layout
from tests.unit.test_operational import _fake_manifests, _fake_spec


def _train_key(cfg) -> str:
    from eagle3.train.build import stage_key_for

    return stage_key_for(cfg, types.SimpleNamespace(spec=_fake_spec(cfg), features_dir=run_layout(cfg).features))


def _key_before_dflash(cfg) -> str:
    """The train key as it was computed before the family existed: the whole drafter section, as dumped then."""
    from eagle3.config import section_dict
    from eagle3.run.registry import get_stage
    from eagle3.run.stage import stage_key

    drafter = cfg.drafter.model_dump(mode="json", exclude={"family", "dflash"})
    conf = {"drafter": drafter, "seed": cfg.run.seed, **section_dict(cfg, "train")}
    layout = run_layout(cfg)
    if cfg.train.features == "online":
        from eagle3.features.shards.layout import spec_hash

        manifests = [get_stage("tokenize").manifest(layout.root), get_stage("vocab").manifest(layout.root)]
        extra = {"target": "fake-target-fingerprint", "spec": spec_hash(_fake_spec(cfg)), "target_dtype": "float32"}
    else:
        manifests = [layout.features / "capture.manifest.json", get_stage("vocab").manifest(layout.root)]
        extra = {"target": "fake-target-fingerprint"}
    return stage_key("train", conf, manifests, extra)


@pytest.mark.parametrize("overrides", [[], ["train.features=online"], ["drafter.ttt_steps=5", "drafter.family=eagle3"]])
def test_eagle3_runs_keep_the_train_key_they_had_before_the_family_existed(tmp_path, overrides):
    """A config that does not set the DFlash fields (or sets family to its default) has the train key of the same
    config before drafter.family existed, offline and online."""
    cfg = load_config("tiny", [f"run.workdir={tmp_path}", *overrides])
    _fake_manifests(cfg)
    assert cfg.drafter.family == "eagle3"
    assert _train_key(cfg) == _key_before_dflash(cfg)


def test_family_and_dflash_settings_change_the_train_key(tmp_path):
    """family=dflash is a new key, and so is each DFlash setting on top of it."""
    base = load_config("tiny", [f"run.workdir={tmp_path}"])
    _fake_manifests(base)
    keys = {_train_key(base)}
    for extra in (
        ["drafter.family=dflash"],
        ["drafter.family=dflash", "drafter.dflash.block_size=8"],
        ["drafter.family=dflash", "drafter.dflash.num_layers=2"],
        ["drafter.family=dflash", "drafter.dflash.target_layer_ids=[1,3]"],
    ):
        keys.add(_train_key(load_config("tiny", [f"run.workdir={tmp_path}", *extra])))
    assert len(keys) == 5


@pytest.mark.parametrize("ids", ["[3,1]", "[1,1]", "[]", "[-1,2]"])
def test_target_layer_ids_must_be_distinct_and_ascending(ids):
    """Unordered, repeated, empty or negative ids are refused, naming drafter.dflash.target_layer_ids."""
    with pytest.raises(ConfigError, match="target_layer_ids"):
        load_config("tiny", ["drafter.family=dflash", f"drafter.dflash.target_layer_ids={ids}"])


def test_unknown_family_is_refused():
    """Only eagle3 and dflash are families."""
    with pytest.raises(ConfigError, match="drafter.family"):
        load_config("tiny", ["drafter.family=medusa"])
