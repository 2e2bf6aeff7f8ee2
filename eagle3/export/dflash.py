"""The DFlash layout (SGLang's ``DFlashDraftModel``, the z-lab reference checkpoints): write, check, read back.

config.json: ``architectures: [DFlashDraftModel]``, ``model_type: qwen3`` (as the published DFlash drafts; SGLang
picks the class from ``architectures``), the decoder fields, ``layer_types`` all ``full_attention`` and
``is_causal: false`` (SGLang then builds ENCODER_ONLY attention: no causal mask inside the block), top-level
``block_size`` and ``num_target_layers``, and ``dflash_config`` {block_size, target_layer_ids, mask_token_id[,
mask_token]}. Weights (model.safetensors): ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and per layer
``layers.i.{input_layernorm, post_attention_layernorm}.weight``, ``layers.i.self_attn.{q,k,v,o}_proj.weight``,
``layers.i.self_attn.{q,k}_norm.weight``, ``layers.i.mlp.{gate,up,down}_proj.weight``; no embeddings and no
lm_head (SGLang uses the target's). SGLang's DFlashDraftModel.load_weights silently ignores names it does not
know, so ``check_dflash_export`` demands the exact tensor set, shapes, dtypes and finite values, and refuses
config fields that would make SGLang build a different model. Sources and semantics: docs/dflash.md.

Why each config field (SGLang python/sglang/srt/speculative/dflash_utils.py parse_dflash_draft_config, SGLang
0.5.16 and 0.5.23):
  num_target_layers  0.5.16's DFlashDraftModel.__init__ checks target_layer_ids against it and falls back to the
                     DRAFT's layer count when it is absent, refusing any id >= num_hidden_layers.
  mask_token_id      without it SGLang looks "<|MASK|>" up in the tokenizer and may add it, giving an id past the
                     target's embedding rows, which it refuses (DFlashWorkerV2._resolve_mask_token_id).
  target_layer_ids   strictly ascending: SGLang's target concatenates the captured layers in layer order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3.drafter.dflash import DFlashDims, DFlashDrafter
from eagle3.export.checks import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportError,
    TensorSpec,
    check_finite,
    check_finite_file,
    compare_tensors,
    dtype_from_config,
    dtype_name,
    header_specs,
    read_json,
)
from eagle3.export.folder import write_folder
from eagle3.target.tensors import rope_settings

DFLASH_ARCHITECTURE = "DFlashDraftModel"
DFLASH_MODEL_TYPE = "qwen3"
DFLASH_CONFIG_KEYS = {"block_size", "target_layer_ids", "mask_token_id", "mask_token"}
"""What we write into dflash_config. Any other key (SGLang 0.5.23 knows conv_kernel_size, selector_rank,
projector_type, attention_sink_bias, attention_value_scale, output_multiplier, final_logit_softcapping, ...) asks
SGLang for a model this drafter is not, so the check refuses it."""
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


def dflash_tensor_specs(dims: DFlashDims, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Every tensor of the DFlash layout: name -> (shape, dtype)."""
    h, inter, hd = dims.hidden_size, dims.intermediate_size, dims.head_dim
    q_out, kv_out = dims.num_attention_heads * hd, dims.num_key_value_heads * hd
    specs: dict[str, TensorSpec] = {
        "fc.weight": ((h, dims.num_context_features * h), dtype),
        "hidden_norm.weight": ((h,), dtype),
        "norm.weight": ((h,), dtype),
    }
    for i in range(dims.num_hidden_layers):
        layer, attn, mlp = f"layers.{i}", f"layers.{i}.self_attn", f"layers.{i}.mlp"
        specs.update({f"{layer}.{n}.weight": ((h,), dtype) for n in LAYER_NORMS})
        specs.update(
            {
                f"{attn}.q_proj.weight": ((q_out, h), dtype),
                f"{attn}.k_proj.weight": ((kv_out, h), dtype),
                f"{attn}.v_proj.weight": ((kv_out, h), dtype),
                f"{attn}.o_proj.weight": ((h, q_out), dtype),
                f"{attn}.q_norm.weight": ((hd,), dtype),
                f"{attn}.k_norm.weight": ((hd,), dtype),
                f"{mlp}.gate_proj.weight": ((inter, h), dtype),
                f"{mlp}.up_proj.weight": ((inter, h), dtype),
                f"{mlp}.down_proj.weight": ((h, inter), dtype),
            }
        )
    return specs


