"""Renamed config keys (eagle3.config_renames): old names load with a one-line warning, and a run directory made
before a rename keeps its stage keys."""

from __future__ import annotations

import json
import warnings

import pytest

from eagle3.config import ConfigError, RunConfig, config_field_paths, load_config, section_dict, validate_config
from eagle3.config_renames import RENAMES, RenamedKeyWarning, default_of
from eagle3.run.registry import STAGES, get_stage
from tests.unit.test_stage_keys import GOLDEN, _run_dir

SAMPLES: dict[str, object] = {
    "capture.tokens_per_forward": 64,
    "train.tokens_per_row": 96,
    "server.python": "/opt/sglang/bin/python",
    "server.launch_module": "tests.fakes.sglang_server",
    "server.host": "127.0.0.2",
    "server.allow_remote_host": True,
    "server.api_key_env": "MY_SGLANG_KEY",
    "server.tp_size": 2,
    "server.attention_backend": "triton",
    "server.extra_args": ["--context-length", "4096"],
    "server.startup_timeout_s": 30.0,
}
"""A valid value of each renamed field that is not its default."""

DEPLOY_GOLDEN = {
    (): "291784d01cc8651631513791957670ed09a2710ccebe32d4a5532b7152219afe",
    (
        "serve.python=/opt/sg/python",
        "serve.extra_args=[--x]",
        "serve.tp_size=2",
    ): "4c7d42ea46bb6950dff9432a84e65286eac162302911bdc8291e49480c6377bd",
}
"""{serve overrides: deploy key} of tests/unit/test_stage_keys.py's tiny run, as the code before the server section
computed them (serve held the launch settings then)."""


def _sample(new: str) -> object:
    assert SAMPLES[new] != default_of(RunConfig, new)
    return SAMPLES[new]


def _get(cfg: RunConfig, path: str) -> object:
    node: object = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


def _old_named(doc: dict, renames: dict[str, str]) -> dict:
    """A config.json as the code before the renames wrote it: every renamed key back at its old place and name."""
    doc = json.loads(json.dumps(doc))
    for old, new in renames.items():
        *new_parents, new_leaf = new.split(".")
        node = doc
        for part in new_parents:
            node = node[part]
        value = node[new_leaf]
        *old_parents, old_leaf = old.split(".")
        node = doc
        for part in old_parents:
            node = node.setdefault(part, {})
        node[old_leaf] = value
    for new in set(renames.values()):
        *parents, leaf = new.split(".")
        node = doc
        for part in parents:
            node = node[part]
        del node[leaf]
    for section in [s for s, value in doc.items() if value == {}]:
        del doc[section]  # a section whose every field was renamed away did not exist
    return doc


def test_the_table_maps_unknown_old_keys_to_fields_of_the_tree():
    """Every new name is a field of RunConfig, and no old name is one (an old name would otherwise shadow a field)."""
    paths = set(config_field_paths())
    assert set(RENAMES.values()) <= paths and not set(RENAMES) & paths


@pytest.mark.parametrize("old", list(RENAMES))
def test_an_old_key_in_an_override_loads_under_its_new_name_with_one_warning(old):
    """--set old.key=value sets the new key and warns once, naming old -> new."""
    new = RENAMES[old]
    value = _sample(new)
    with pytest.warns(RenamedKeyWarning) as caught:
        cfg = load_config("tiny", [f"{old}={json.dumps(value)}"])
    assert _get(cfg, new) == value
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and f"{old} is now {new}" in messages[0] and "\n" not in messages[0]


@pytest.mark.parametrize("old", list(RENAMES))
def test_an_old_key_in_a_preset_file_loads_under_its_new_name(tmp_path, old):
    """A YAML preset written with an old key gives the same config as one written with the new key."""
    new = RENAMES[old]
    value = _sample(new)

    def preset(key: str) -> str:
        *parents, leaf = key.split(".")
        lines = [f"{'  ' * depth}{part}:" for depth, part in enumerate(parents)]
        path = tmp_path / f"{key}.yaml"
        path.write_text("base: tiny\n" + "\n".join([*lines, f"{'  ' * len(parents)}{leaf}: {json.dumps(value)}"]))
        return str(path)

    with pytest.warns(RenamedKeyWarning, match=f"{old} is now {new}"):
        old_cfg = load_config(preset(old))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RenamedKeyWarning)
        assert old_cfg == load_config(preset(new))


