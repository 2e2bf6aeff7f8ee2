"""Operational config fields (config_base.Operational) stay out of stage keys; every other field is in them.

Each test walks every field of a stage's config section (no hand-kept list), changes it to another valid value
and computes the stage's real key over fake input manifests (a manifest naming no outputs is complete).
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from eagle3.config import RunConfig, load_config
from eagle3.config_base import operational_fields, unset_added_fields
from eagle3.run.layout import run_layout
from eagle3.run.registry import get_stage

FAKE_FINGERPRINT = "fake-target-fingerprint"


def _choices(annotation: Any) -> list[Any]:
    """Literal values and one sample per plain type of an annotation (unions and Annotated unpacked)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return list(args)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [c for a in (args[:1] if origin is typing.Annotated else args) for c in _choices(a)]
    samples = {bool: [True, False], int: [1, 2, 3], float: [0.25, 0.5], str: ["cpu", "x"], type(None): [None]}
    return samples.get(annotation, [])


def _other_value(section: BaseModel, name: str) -> Any:
    """A valid value of ``section.name`` different from the current one (a nested section: one field changed)."""
    value = getattr(section, name)
    if isinstance(value, BaseModel):
        for sub in type(value).model_fields:
            try:
                return value.model_copy(update={sub: _other_value(value, sub)})
            except LookupError:
                continue
    candidates = _choices(type(section).model_fields[name].annotation)
    if isinstance(value, bool):
        candidates.insert(0, not value)
    elif isinstance(value, (int, float)):
        candidates[:0] = [value + 1, value * 2, value / 2]
    elif isinstance(value, (list, tuple)):
        candidates[:0] = [type(value)([*value, *value[-1:]]) if value else ["x"], type(value)(reversed(value))]
    elif isinstance(value, str):
        candidates.append(value + "-changed")
    for candidate in candidates:
        if candidate == value:
            continue
        try:
            type(section).model_validate({**section.model_dump(), name: candidate})
        except ValidationError:
            continue
        return candidate
    raise LookupError(f"no other valid value found for {type(section).__name__}.{name} = {value!r}")


def _fake_manifests(cfg: RunConfig) -> None:
    """A complete-looking manifest (no outputs) for every stage a data, capture or train key reads."""
    layout = run_layout(cfg)
    for stage in ("synthesize", "merge", "regenerate", "tokenize", "vocab", "capture"):
        path = get_stage(stage).manifest(layout.root)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"stage": stage, "key": f"fake-{stage}-key", "outputs": {}}))


def _fake_spec(cfg: RunConfig):
    from eagle3.features.spec import FeatureSpec

    return FeatureSpec(
        target_name=cfg.target.name,
        target_fingerprint=FAKE_FINGERPRINT,
        hidden_size=8,
        num_layers=4,
        vocab_size=64,
        aux_layer_ids=[1, 2, 3],
        max_len=64,
        chat_template_hash="fake-template-hash",
        backend="hf",
    )


def _key(cfg: RunConfig, stage: str) -> str:
    """The stage's real key, with a fake target fingerprint and spec (no target is prepared)."""
    if stage == "capture":
        from eagle3.features.capture import capture_key

        return capture_key(cfg, _fake_spec(cfg))
    if stage == "train":
        from eagle3.train.build import stage_key_for

        fake_inputs = types.SimpleNamespace(spec=_fake_spec(cfg), features_dir=run_layout(cfg).features)
        return stage_key_for(cfg, fake_inputs)
    module = get_stage(stage).module
    return module.key(cfg) if stage == "merge" else module.key(cfg, fp=FAKE_FINGERPRINT)


@pytest.mark.parametrize("stage", ["regenerate", "tokenize", "vocab", "capture", "train"])
def test_operational_fields_leave_the_stage_key_alone_and_the_others_change_it(tmp_path, stage):
    """For every field of the stage's section: the key changes exactly when the field is not operational."""
    cfg = load_config("tiny", [f"run.workdir={tmp_path}"])
    _fake_manifests(cfg)
    section_name = get_stage(stage).section
    section = getattr(cfg, section_name)
    operational = operational_fields(type(section))
    base = _key(cfg, stage)
    unchanged, changed = [], []
    for name in type(section).model_fields:
        edited = section.model_copy(update={name: _other_value(section, name)})
        key = _key(cfg.model_copy(update={section_name: edited}), stage)
        (unchanged if key == base else changed).append(name)
    assert sorted(unchanged) == sorted(operational), f"{section_name}: fields that left the key alone"
    assert len(changed) == len(type(section).model_fields) - len(operational)


def test_the_sections_with_operational_fields_declare_them():
    """The mechanism is in use: capture, train and regenerate each declare operational fields (e.g. num_slices)."""
    from eagle3.config import CaptureConfig, RegenerateConfig, TrainConfig

    assert "num_slices" in operational_fields(CaptureConfig) and "num_slices" in operational_fields(RegenerateConfig)
    assert {"device", "select", "nnodes"} <= operational_fields(TrainConfig)
    assert "lr" not in operational_fields(TrainConfig) and "tokens_per_shard" not in operational_fields(CaptureConfig)


def test_operational_fields_are_marked_in_the_json_schema():
    """The UI's form schema carries the mark, so a field's role is visible where it is edited."""
    schema = RunConfig.model_json_schema()
    capture = schema["$defs"]["CaptureConfig"]["properties"]
    assert capture["num_slices"].get("operational") is True and "operational" not in capture["tokens_per_shard"]