def _rope_scaling_field(dims: DFlashDims) -> dict[str, Any] | None:
    s = dims.rope_scaling
    return (
        None
        if s is None
        else {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    )


def _layer_id_problems(ids: Any, num_target_layers: Any, num_features: int | None) -> list[str]:
    if not isinstance(num_target_layers, int) or isinstance(num_target_layers, bool) or num_target_layers < 1:
        return [f"num_target_layers must be a positive int, got {num_target_layers!r}"]
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        return [f"target_layer_ids must be a non-empty list of ints, got {ids!r}"]
    problems = []
    if ids != sorted(set(ids)):
        problems.append(
            f"target_layer_ids {ids} must be distinct and ascending (SGLang's target concatenates the "
            f"captured layers in layer order)"
        )
    if ids[0] < 0 or ids[-1] >= num_target_layers:
        problems.append(f"target_layer_ids {ids} must lie in [0, {num_target_layers}) (num_target_layers)")
    if num_features is not None and len(ids) != num_features:
        problems.append(f"{len(ids)} target_layer_ids {ids} for a drafter whose fc reads {num_features} features")
    return problems


def dflash_config(
    dims: DFlashDims,
    target_layer_ids: list[int],
    num_target_layers: int,
    dtype: torch.dtype,
    mask_token: str | None = None,
) -> dict[str, Any]:
    """config.json of the DFlash layout. ``target_layer_ids``: output-of-layer ids (HF hidden_states[j + 1]), our
    convention and SGLang's and the reference's for DFlash (SGLang's Llama target captures before layer j + 1).
    ``mask_token``: the mask token's text, written only when given (SGLang then checks it against the tokenizer)."""
    problems = _layer_id_problems(list(target_layer_ids), num_target_layers, dims.num_context_features)
    if problems:
        raise ExportError("; ".join(problems))
    layers = dims.num_hidden_layers
    dflash: dict[str, Any] = {
        "block_size": dims.block_size,
        "target_layer_ids": [int(i) for i in target_layer_ids],
        "mask_token_id": dims.mask_token_id,
    }
    if mask_token is not None:
        dflash["mask_token"] = mask_token
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": DFLASH_MODEL_TYPE,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_key_value_heads,
        "head_dim": dims.head_dim,
        "num_hidden_layers": layers,
        "hidden_act": "silu",
        "rms_norm_eps": dims.rms_norm_eps,
        "rope_theta": dims.rope_theta,
        "rope_scaling": _rope_scaling_field(dims),
        "max_position_embeddings": dims.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": dims.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name(dtype),
        "layer_types": ["full_attention"] * layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "is_causal": False,
        "block_size": dims.block_size,
        "num_target_layers": int(num_target_layers),
        "dflash_config": dflash,
    }


def _config_problems(cfg: dict[str, Any]) -> list[str]:
    """Fields that would make SGLang build or run another model than ours (or refuse to)."""
    problems = []
    if cfg.get("architectures") != [DFLASH_ARCHITECTURE]:
        problems.append(f"architectures is {cfg.get('architectures')!r}, expected [{DFLASH_ARCHITECTURE!r}]")
    layers = cfg.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        problems.append(f"num_hidden_layers must be a positive int, got {layers!r}")
    elif cfg.get("layer_types") != ["full_attention"] * layers:
        problems.append(
            f"layer_types must be {layers} x 'full_attention', got {cfg.get('layer_types')!r} (SGLang runs "
            f"sliding_attention layers causally, which this drafter does not)"
        )
    if cfg.get("is_causal", False) is not False:
        problems.append("is_causal must be false or absent (SGLang 0.5.23 would mask the block causally)")
    if cfg.get("use_sliding_window", False) is not False:
        problems.append("use_sliding_window must be false")
    if cfg.get("hidden_act") != "silu":
        problems.append(f"hidden_act is {cfg.get('hidden_act')!r}, expected 'silu'")
    for flag in ("attention_bias", "tie_word_embeddings", "use_gemma_norm"):
        if cfg.get(flag, False) is not False:
            problems.append(f"{flag} must be false")
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        return [*problems, "dflash_config is missing"]
    unknown = sorted(set(dflash) - DFLASH_CONFIG_KEYS)
    if unknown:
        problems.append(f"dflash_config has keys {unknown} this drafter does not implement")
    block = dflash.get("block_size")
    if not isinstance(block, int) or block < 2:
        problems.append(f"dflash_config.block_size must be an int >= 2, got {block!r}")
    elif cfg.get("block_size", block) != block:
        problems.append(f"block_size {cfg.get('block_size')!r} and dflash_config.block_size {block} differ")
    mask_id, vocab = dflash.get("mask_token_id"), cfg.get("vocab_size")
    if (
        not isinstance(mask_id, int)
        or isinstance(mask_id, bool)
        or not isinstance(vocab, int)
        or not 0 <= mask_id < vocab
    ):
        problems.append(
            f"dflash_config.mask_token_id must be an int in [0, vocab_size {vocab!r}), got {mask_id!r} "
            f"(without it SGLang may add a mask token past the target's embedding rows)"
        )
    if "mask_token" in dflash and not (isinstance(dflash["mask_token"], str) and dflash["mask_token"]):
        problems.append(f"dflash_config.mask_token must be a non-empty string, got {dflash['mask_token']!r}")
    # SGLang reads dflash_config first, then the top level: a top-level copy that disagrees misleads a reader.
    for key in ("target_layer_ids", "mask_token_id", "mask_token"):
        if key in cfg and cfg[key] != dflash.get(key):
            problems.append(f"top-level {key} {cfg[key]!r} differs from dflash_config.{key} {dflash.get(key)!r}")
    return problems + _layer_id_problems(dflash.get("target_layer_ids"), cfg.get("num_target_layers"), None)