def test_new_names_load_without_a_warning():
    """The shipped presets use the new names only."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RenamedKeyWarning)
        for preset in ("tiny", "smollm2-demo", "smollm2-curve", "smollm2-sglang", "llama31-8b", "kimi-k25"):
            load_config(preset)


def test_the_key_of_a_renamed_field_hashes_its_old_name():
    """section_dict (what stage keys hash) names train.tokens_per_row max_tokens_per_batch, as keys made before did."""
    keyed = section_dict(load_config("tiny"), "train")["train"]
    assert keyed["max_tokens_per_batch"] == 512 and "tokens_per_row" not in keyed


@pytest.mark.parametrize("variant", ["tiny", "online"])
def test_a_run_saved_with_old_key_names_resumes_with_every_stage_key_unchanged(tmp_path, monkeypatch, variant):
    """A config.json written before the renames (old names, every field) loads, and every stage's key equals the key
    the run was made with (tests/unit/test_stage_keys.py's golden values): no stage runs again."""
    overrides = {"tiny": [], "online": ["train.features=online", "export.formats=[sglang]"]}[variant]
    cfg = _run_dir(tmp_path, monkeypatch, overrides)
    saved = cfg.run_dir / "config.json"
    saved.write_text(json.dumps(_old_named(cfg.model_dump(mode="json"), RENAMES), indent=2))
    assert "max_tokens_per_batch" in saved.read_text()
    with pytest.warns(RenamedKeyWarning):
        resumed = load_config(str(saved))
    assert resumed == cfg
    keys = {stage.name: get_stage(stage.name).key(resumed) for stage in STAGES}
    assert {k: v for k, v in keys.items() if k in GOLDEN[variant]} == GOLDEN[variant]


@pytest.mark.parametrize("overrides", list(DEPLOY_GOLDEN))
def test_a_run_saved_with_launch_settings_under_serve_keeps_its_deploy_key(tmp_path, monkeypatch, overrides):
    """serve.python, serve.extra_args, serve.tp_size (now server.*) in an old config.json: the deploy key is the one
    the run was made with."""
    new_names = [item.replace("serve.", "server.", 1) for item in overrides]
    cfg = _run_dir(tmp_path, monkeypatch, new_names)
    old = {k: v for k, v in RENAMES.items() if not k.startswith("capture.sglang.")}  # as a serve-only config said
    saved = cfg.run_dir / "config.json"
    saved.write_text(json.dumps(_old_named(cfg.model_dump(mode="json"), old)))
    with pytest.warns(RenamedKeyWarning):
        resumed = load_config(str(saved))
    assert resumed == cfg and get_stage("deploy").key(resumed) == DEPLOY_GOLDEN[overrides]


def test_capture_and_serve_settings_merge_into_the_server_section():
    """An old config's launch settings from capture.sglang and serve: a set value wins over a default, equal values
    are one; two different set values are an error naming both."""
    with pytest.warns(RenamedKeyWarning):
        cfg = RunConfig.model_validate(
            {
                "capture": {"sglang": {"python": "/a/python", "startup_timeout_s": 400}},
                "serve": {"python": "python", "startup_timeout_s": 400, "tp_size": 2},
            }
        )
    assert (cfg.server.python, cfg.server.startup_timeout_s, cfg.server.tp_size) == ("/a/python", 400, 2)
    with (
        pytest.warns(RenamedKeyWarning),
        pytest.raises(
            ConfigError, match="serve.python='/b/python', capture.sglang.python='/a/python' all set server.python"
        ),
    ):
        validate_config({"capture": {"sglang": {"python": "/a/python"}}, "serve": {"python": "/b/python"}}, "old")


def test_deploy_launches_its_servers_with_the_server_sections_settings():
    """Both deploy servers take python, module, extra args and backend from cfg.server; serve has none of its own."""
    from eagle3.deploy import server_specs

    cfg = load_config("tiny", ["server.python=/a/python", "server.extra_args=[--x]", "server.attention_backend=triton"])
    assert not hasattr(cfg.serve, "python") and not hasattr(cfg.serve, "extra_args")
    for spec in server_specs(cfg, "/m", "/d", None):
        assert (spec.python, spec.module, spec.extra_args[-1:], spec.attention_backend) == (
            "/a/python",
            cfg.server.launch_module,
            ("--x",),
            "triton",
        )


def test_an_older_configs_compile_bool_reads_as_the_switch_value_that_does_the_same():
    """train.compile was a bool: true (compiled on CUDA only) reads as on, which compiles on CUDA only, and false as
    off; the step compiles on CUDA for auto and on alike, never on a CPU."""
    import torch

    from eagle3.train.step import step_options_for

    saved = {"train": {"compile": True}}
    assert RunConfig.model_validate(saved).train.compile == "on"
    assert load_config("tiny", ["train.compile=false"]).train.compile == "off"
    backends = {
        (value, device): step_options_for(
            load_config("tiny", [f"train.compile={value}"]).train, torch.device(device)
        ).compile_backend
        for value in ("auto", '"on"', "off")
        for device in ("cpu", "cuda")
    }
    assert backends == {
        ("auto", "cpu"): None,
        ("auto", "cuda"): "inductor",
        ('"on"', "cpu"): None,
        ('"on"', "cuda"): "inductor",
        ("off", "cpu"): None,
        ("off", "cuda"): None,
    }
