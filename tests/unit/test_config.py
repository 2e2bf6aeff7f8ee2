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


@pytest.mark.parametrize(
    "preset", ["tiny", "smollm2-demo", "smollm2-curve", "smollm2-quality", "smollm2-40m", "llama31-8b", "kimi-k25"]
)
def test_presets_validate(preset):
    """Each shipped preset is a valid RunConfig."""
    assert preset in list_presets()
    assert isinstance(load_config(preset), RunConfig)


def test_a_preset_extending_another_changes_only_what_it_states(tmp_path):
    """``base``: the named preset's settings with this file's merged over them, sections key by key, lists replaced."""
    child = tmp_path / "child.yaml"
    child.write_text("base: smollm2-demo\nrun:\n  name: child\ntrain:\n  lr: 2.0e-4\nevaluate:\n  datasets: [gsm8k]\n")
    cfg, base = load_config(str(child), ["train.num_epochs=3"]), load_config("smollm2-demo")
    assert (cfg.run.name, cfg.train.lr, cfg.train.num_epochs, cfg.evaluate.datasets) == ("child", 2e-4, 3, ["gsm8k"])
    assert cfg.train.tokens_per_row == base.train.tokens_per_row and cfg.data == base.data
    assert cfg.run.workdir == base.run.workdir  # a section's unstated keys come from the base