def dflash_dims(cfg: dict[str, Any], where: Path) -> tuple[DFlashDims, list[int], int, torch.dtype]:
    """(dims, target layer ids, num_target_layers, weight dtype) of a DFlash export's config.json, checked."""
    problems = _config_problems(cfg)
    if problems:
        raise ExportError(f"{where}: " + "; ".join(problems))
    dflash = cfg["dflash_config"]
    ids = [int(i) for i in dflash["target_layer_ids"]]
    try:
        theta, scaling = rope_settings(cfg)
        dims = DFlashDims(
            hidden_size=int(cfg["hidden_size"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg["num_key_value_heads"]),
            head_dim=int(cfg["head_dim"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=theta,
            rope_scaling=scaling,
            vocab_size=int(cfg["vocab_size"]),
            num_context_features=len(ids),
            block_size=int(dflash["block_size"]),
            mask_token_id=int(dflash["mask_token_id"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        )
    except KeyError as exc:
        raise ExportError(f"{where}: the field {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{where}: {exc}") from None
    return dims, ids, int(cfg["num_target_layers"]), dtype_from_config(cfg, where)


def check_dflash_export(export_dir: Path) -> None:
    """Raise ExportError unless the folder is a DFlash drafter SGLang loads as ours: config fields, the exact
    tensor set, shapes, dtypes, finite values."""
    config = Path(export_dir) / CONFIG_FILE
    dims, _, _, dtype = dflash_dims(read_json(config), config)
    weights = config.with_name(WEIGHTS_FILE)
    compare_tensors(header_specs(weights), dflash_tensor_specs(dims, dtype), str(weights))
    check_finite_file(weights)


def cast_dflash_weights(weights: dict[str, Tensor], specs: dict[str, TensorSpec], where: str) -> dict[str, Tensor]:
    """The tensors to write, in the spec's dtype; the names and shapes are checked first (a typo is not written),
    the cast values after (a NaN, an inf, or a weight the dtype cannot hold is not written either)."""
    compare_tensors(
        {k: (tuple(v.shape), specs[k][1] if k in specs else v.dtype) for k, v in weights.items()}, specs, where
    )
    out = {k: weights[k].detach().to("cpu", specs[k][1]).contiguous() for k in specs}
    check_finite(out, f"{where} (as {dtype_name(next(iter(specs.values()))[1])})")
    return out


def export_dflash(
    weights: dict[str, Tensor],
    dims: DFlashDims,
    target_layer_ids: list[int],
    num_target_layers: int,
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    mask_token: str | None = None,
    run_config: dict[str, Any] | None = None,
    source: str | None = None,
    selection: dict[str, Any] | None = None,
) -> Path:
    """Write the DFlash layout of a drafter (eagle3.drafter.dflash.export_state_dict's names) and check it."""
    from eagle3.features.spec import AUX_CONVENTION_TEXT

    config = dflash_config(dims, target_layer_ids, num_target_layers, dtype, mask_token)
    tensors = cast_dflash_weights(weights, dflash_tensor_specs(dims, dtype), "weights to export")
    info = {
        "format": "dflash",
        "dtype": dtype_name(dtype),
        "target_layer_ids": [int(i) for i in target_layer_ids],
        "aux_convention_text": AUX_CONVENTION_TEXT,
        "block_size": dims.block_size,
        "mask_token_id": dims.mask_token_id,
        "source": source,
        "selection": selection,
    }
    out = write_folder(Path(out_dir), config, tensors, info, run_config)
    check_dflash_export(out)
    return out


# ------------------------------------------------------------------------------------------------ loading


@dataclass
class LoadedDFlash:
    """A DFlash drafter read back from its export, ready to draft blocks."""

    drafter: DFlashDrafter  # eval mode, the target's embeddings and lm_head loaded
    target_layer_ids: list[int]  # ascending output-of-layer ids: the target states it reads, in fc's order
    config: dict[str, Any]  # the export's config.json


def load_dflash_export(
    export_dir: Path, target_dir: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> LoadedDFlash:
    """Check a DFlash export, then build our drafter from it with the target's embeddings and lm_head (SGLang
    shares the target's at serving time)."""
    from safetensors.torch import load_file

    from eagle3.target.load import EMBED_TENSOR, read_tensor
    from eagle3.target.tensors import load_target_lm_head

    export_dir = Path(export_dir)
    check_dflash_export(export_dir)
    config = read_json(export_dir / CONFIG_FILE)
    dims, ids, _, _ = dflash_dims(config, export_dir / CONFIG_FILE)
    tensors = {k: v.float() for k, v in load_file(str(export_dir / WEIGHTS_FILE)).items()}
    tensors["embed_tokens.weight"] = read_tensor(Path(target_dir), EMBED_TENSOR).float()  # [V, H]
    tensors["lm_head.weight"] = load_target_lm_head(target_dir).float()  # [V, H]
    drafter = DFlashDrafter(dims)
    drafter.load_state_dict(tensors, strict=True)  # the check above pinned the names and shapes
    return LoadedDFlash(drafter.to(device=device, dtype=dtype).eval(), ids, config)
