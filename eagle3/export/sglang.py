"""The SGLang layout (SGLang's and vLLM's LlamaForCausalLMEagle3): write, check, and load back as our drafter."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3.drafter.model import DrafterDims, Eagle3Drafter
from eagle3.export.checks import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportError,
    TensorSpec,
    aux_id_warnings,
    aux_problems,
    check_finite_file,
    check_vocab_maps,
    compare_tensors,
    dims_from_llama_fields,
    dtype_from_config,
    header_specs,
    llama_fields,
    read_json,
    sglang_aux_ids,
)
from eagle3.export.folder import cast_weights, export_info, write_folder
from eagle3.target.tensors import load_target_weights

log = logging.getLogger("eagle3.export")

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
MIDLAYER_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")


def sglang_tensor_specs(dims: DrafterDims, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Every tensor of the SGLang layout: name -> (shape, dtype), from the drafter's sizes."""
    h, inter, vd, v = dims.hidden_size, dims.intermediate_size, dims.draft_vocab_size, dims.vocab_size
    q_out, kv_out = dims.num_attention_heads * dims.head_dim, dims.num_key_value_heads * dims.head_dim
    attn, mlp = "midlayer.self_attn", "midlayer.mlp"
    specs: dict[str, TensorSpec] = {
        "fc.weight": ((h, dims.num_aux * dims.target_hidden_size), dtype),
        **{f"midlayer.{n}.weight": ((h,), dtype) for n in MIDLAYER_NORMS},
        f"{attn}.q_proj.weight": ((q_out, 2 * h), dtype),
        f"{attn}.k_proj.weight": ((kv_out, 2 * h), dtype),
        f"{attn}.v_proj.weight": ((kv_out, 2 * h), dtype),
        f"{attn}.o_proj.weight": ((h, q_out), dtype),
        f"{mlp}.gate_proj.weight": ((inter, h), dtype),
        f"{mlp}.up_proj.weight": ((inter, h), dtype),
        f"{mlp}.down_proj.weight": ((h, inter), dtype),
        "norm.weight": ((h,), dtype),
        "lm_head.weight": ((vd, h), dtype),
        "d2t": ((vd,), torch.int64),
        "t2d": ((v,), torch.bool),  # d2t: target id = draft id + d2t[draft id]
    }
    if dims.target_hidden_size != dims.hidden_size:  # SGLang then keeps the draft's own table (set_embed skips it)
        specs["embed_tokens.weight"] = ((v, h), dtype)
    return specs


def sglang_config(dims: DrafterDims, aux_layer_ids: list[int], dtype: torch.dtype) -> dict[str, Any]:
    """config.json of the SGLang layout (aux ids given in OUR convention)."""
    if len(aux_layer_ids) != dims.num_aux:
        raise ExportError(
            f"{len(aux_layer_ids)} aux layer ids {aux_layer_ids} for a drafter whose fc reads {dims.num_aux} aux states"
        )
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        **llama_fields(dims, dtype),
        "draft_vocab_size": dims.draft_vocab_size,
        "target_hidden_size": dims.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_aux_ids(aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    }


def sglang_dims(cfg: dict[str, Any], where: Path) -> tuple[DrafterDims, list[int], torch.dtype]:
    """(dims, aux ids in OUR convention, weight dtype) of an SGLang export's config.json, checked."""
    problems = []
    if cfg.get("architectures") != [SGLANG_ARCHITECTURE]:
        problems.append(f"architectures is {cfg.get('architectures')!r}, expected [{SGLANG_ARCHITECTURE!r}]")
    if cfg.get("num_hidden_layers") != 1:
        problems.append(f"num_hidden_layers is {cfg.get('num_hidden_layers')!r}, expected 1")
    if cfg.get("tie_word_embeddings") is not False:
        problems.append("tie_word_embeddings must be false (SGLang would use the embeddings as lm_head)")
    if not isinstance(cfg.get("draft_vocab_size"), int):
        problems.append("draft_vocab_size is missing (SGLang would load the full target lm_head instead)")
    eagle = cfg.get("eagle_config") or {}
    field = "eagle_aux_hidden_state_layer_ids"
    problems += aux_problems(eagle.get(field), f"eagle_config.{field}")
    if eagle.get("use_aux_hidden_state") is not True:
        problems.append("eagle_config.use_aux_hidden_state must be true")
    if problems:
        raise ExportError(f"{where}: " + "; ".join(problems))
    aux = [int(i) for i in eagle[field]]  # SGLang ids are ours
    dims = dims_from_llama_fields(
        cfg, cfg["draft_vocab_size"], len(aux), cfg.get("target_hidden_size", cfg.get("hidden_size", 0)), where
    )
    return dims, aux, dtype_from_config(cfg, where)