def test_presets_extending_each_other_in_a_cycle_are_refused(tmp_path):
    """A ``base`` cycle is a ConfigError naming the presets in it, not a recursion error."""
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"base: {b}\n")
    b.write_text(f"base: {a}\n")
    with pytest.raises(ConfigError, match=r"cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(str(a))
    a.write_text("base: [tiny]\n")
    with pytest.raises(ConfigError, match="base must name a preset"):
        load_config(str(a))


def test_the_quality_preset_is_the_curve_recipe_capped_at_20m_tokens_at_the_sweeps_best_lr():
    """smollm2-quality = smollm2-curve (data, recipe, evaluation) under its own run name, on the first 20M tokens, at
    twice the curve's learning rate (the sweep's lr-x2) and with the feature cache that holds those tokens on the
    GPU."""
    quality, curve = load_config("smollm2-quality"), load_config("smollm2-curve")
    assert quality.run.name == "smollm2-quality" and quality.train.max_train_tokens == 20_000_000
    assert curve.train.max_train_tokens is None
    assert quality.train.lr == pytest.approx(2 * curve.train.lr)
    capped = curve.model_copy(
        update={
            "train": curve.train.model_copy(
                update={"max_train_tokens": 20_000_000, "lr": quality.train.lr, "feature_cache_gib": 96}
            )
        }
    )
    assert quality.model_copy(update={"run": curve.run}) == capped


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
    with pytest.raises(ConfigError, match=r"train\.learning_rate: unknown key; did you mean train\.lr\?"):
        load_config(str(bad))


@pytest.mark.parametrize(
    "override, guess",
    [
        ("train.learning_rate=1e-4", "train.lr"),  # an abbreviation: the initials of the words
        ("train.weight_decy=0.1", "train.weight_decay"),
        ("data.sources.0.max_record=5", "data.sources.0.max_records"),  # list index kept
        ("trian.lr=1e-4", "train"),  # an unknown section (codespell:ignore trian)
        ("data.lr=1e-4", "train.lr"),  # a known key in the wrong section
    ],
)
def test_unknown_key_says_did_you_mean_the_closest_field(override, guess):
    """An unknown key from an override names the key and the closest dotted field path of the config tree."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [override])
    bad = override.split("=")[0] if not override.startswith("trian") else "trian"  # codespell:ignore trian
    assert f"{bad}: unknown key; did you mean {guess}?" in str(err.value)


def test_unknown_key_far_from_every_field_has_no_guess():
    """A key like no field gets no "did you mean" (a wrong guess misleads)."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["zzzz.qqqq=1"])
    assert "zzzz: unknown key" in str(err.value) and "did you mean" not in str(err.value)


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


def _float_settings(model: BaseModel, path: tuple = ()):
    """(path, value) of every float-typed setting in a config instance, nested sections and lists of them too."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from _float_settings(value, (*path, name))
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            yield from _float_settings(value[0], (*path, name, 0))
        elif "float" in str(field.annotation) and "Literal" not in str(field.annotation):
            yield (*path, name), value


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_float_settings_are_config_errors_naming_the_field(bad):
    """inf, -inf and nan in any float setting of the tree (train.lr, adam_betas, ...) are refused, naming the field."""
    from eagle3.config import validate_config

    data = load_config("tiny").model_dump(mode="json")
    data["data"]["sources"] = [{"name": "gen", "format": "synthetic"}]  # its synthetic section holds floats too
    cfg = validate_config(data, "test")
    settings = list(_float_settings(cfg))
    assert len(settings) > 20 and ("train", "lr") in [p for p, _ in settings]
    for path, value in settings:
        data = cfg.model_dump(mode="json")
        parent = data
        for part in path[:-1]:
            parent = parent[part]
        parent[path[-1]] = [bad] * len(value) if isinstance(value, (tuple, list)) and value else bad
        with pytest.raises(ConfigError) as err:
            validate_config(data, "test")
        assert ".".join(map(str, path)) in str(err.value), path


def test_lr_inf_override_is_refused():
    """`--set train.lr=.inf` (YAML's infinity) is a config error naming train.lr."""
    with pytest.raises(ConfigError, match=r"train\.lr"):
        load_config("tiny", ["train.lr=.inf"])


def test_a_name_is_capped_in_utf8_bytes_not_characters():
    """Run names become path components: 30 four-byte characters (120 bytes) exceed the 100-byte cap."""
    with pytest.raises(ConfigError, match="1 to 100 bytes in UTF-8 \\(got 120\\)"):
        load_config("tiny", ["run.name=" + "\U0001f600" * 30])
    assert load_config("tiny", ["run.name=" + "\u00e9" * 50]).run.name == "\u00e9" * 50  # 100 bytes: allowed


@pytest.mark.parametrize("name", ["device", "compile"])
def test_a_setting_named_alike_in_several_sections_has_one_type(name):
    """Every field called ``name``, in whichever section, is declared with the same type (one name, one meaning)."""
    types_ = {str(field.annotation) for path, field in _all_fields(RunConfig) if path.rsplit(".", 1)[-1] == name}
    assert len(types_) == 1, f"{name}: {sorted(types_)}"


def test_only_a_stage_that_runs_in_one_process_takes_one_gpu_of_several():
    """cuda:N is a device of capture and regenerate; train and evaluate place their processes and refuse it."""
    cfg = load_config("tiny", ["capture.device=cuda:1", "regenerate.device=cuda:1"])
    assert (cfg.capture.device, cfg.regenerate.device) == ("cuda:1", "cuda:1")
    for section in ("train", "evaluate"):
        with pytest.raises(ConfigError, match=f"{section}.device takes auto, cpu or cuda, not 'cuda:1'"):
            load_config("tiny", [f"{section}.device=cuda:1"])


def test_serve_ngram_is_keyed_only_once_set_and_refuses_a_min_breadth_above_the_max():
    """serve.ngram* at their defaults leave the serve key as before; min BFS breadth > max is a config error."""
    from eagle3.config import section_dict

    assert not any(k.startswith("ngram") for k in section_dict(load_config("tiny", []), "serve")["serve"])
    on = section_dict(load_config("tiny", ["serve.ngram=true", "serve.ngram_max_bfs_breadth=4"]), "serve")["serve"]
    assert (on["ngram"], on["ngram_max_bfs_breadth"]) == (True, 4)
    with pytest.raises(ConfigError, match="ngram_min_bfs_breadth 5 exceeds ngram_max_bfs_breadth 4"):
        load_config("tiny", ["serve.ngram_min_bfs_breadth=5", "serve.ngram_max_bfs_breadth=4"])
