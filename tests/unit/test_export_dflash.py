"""The DFlash export: round trip, config golden fields, the strict tensor and config checks.

SGLang's own class loading these exports: tests/unit/test_export_dflash_load.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.drafter.dflash import DFlashDrafter, export_state_dict
from eagle3.drafter.functional import Llama3RopeScaling
from eagle3.export.checks import ExportError
from eagle3.export.dflash import check_dflash_export, dflash_config, dflash_dims, dflash_tensor_specs, export_dflash
from tests.unit.test_dflash_model import random_dflash, tiny_dflash_dims

TARGET_LAYER_IDS, NUM_TARGET_LAYERS = [1, 3, 5], 8


def export(
    tmp_path: Path, drafter: DFlashDrafter | None = None, dtype: torch.dtype = torch.float32, **kwargs
) -> tuple[Path, DFlashDrafter]:
    drafter = drafter or random_dflash(tiny_dflash_dims())
    out = export_dflash(
        export_state_dict(drafter),
        drafter.dims,
        TARGET_LAYER_IDS,
        NUM_TARGET_LAYERS,
        tmp_path / "dflash",
        dtype,
        **kwargs,
    )
    return out, drafter


def test_round_trip_gives_identical_tensors_and_dims(tmp_path):
    out, drafter = export(tmp_path)
    tensors = load_file(str(out / "model.safetensors"))
    ours = export_state_dict(drafter)
    assert set(tensors) == set(ours) == set(dflash_tensor_specs(drafter.dims, torch.float32))
    for name, tensor in ours.items():
        assert torch.equal(tensors[name], tensor), name
    dims, ids, num_target, dtype = dflash_dims(json.loads((out / "config.json").read_text()), out)
    assert (dims, ids, num_target, dtype) == (drafter.dims, TARGET_LAYER_IDS, NUM_TARGET_LAYERS, torch.float32)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "eagle3_export.json", "model.safetensors"]


def test_config_golden_fields(tmp_path):
    """What SGLang and the reference read: class, block, layers, mask id, non-causal full attention, no head."""
    scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    drafter = random_dflash(tiny_dflash_dims(layers=2, block_size=16, rope_scaling=scaling))
    out, _ = export(tmp_path, drafter, torch.bfloat16, mask_token="<|mask|>")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {
        "block_size": 16,
        "target_layer_ids": [1, 3, 5],
        "mask_token_id": 63,
        "mask_token": "<|mask|>",
    }
    assert (cfg["block_size"], cfg["num_target_layers"], cfg["num_hidden_layers"]) == (16, 8, 2)
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["is_causal"] is False
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "bfloat16" and cfg["hidden_act"] == "silu"
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    specs = dflash_tensor_specs(drafter.dims, torch.bfloat16)
    assert not any("embed" in k or "lm_head" in k for k in specs)
    assert specs["fc.weight"] == ((32, 96), torch.bfloat16)
    assert specs["layers.1.self_attn.k_norm.weight"] == ((8,), torch.bfloat16)
    assert specs["layers.0.self_attn.k_proj.weight"] == ((16, 32), torch.bfloat16)
    assert len(specs) == 3 + 11 * 2


def rewrite_weights(export_dir: Path, edit) -> None:
    tensors = load_file(str(export_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(export_dir / "model.safetensors"))


def _rename(old: str, new: str):
    return lambda t: t.__setitem__(new, t.pop(old))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda t: t.pop("hidden_norm.weight"), r"missing keys \['hidden_norm.weight'\]"),
        (lambda t: t.__setitem__("lm_head.weight", torch.zeros(64, 32)), r"unexpected keys \['lm_head.weight'\]"),
        (_rename("layers.0.mlp.up_proj.weight", "layers.0.mlp.upproj.weight"), r"missing keys .*up_proj.*upproj"),
        (
            lambda t: t.__setitem__("fc.weight", torch.zeros(32, 64)),
            r"fc.weight: shape \[32, 64\], expected \[32, 96\]",
        ),
        (lambda t: t.__setitem__("norm.weight", t["norm.weight"].half()), r"norm.weight: dtype float16"),
        (lambda t: t["layers.1.self_attn.q_norm.weight"].__setitem__(0, float("nan")), r"non-finite.*q_norm"),
    ],
)
def test_strict_check_names_the_bad_tensor(tmp_path, edit, needle):
    out, _ = export(tmp_path)
    rewrite_weights(out, edit)
    with pytest.raises(ExportError, match=needle):
        check_dflash_export(out)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("architectures", ["LlamaForCausalLMEagle3"], "architectures"),
        ("layer_types", ["full_attention", "sliding_attention"], "layer_types"),
        ("is_causal", True, "is_causal"),
        ("num_target_layers", None, "num_target_layers must be a positive int"),
        ("block_size", 8, "block_size 8 and dflash_config.block_size 4 differ"),
        ("dflash_config.target_layer_ids", [5, 3, 1], "ascending"),
        ("dflash_config.target_layer_ids", [1, 3, 8], r"must lie in \[0, 8\)"),
        ("dflash_config.mask_token_id", None, "mask_token_id must be an int"),
        ("dflash_config.mask_token_id", 64, "mask_token_id must be an int in"),
        ("dflash_config.selector_rank", 256, r"keys \['selector_rank'\]"),
        ("tie_word_embeddings", True, "tie_word_embeddings must be false"),
    ],
)
def test_strict_check_refuses_bad_config_fields(tmp_path, field, value, needle):
    out, _ = export(tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    holder, key = (cfg["dflash_config"], field.split(".")[1]) if "." in field else (cfg, field)
    if value is None:
        holder.pop(key)
    else:
        holder[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=needle):
        check_dflash_export(out)


def test_bad_weights_and_ids_are_refused_before_anything_is_written(tmp_path):
    drafter = random_dflash(tiny_dflash_dims())
    weights = export_state_dict(drafter)
    weights["norm.weight"] = weights["norm.weight"].clone()
    weights["norm.weight"][3] = float("inf")
    with pytest.raises(ExportError, match="non-finite.*norm.weight"):
        export_dflash(weights, drafter.dims, TARGET_LAYER_IDS, NUM_TARGET_LAYERS, tmp_path / "a", torch.float32)
    big = export_state_dict(drafter)
    big["fc.weight"] = big["fc.weight"] * 1e6  # beyond float16
    with pytest.raises(ExportError, match=r"\(as float16\): 1 non-finite tensors .*: fc.weight"):
        export_dflash(big, drafter.dims, TARGET_LAYER_IDS, NUM_TARGET_LAYERS, tmp_path / "b", torch.float16)
    with pytest.raises(ExportError, match="2 target_layer_ids .* reads 3 features"):
        dflash_config(drafter.dims, [1, 3], NUM_TARGET_LAYERS, torch.float32)
    assert not any(tmp_path.iterdir())


def test_bf16_export_holds_the_rounded_weights(tmp_path):
    out, drafter = export(tmp_path, dtype=torch.bfloat16)
    tensors = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert torch.equal(
        tensors["layers.0.self_attn.q_proj.weight"], drafter.layers[0].self_attn.q_proj.weight.detach().bfloat16()
    )
    check_dflash_export(out)