def test_stage_keys_need_no_hand_list(tmp_path):
    """No module keeps its own list of operational fields any more (one declaration, in the config)."""
    root = Path(__file__).resolve().parents[2]
    hits = [str(p.relative_to(root)) for p in (root / "eagle3").rglob("*.py") if "OPERATIONAL_KNOBS" in p.read_text()]
    assert hits == []


def test_added_fields_at_their_default_leave_keys_as_before_the_field_existed():
    """A field declared with config_base.Added is hashed only once it leaves its default, so runs keyed before it
    existed (regenerate.straggler_rows) keep their stage keys after an upgrade."""
    from eagle3.config import RegenerateConfig
    from eagle3.config_base import key_fields, unset_added_fields

    regen = RegenerateConfig(batch_size_conversations=8)
    added = {"straggler_rows", "compile_dynamic", "cut_loops", "loop_stop_tokens"}
    before = regen.model_dump(mode="json", exclude=set(operational_fields(RegenerateConfig)) | added)
    assert unset_added_fields(regen) == added
    assert key_fields(regen) == before
    assert key_fields(regen.model_copy(update={"straggler_rows": 2})) == {**before, "straggler_rows": 2}
    assert key_fields(regen.model_copy(update={"compile_dynamic": True})) == {**before, "compile_dynamic": True}
    assert key_fields(regen.model_copy(update={"cut_loops": True})) == {**before, "cut_loops": True}


# ------------------------------------------------- train: an operational field changes no byte training writes

TRAIN_OVERRIDES = [
    "train.tokens_per_row=96",
    "train.lr=1e-3",
    "train.max_steps=4",
    "train.warmup_steps=0",
    "train.eval_every_steps=1",
    "train.checkpoint_every_steps=2",
    "train.keep_checkpoints=2",
    "train.progress_every_s=0",
    "train.device=cpu",
    "drafter.ttt_steps=2",
]


def _train_values(section: BaseModel, name: str) -> list[Any]:
    """Other valid values of a train field to train with: _other_value's, plus 0 / False where valid (0 switches
    some features off, e.g. loss_chunk_tokens=0 is the plain log_softmax loss)."""
    value, values = getattr(section, name), [_other_value(section, name)]
    for extra in (0, False):
        if type(extra) is type(value) and extra != value and extra not in values:
            try:
                type(section).model_validate({**section.model_dump(), name: extra})
            except ValidationError:
                continue
            values.append(extra)
    return values


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _train_outcome(src: Path, dst: Path, update: dict[str, Any]) -> dict[str, Any]:
    """Train a copy of the synthetic run ``src`` in ``dst`` with train fields ``update``: what an export can ship
    (the final and the best checkpoint's weight bytes, the best step)."""
    from eagle3.train.loop import train
    from tests.unit.test_train_helpers import copy_run, load_run_config

    cfg = load_run_config(copy_run(src, dst, "syn", []))
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update=update)})
    assert train(cfg).status == "done"
    manifest = json.loads((cfg.run_dir / "train" / "train.manifest.json").read_text())
    train_dir, stats = cfg.run_dir / "train", manifest["stats"]
    return {
        "final": _sha(train_dir / manifest["outputs"]["model"]["path"]),
        "best_step": stats["best_step"],
        "best": _sha(train_dir / stats["best_checkpoint"] / "model.safetensors"),
    }


@pytest.fixture(scope="module")
def synthetic_inputs(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """A 4-step synthetic run's inputs (tiny preset, validated every step) and the outcome of training it as is."""
    from tests.unit.test_train_helpers import synthetic_run

    src = synthetic_run(tmp_path_factory.mktemp("op-src") / "runs", TRAIN_OVERRIDES).parents[1]
    return src, _train_outcome(src, tmp_path_factory.mktemp("op-base") / "runs", {})


def _train_operational() -> list[str]:
    from eagle3.config import TrainConfig

    return sorted(operational_fields(TrainConfig))


@pytest.mark.parametrize("name", _train_operational())
def test_each_operational_train_field_changes_no_trained_byte(tmp_path, synthetic_inputs, name):
    """Train twice (the synthetic tiny run, on the CPU) with the field at another value: the final and the best
    checkpoint's weights are the same bytes and the best step the same, so leaving the field out of the train key
    mixes nothing on a resume or rerun. (Fields that act only on CUDA or online are inert here by construction.)"""
    src, base = synthetic_inputs
    section = load_config("tiny", TRAIN_OVERRIDES).train
    for i, value in enumerate(_train_values(section, name)):
        assert _train_outcome(src, tmp_path / f"v{i}" / "runs", {name: value}) == base, f"train.{name}={value!r}"


def test_train_fields_that_change_what_training_writes_are_keyed_only_once_set():
    """eval_every_steps (which step is best) and loss_chunk_tokens (the loss's rounding) change the trained bytes
    (test above): they enter the train key once off their default, so keys of runs at the default stay valid."""
    from eagle3.config import TrainConfig
    from eagle3.config_base import key_fields

    train = TrainConfig()
    base = key_fields(train)
    assert {"eval_every_steps", "loss_chunk_tokens"} <= unset_added_fields(train) and "eval_every_steps" not in base
    assert key_fields(train.model_copy(update={"eval_every_steps": 5})) == {**base, "eval_every_steps": 5}
    assert key_fields(train.model_copy(update={"loss_chunk_tokens": 0})) == {**base, "loss_chunk_tokens": 0}
