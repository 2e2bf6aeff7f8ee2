"""The speculators layout (vLLM's Eagle3Speculator): our drafter described by its flags, ``layers.0.*`` names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3.drafter.model import DrafterDims
from eagle3.export.checks import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportError,
    TensorSpec,
    aux_problems,
    check_finite_file,
    check_vocab_maps,
    compare_tensors,
    dims_from_llama_fields,
    dtype_from_config,
    dtype_name,
    header_specs,
    llama_fields,
    ours_from_speculators,
    read_json,
    speculators_aux_ids,
)
from eagle3.export.folder import cast_weights, export_info, write_folder
from eagle3.export.sglang import sglang_tensor_specs

SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
"""speculators' eagle3 flags for OUR drafter: residual = un-normed feature, no norm before or in fc, pre-norm
output fed to the next step (speculators' trainer defaults norm_before_residual to true: another model)."""


def to_speculators_name(name: str) -> str:
    """SGLang name -> speculators name ('midlayer.' becomes 'layers.0.'; the rest is shared)."""
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def speculators_config(
    dims: DrafterDims,
    aux_layer_ids: list[int],
    dtype: torch.dtype,
    verifier_name_or_path: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
) -> dict[str, Any]:
    """config.json of the speculators layout; SPECULATORS_FLAGS make its model compute what ours does."""
    if dims.target_hidden_size != dims.hidden_size:
        raise ExportError(
            f"speculators' fc reads num_aux x hidden_size; target hidden {dims.target_hidden_size} "
            f"!= drafter hidden {dims.hidden_size} cannot be expressed in its format"
        )
    layer = {k: v for k, v in llama_fields(dims, dtype).items() if k != "torch_dtype"}
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": dims.draft_vocab_size,
        **SPECULATORS_FLAGS,
        "embed_requires_grad": False,
        "target_hidden_size": dims.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": speculators_aux_ids(aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)},
        },
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name(dtype),
    }


def speculators_tensor_specs(dims: DrafterDims, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """The SGLang tensors under speculators' names plus the target's embed_tokens (speculators' own checkpoints
    have it, and its from_pretrained leaves the table uninitialised without it); no d2t/t2d for a full vocab."""
    specs = {to_speculators_name(k): v for k, v in sglang_tensor_specs(dims, dtype).items()}
    specs["embed_tokens.weight"] = ((dims.vocab_size, dims.hidden_size), dtype)
    if dims.draft_vocab_size == dims.vocab_size:
        specs.pop("d2t"), specs.pop("t2d")
    return specs


def speculators_dims(cfg: dict[str, Any], where: Path) -> tuple[DrafterDims, list[int], torch.dtype]:
    """(dims, aux ids in OUR convention, weight dtype) of a speculators export's config.json, checked."""
    layer = cfg.get("transformer_layer_config") or {}
    expected = {"architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "eagle3", **SPECULATORS_FLAGS}
    problems = [f"{k} is {cfg.get(k)!r}, expected {v!r}" for k, v in expected.items() if cfg.get(k) != v]
    if layer.get("model_type") != "llama" or layer.get("num_hidden_layers") != 1:
        problems.append("transformer_layer_config must be a one-layer llama config")
    if (cfg.get("speculators_config") or {}).get("algorithm") != "eagle3":
        problems.append("speculators_config.algorithm must be 'eagle3'")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    problems += aux_problems(ids, "eagle_aux_hidden_state_layer_ids")
    if problems:
        raise ExportError(f"{where}: " + "; ".join(problems))
    assert isinstance(ids, list)  # (aux_problems accepts only a list)
    dims = dims_from_llama_fields(
        layer,
        cfg.get("draft_vocab_size", 0),
        len(ids),
        cfg.get("target_hidden_size") or layer.get("hidden_size", 0),
        where,
    )
    return dims, ours_from_speculators(ids), dtype_from_config(cfg, where)


def check_speculators_export(export_dir: Path) -> None:
    """Raise ExportError unless the folder is a speculators Eagle3 drafter of our architecture with exactly the
    tensors, shapes and dtypes its config implies."""
    export_dir = Path(export_dir)
    dims, _, dtype = speculators_dims(read_json(export_dir / CONFIG_FILE), export_dir / CONFIG_FILE)
    weights = export_dir / WEIGHTS_FILE
    specs = speculators_tensor_specs(dims, dtype)
    compare_tensors(header_specs(weights), specs, str(weights))
    if "d2t" in specs:
        check_vocab_maps(weights)
    check_finite_file(weights)


def export_speculators(
    weights: dict[str, Tensor],
    dims: DrafterDims,
    d2t: Tensor,
    t2d: Tensor,
    aux_layer_ids: list[int],
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    verifier_name_or_path: str = "",
    verifier_architectures: list[str] | None = None,
    speculative_tokens: int = 3,
    run_config: dict[str, Any] | None = None,
    source: str | None = None,
    selection: dict[str, Any] | None = None,
) -> Path:
    """Write the speculators layout and check it: ``weights`` under SGLang names plus the target's
    embed_tokens.weight, aux ids in OUR convention."""
    if not verifier_name_or_path:
        raise ExportError("the speculators format needs verifier_name_or_path (the target's id or path)")
    local = Path(verifier_name_or_path) / CONFIG_FILE
    if verifier_architectures is None:  # a hub id has no local config: vLLM only records the architectures
        verifier_architectures = read_json(local).get("architectures", []) if local.is_file() else []
    config = speculators_config(
        dims, aux_layer_ids, dtype, verifier_name_or_path, verifier_architectures, speculative_tokens
    )
    embed = {"embed_tokens.weight": ((dims.vocab_size, dims.hidden_size), dtype)}
    tensors = cast_weights(weights, {**sglang_tensor_specs(dims, dtype), **embed}, d2t, t2d, "weights to export")
    kept = speculators_tensor_specs(dims, dtype)
    tensors = {to_speculators_name(k): v for k, v in tensors.items() if to_speculators_name(k) in kept}
    info = export_info("speculators", aux_layer_ids, dtype, source=source, selection=selection, warnings=[])
    out = write_folder(Path(out_dir), config, tensors, info, run_config)
    check_speculators_export(out)
    return out
