"""RunConfig: strictness, docs on every field, presets, overrides, error messages."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from eagle3.config import ConfigError, RunConfig, list_presets, load_config, save_config


def _all_fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _all_fields(ann, f"{prefix}{name}.")


def test_every_field_has_a_one_line_doc():
    """Every field of the tree carries a non-empty, single-line description."""
    missing = [name for name, f in _all_fields(RunConfig) if not (f.description or "").strip()]
    multiline = [name for name, f in _all_fields(RunConfig) if "\n" in (f.description or "")]
    assert missing == [] and multiline == []


@pytest.mark.parametrize("preset", ["tiny", "smollm2-demo", "llama31-8b", "kimi-k25"])
def test_presets_validate(preset):
    """Each shipped preset is a valid RunConfig."""
    assert preset in list_presets()
    assert isinstance(load_config(preset), RunConfig)


def test_dotted_overrides_apply_with_yaml_types():
    """--set values are parsed as YAML and land in the right section, list indexes included."""
    cfg = load_config("smollm2-demo", ["train.lr=3e-4", "tokenize.overlong=drop", "data.val_fraction=0.2"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.tokenize.overlong == "drop"
    assert cfg.data.val_fraction == pytest.approx(0.2)


def test_unknown_field_is_named_in_the_error(tmp_path):
    """A preset with an unknown field fails with a message naming the field path."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"train\.learning_rate: Extra inputs are not permitted"):
        load_config(str(bad))


def test_wrong_type_is_named_in_the_error():
    """A bad override names the field and the reason."""
    with pytest.raises(ConfigError, match=r"tokenize\.max_len"):
        load_config("tiny", ["tokenize.max_len=lots"])


def test_unknown_preset_lists_the_known_ones():
    """An unknown preset name says which presets exist."""
    with pytest.raises(ConfigError, match="tiny"):
        load_config("no-such-preset")


def test_malformed_override_is_rejected():
    """An override without '=' is a ConfigError, not a crash."""
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config("tiny", ["train.lr"])


def test_resolved_config_round_trips(tmp_path):
    """config.json written for a run loads back to the same tree."""
    cfg = load_config("tiny", ["run.seed=7"])
    path = save_config(cfg, tmp_path / "config.json")
    assert RunConfig.model_validate(json.loads(path.read_text())) == cfg


def test_run_name_must_be_a_plain_directory_name():
    """A run name with a slash is refused (it would escape the workdir)."""
    with pytest.raises(ConfigError, match="run"):
        load_config("tiny", ["run.name=../elsewhere"])


def test_overrides_index_into_lists():
    """'data.sources.0.max_records=5' edits the first source; a bad index is a clear error."""
    cfg = load_config("smollm2-demo", ["data.sources.0.max_records=5"])
    assert cfg.data.sources[0].max_records == 5
    with pytest.raises(ConfigError, match="not an index"):
        load_config("smollm2-demo", ["data.sources.3.max_records=5"])


def test_tiny_layer_minimum_applies_only_to_tiny_targets():
    """A tiny target needs >= 8 layers (named in the error); a gguf run's inert tiny section does not block loading."""
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_config("tiny", ["target.tiny.num_hidden_layers=4"])
    cfg = load_config("smollm2-demo", ["target.tiny.num_hidden_layers=4"])
    assert cfg.target.kind == "gguf" and cfg.target.tiny.num_hidden_layers == 4