def check_sglang_export(export_dir: Path) -> None:
    """Raise ExportError unless the folder is a loadable SGLang drafter: config fields, exact tensor set,
    shapes and dtypes, and a d2t/t2d pair that describe the same draft vocab."""
    config = Path(export_dir) / CONFIG_FILE
    dims, _, dtype = sglang_dims(read_json(config), config)
    weights = config.with_name(WEIGHTS_FILE)
    compare_tensors(header_specs(weights), sglang_tensor_specs(dims, dtype), str(weights))
    check_vocab_maps(weights)
    check_finite_file(weights)


def export_sglang(
    weights: dict[str, Tensor],
    dims: DrafterDims,
    d2t: Tensor,
    t2d: Tensor,
    aux_layer_ids: list[int],
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    run_config: dict[str, Any] | None = None,
    source: str | None = None,
    selection: dict[str, Any] | None = None,
) -> Path:
    """Write the SGLang layout of a drafter (weights under SGLang names, aux ids in OUR convention) and check it."""
    config = sglang_config(dims, aux_layer_ids, dtype)
    tensors = cast_weights(weights, sglang_tensor_specs(dims, dtype), d2t, t2d, "weights to export")
    for warning in aux_id_warnings(aux_layer_ids):
        log.warning("%s", warning)
    info = export_info(
        "sglang", aux_layer_ids, dtype, source=source, selection=selection, warnings=aux_id_warnings(aux_layer_ids)
    )
    out = write_folder(Path(out_dir), config, tensors, info, run_config)
    check_sglang_export(out)
    return out


# ------------------------------------------------------------------------------------------------ loading


@dataclass
class LoadedDrafter:
    """A drafter read back from an SGLang export, ready to propose tokens."""

    drafter: Eagle3Drafter  # eval mode, the target's embeddings loaded
    d2t: Tensor  # int64 [Vd]: target id = draft id + d2t[draft id]
    t2d: Tensor  # bool [V]
    aux_layer_ids: list[int]  # OUR convention (output of layer j), the ids eagle3.features hooks
    config: dict[str, Any]  # the export's config.json


def load_sglang_export(
    export_dir: Path, target_dir: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> LoadedDrafter:
    """Check an SGLang export, then build our drafter from it with the target's embeddings."""
    from safetensors.torch import load_file

    export_dir = Path(export_dir)
    check_sglang_export(export_dir)
    config = read_json(export_dir / CONFIG_FILE)
    dims, aux, _ = sglang_dims(config, export_dir / CONFIG_FILE)
    tensors = load_file(str(export_dir / WEIGHTS_FILE))
    d2t, t2d = tensors.pop("d2t"), tensors.pop("t2d")
    drafter = Eagle3Drafter(dims)
    own_embed = tensors.pop("embed_tokens.weight", None)
    result = drafter.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if result.unexpected_keys or set(result.missing_keys) != {"embed_tokens.weight"}:  # the check should prevent it
        raise ExportError(
            f"{export_dir}: weights do not fit the drafter: missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys}"
        )
    if own_embed is None:
        load_target_weights(drafter, target_dir, t2d, init_lm_head_from_target=False)
    else:
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(own_embed)
    drafter = drafter.to(device=device, dtype=dtype).eval()
    return LoadedDrafter(drafter, d2t.to(device), t2d.to(device), aux, config)
