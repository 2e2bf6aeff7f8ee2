"""Export a trained drafter for serving: the SGLang (official EAGLE-3) layout and the speculators layout.

``<run>/export/sglang/`` (SGLang's and vLLM's LlamaForCausalLMEagle3): config.json with the drafter's llama fields,
num_hidden_layers 1, the target vocab_size, draft_vocab_size, target_hidden_size and eagle_config; weights fc.weight,
midlayer.*, norm.weight, lm_head.weight, d2t int64 [Vd], t2d bool [V]; no embed_tokens (the target's are shared)
unless target_hidden_size differs. ``<run>/export/speculators/`` (vLLM): an Eagle3Speculator config whose flags
describe our drafter, ``layers.0.*`` for ``midlayer.*``. Each folder also gets eagle3_export.json (with the selected
checkpoint and why: eagle3.model_card), eagle3_run_config.json and README.md (the model card); no engine reads them.

Aux layer ids name the same tensors in three conventions: ours = output of layer j ([1, N//2-1, N-4]); SGLang's
eagle_config = the same numbers (its Llama code adds 1 and captures before layer j+1); speculators/vLLM = capture
before layer j+1 ([2, N//2, N-3]). SGLang silently skips unknown weight names, so every export is checked for the
exact key set, shapes and dtypes (ExportError). Layouts, conventions and what was verified: docs/export.md.
    python -m eagle3.export --config runs/smollm2-demo/config.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3.config import RunConfig
from eagle3.drafter.model import DrafterDims, Eagle3Drafter, load_target_weights, rope_settings
from eagle3.run.layout import STAGE_DIRS, manifest_name
from eagle3.run.stage import StageOutcome

log = logging.getLogger("eagle3.export")

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
INFO_FILE, RUN_CONFIG_FILE = "eagle3_export.json", "eagle3_run_config.json"
MANIFEST_FILE, TRAIN_MANIFEST = manifest_name("export"), Path(STAGE_DIRS["train"]) / manifest_name("train")
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
"""safetensors header dtype name -> torch dtype."""
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

SPECULATORS_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
"""speculators' eagle3 flags for OUR drafter: residual = un-normed feature, no norm before or in fc, pre-norm
output fed to the next step (speculators' trainer defaults norm_before_residual to true: another model)."""
MIDLAYER_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
TensorSpec = tuple[tuple[int, ...], torch.dtype]


class ExportError(ValueError):
    """An export folder (or the weights given to an exporter) that an engine would load wrongly or not at all."""


# ------------------------------------------------------------------------------------------------ aux ids

def sglang_aux_ids(ours: list[int]) -> list[int]:
    """Our output-of-layer ids as SGLang's eagle_config wants them: the same numbers (SGLang adds the 1)."""
    return [int(i) for i in ours]


def speculators_aux_ids(ours: list[int]) -> list[int]:
    """Our output-of-layer ids in speculators' capture-before convention: output of j = input of j + 1."""
    return [int(i) + 1 for i in ours]


def ours_from_speculators(ids: list[int]) -> list[int]:
    """Inverse of speculators_aux_ids."""
    return [int(i) - 1 for i in ids]


def aux_id_warnings(ours: list[int]) -> list[str]:
    """Why an id list could be misread by a serving engine (empty when it is the usual kind)."""
    if ours and ours[0] != 1:
        return [f"aux layer ids {ours} do not start at 1: SGLang's Llama targets read them right (they add 1), "
                f"but its deepseek_v2 / glm4_moe_lite targets add 1 only when the first id is 1 and would "
                f"capture other layers"]
    return []


# ---------------------------------------------------------------------------------------- expected tensors

def sglang_tensor_specs(dims: DrafterDims, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Every tensor of the SGLang layout: name -> (shape, dtype), from the drafter's sizes."""
    h, inter, vd, v = dims.hidden_size, dims.intermediate_size, dims.draft_vocab_size, dims.vocab_size
    q_out, kv_out = dims.num_attention_heads * dims.head_dim, dims.num_key_value_heads * dims.head_dim
    attn, mlp = "midlayer.self_attn", "midlayer.mlp"
    specs: dict[str, TensorSpec] = {
        "fc.weight": ((h, dims.num_aux * dims.target_hidden_size), dtype),
        **{f"midlayer.{n}.weight": ((h,), dtype) for n in MIDLAYER_NORMS},
        f"{attn}.q_proj.weight": ((q_out, 2 * h), dtype), f"{attn}.k_proj.weight": ((kv_out, 2 * h), dtype),
        f"{attn}.v_proj.weight": ((kv_out, 2 * h), dtype), f"{attn}.o_proj.weight": ((h, q_out), dtype),
        f"{mlp}.gate_proj.weight": ((inter, h), dtype), f"{mlp}.up_proj.weight": ((inter, h), dtype),
        f"{mlp}.down_proj.weight": ((h, inter), dtype), "norm.weight": ((h,), dtype),
        "lm_head.weight": ((vd, h), dtype),
        "d2t": ((vd,), torch.int64), "t2d": ((v,), torch.bool),  # d2t: target id = draft id + d2t[draft id]
    }
    if dims.target_hidden_size != dims.hidden_size:  # SGLang then keeps the draft's own table (set_embed skips it)
        specs["embed_tokens.weight"] = ((v, h), dtype)
    return specs


def to_speculators_name(name: str) -> str:
    """SGLang name -> speculators name ('midlayer.' becomes 'layers.0.'; the rest is shared)."""
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def compare_tensors(found: dict[str, TensorSpec], expected: dict[str, TensorSpec], where: str) -> None:
    """Raise ExportError naming every missing/unexpected key, wrong shape and wrong dtype."""
    problems = []
    prefixed = sorted(k for k in found if k not in expected and "." in k and k.split(".", 1)[1] in expected)
    if prefixed:
        problems.append(f"keys with a prefix {prefixed} (e.g. 'draft_model.'): engines would skip them")
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected) - set(prefixed))
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected} (SGLang silently skips unknown names)")
    for name in sorted(set(found) & set(expected)):
        (shape, dtype), (want_shape, want_dtype) = found[name], expected[name]
        if tuple(shape) != tuple(want_shape):
            problems.append(f"{name}: shape {list(shape)}, expected {list(want_shape)}")
        if dtype != want_dtype:
            problems.append(f"{name}: dtype {_dtype_name(dtype)}, expected {_dtype_name(want_dtype)}")
    if problems:
        raise ExportError(f"{where}: " + "; ".join(problems))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _header_specs(path: Path) -> dict[str, TensorSpec]:
    """name -> (shape, dtype) from a safetensors header, without reading the tensors."""
    from eagle3.target.load import safetensors_header

    if not Path(path).is_file():
        raise ExportError(f"{path} not found")
    header = {k: v for k, v in safetensors_header(path).items() if k != "__metadata__"}
    unknown = sorted(f"{k} ({v['dtype']})" for k, v in header.items() if v["dtype"] not in SAFETENSORS_DTYPES)
    if unknown:
        raise ExportError(f"{path}: tensors of a dtype no export uses: {unknown}")
    return {k: (tuple(v["shape"]), SAFETENSORS_DTYPES[v["dtype"]]) for k, v in header.items()}


# ----------------------------------------------------------------------------------------- SGLang config

def rope_scaling_dict(dims: DrafterDims) -> dict[str, Any] | None:
    """The llama3 rope_scaling block of config.json (None for plain RoPE)."""
    s = dims.rope_scaling
    return None if s is None else {
        "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position_embeddings}


def llama_fields(dims: DrafterDims, dtype: torch.dtype) -> dict[str, Any]:
    """The Llama decoder fields of a one-layer drafter (what SGLang's LlamaConfig reads)."""
    return {
        "model_type": "llama", "hidden_size": dims.hidden_size, "intermediate_size": dims.intermediate_size,
        "num_attention_heads": dims.num_attention_heads, "num_key_value_heads": dims.num_key_value_heads,
        "head_dim": dims.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": dims.rms_norm_eps,
        "rope_theta": dims.rope_theta, "rope_scaling": rope_scaling_dict(dims),
        "max_position_embeddings": dims.max_position_embeddings, "attention_bias": False, "mlp_bias": False,
        "vocab_size": dims.vocab_size, "tie_word_embeddings": False, "torch_dtype": _dtype_name(dtype),
    }


def sglang_config(dims: DrafterDims, aux_layer_ids: list[int], dtype: torch.dtype) -> dict[str, Any]:
    """config.json of the SGLang layout (aux ids given in OUR convention)."""
    if len(aux_layer_ids) != dims.num_aux:
        raise ExportError(f"{len(aux_layer_ids)} aux layer ids {aux_layer_ids} for a drafter whose fc reads "
                          f"{dims.num_aux} aux states")
    return {"architectures": [SGLANG_ARCHITECTURE], **llama_fields(dims, dtype),
            "draft_vocab_size": dims.draft_vocab_size, "target_hidden_size": dims.target_hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_aux_ids(aux_layer_ids),
                             "use_aux_hidden_state": True}}


def dims_from_llama_fields(cfg: dict[str, Any], draft_vocab_size: int, num_aux: int, target_hidden_size: int,
                           where: Path) -> DrafterDims:
    """DrafterDims back from the llama fields of an export's config (ExportError naming ``where``)."""
    try:
        theta, scaling = rope_settings(cfg)
        return DrafterDims(
            hidden_size=int(cfg["hidden_size"]), num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg["num_key_value_heads"]), head_dim=int(cfg["head_dim"]),
            intermediate_size=int(cfg["intermediate_size"]), rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=theta, rope_scaling=scaling, vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size), num_aux=int(num_aux), target_hidden_size=int(target_hidden_size),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)))
    except KeyError as exc:
        raise ExportError(f"{where}: the field {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{where}: {exc}") from None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file as a dict (ExportError when absent or malformed)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ExportError(f"{path} must hold a JSON object")
    return doc


def _aux_problems(ids: Any, field: str) -> list[str]:
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids) and ids == sorted(set(ids)):
        return []
    return [f"{field} must be distinct ascending ids, got {ids!r}"]


def _dtype_from_config(cfg: dict[str, Any], where: Path) -> torch.dtype:
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    if name not in FLOAT_DTYPES:
        raise ExportError(f"{where}: torch_dtype {name!r} is not one of {sorted(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[name]


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
    problems += _aux_problems(eagle.get(field), f"eagle_config.{field}")
    if eagle.get("use_aux_hidden_state") is not True:
        problems.append("eagle_config.use_aux_hidden_state must be true")
    if problems:
        raise ExportError(f"{where}: " + "; ".join(problems))
    aux = [int(i) for i in eagle[field]]  # SGLang ids are ours
    dims = dims_from_llama_fields(cfg, cfg["draft_vocab_size"], len(aux),
                                  cfg.get("target_hidden_size", cfg.get("hidden_size", 0)), where)
    return dims, aux, _dtype_from_config(cfg, where)


def check_sglang_export(export_dir: Path) -> None:
    """Raise ExportError unless the folder is a loadable SGLang drafter: config fields, exact tensor set,
    shapes and dtypes, and a d2t/t2d pair that describe the same draft vocab."""
    config = Path(export_dir) / CONFIG_FILE
    dims, _, dtype = sglang_dims(read_json(config), config)
    weights = config.with_name(WEIGHTS_FILE)
    compare_tensors(_header_specs(weights), sglang_tensor_specs(dims, dtype), str(weights))
    _check_vocab_maps(weights)


def _check_vocab_maps(weights: Path) -> None:
    from safetensors import safe_open

    from eagle3.data.vocab import VocabMapError, validate_maps

    with safe_open(str(weights), framework="pt") as fh:
        d2t, t2d = fh.get_tensor("d2t"), fh.get_tensor("t2d")
    try:
        validate_maps(d2t, t2d)
    except VocabMapError as exc:
        raise ExportError(f"{weights}: d2t/t2d: {exc}") from None


# ---------------------------------------------------------------------------------------------- writing

def _cast_weights(weights: dict[str, Tensor], specs: dict[str, TensorSpec], d2t: Tensor, t2d: Tensor,
                  where: str) -> dict[str, Tensor]:
    """The tensors to write, in the spec's dtypes; the input set is checked first (a typo is not written)."""
    given = {**weights, "d2t": d2t, "t2d": t2d}
    cast = {k for k, v in given.items() if v.is_floating_point() and k in specs and specs[k][1].is_floating_point}
    found = {k: (tuple(v.shape), specs[k][1] if k in cast else v.dtype) for k, v in given.items()}  # d2t/t2d as given
    compare_tensors(found, specs, where)
    return {k: given[k].detach().to("cpu", specs[k][1]).contiguous() for k in specs}


def _write_folder(out_dir: Path, config: dict[str, Any], tensors: dict[str, Tensor], info: dict[str, Any],
                  run_config: dict[str, Any] | None) -> Path:
    """config.json, model.safetensors and the provenance files into a temp folder, fsynced, then renamed."""
    from safetensors.torch import save_file

    from infra.storage import publish_dir, seal_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        docs = {CONFIG_FILE: config, INFO_FILE: info, RUN_CONFIG_FILE: run_config}
        for name, doc in ((k, v) for k, v in docs.items() if v is not None):
            (tmp / name).write_text(json.dumps(doc, indent=2) + "\n")
        seal_dir(tmp)
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def export_info(fmt: str, aux_layer_ids: list[int], dtype: torch.dtype, **extra: Any) -> dict[str, Any]:
    """eagle3_export.json: the layout, the dtype and the aux ids in every convention."""
    from eagle3.features.spec import AUX_CONVENTION_TEXT

    return {"format": fmt, "dtype": _dtype_name(dtype),
            "aux_layer_ids": {"output_of_layer": list(aux_layer_ids), "sglang": sglang_aux_ids(aux_layer_ids),
                              "capture_before": speculators_aux_ids(aux_layer_ids)},
            "aux_convention_text": AUX_CONVENTION_TEXT, **extra}


def export_sglang(weights: dict[str, Tensor], dims: DrafterDims, d2t: Tensor, t2d: Tensor,
                  aux_layer_ids: list[int], out_dir: Path, dtype: torch.dtype = torch.bfloat16,
                  run_config: dict[str, Any] | None = None, source: str | None = None,
                  selection: dict[str, Any] | None = None) -> Path:
    """Write the SGLang layout of a drafter (weights under SGLang names, aux ids in OUR convention) and check it."""
    config = sglang_config(dims, aux_layer_ids, dtype)
    tensors = _cast_weights(weights, sglang_tensor_specs(dims, dtype), d2t, t2d, "weights to export")
    for warning in aux_id_warnings(aux_layer_ids):
        log.warning("%s", warning)
    info = export_info("sglang", aux_layer_ids, dtype, source=source, selection=selection,
                       warnings=aux_id_warnings(aux_layer_ids))
    out = _write_folder(Path(out_dir), config, tensors, info, run_config)
    check_sglang_export(out)
    return out


# ---------------------------------------------------------------------------------------------- loading

@dataclass
class LoadedDrafter:
    """A drafter read back from an SGLang export, ready to propose tokens."""

    drafter: Eagle3Drafter  # eval mode, the target's embeddings loaded
    d2t: Tensor  # int64 [Vd]: target id = draft id + d2t[draft id]
    t2d: Tensor  # bool [V]
    aux_layer_ids: list[int]  # OUR convention (output of layer j), the ids eagle3.features hooks
    config: dict[str, Any]  # the export's config.json


def load_sglang_export(export_dir: Path, target_dir: Path, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> LoadedDrafter:
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
        raise ExportError(f"{export_dir}: weights do not fit the drafter: missing {result.missing_keys}, "
                          f"unexpected {result.unexpected_keys}")
    if own_embed is None:
        load_target_weights(drafter, target_dir, t2d, init_lm_head_from_target=False)
    else:
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(own_embed)
    drafter = drafter.to(device=device, dtype=dtype).eval()
    return LoadedDrafter(drafter, d2t.to(device), t2d.to(device), aux, config)


# ------------------------------------------------------------------------------------------ speculators

def speculators_config(dims: DrafterDims, aux_layer_ids: list[int], dtype: torch.dtype, verifier_name_or_path: str,
                       verifier_architectures: list[str], speculative_tokens: int) -> dict[str, Any]:
    """config.json of the speculators layout; SPECULATORS_FLAGS make its model compute what ours does."""
    if dims.target_hidden_size != dims.hidden_size:
        raise ExportError(f"speculators' fc reads num_aux x hidden_size; target hidden {dims.target_hidden_size} "
                          f"!= drafter hidden {dims.hidden_size} cannot be expressed in its format")
    layer = {k: v for k, v in llama_fields(dims, dtype).items() if k != "torch_dtype"}
    return {
        "architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, "draft_vocab_size": dims.draft_vocab_size,
        **SPECULATORS_FLAGS, "embed_requires_grad": False, "target_hidden_size": dims.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": speculators_aux_ids(aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)}},
        "tie_word_embeddings": False, "torch_dtype": _dtype_name(dtype),
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
    problems += _aux_problems(ids, "eagle_aux_hidden_state_layer_ids")
    if problems:
        raise ExportError(f"{where}: " + "; ".join(problems))
    dims = dims_from_llama_fields(layer, cfg.get("draft_vocab_size", 0), len(ids),
                                  cfg.get("target_hidden_size") or layer.get("hidden_size", 0), where)
    return dims, ours_from_speculators(ids), _dtype_from_config(cfg, where)


def check_speculators_export(export_dir: Path) -> None:
    """Raise ExportError unless the folder is a speculators Eagle3 drafter of our architecture with exactly the
    tensors, shapes and dtypes its config implies."""
    export_dir = Path(export_dir)
    dims, _, dtype = speculators_dims(read_json(export_dir / CONFIG_FILE), export_dir / CONFIG_FILE)
    weights = export_dir / WEIGHTS_FILE
    specs = speculators_tensor_specs(dims, dtype)
    compare_tensors(_header_specs(weights), specs, str(weights))
    if "d2t" in specs:
        _check_vocab_maps(weights)


def export_speculators(weights: dict[str, Tensor], dims: DrafterDims, d2t: Tensor, t2d: Tensor,
                       aux_layer_ids: list[int], out_dir: Path, dtype: torch.dtype = torch.bfloat16,
                       verifier_name_or_path: str = "", verifier_architectures: list[str] | None = None,
                       speculative_tokens: int = 3, run_config: dict[str, Any] | None = None,
                       source: str | None = None, selection: dict[str, Any] | None = None) -> Path:
    """Write the speculators layout and check it: ``weights`` under SGLang names plus the target's
    embed_tokens.weight, aux ids in OUR convention."""
    if not verifier_name_or_path:
        raise ExportError("the speculators format needs verifier_name_or_path (the target's id or path)")
    local = Path(verifier_name_or_path) / CONFIG_FILE
    if verifier_architectures is None:  # a hub id has no local config: vLLM only records the architectures
        verifier_architectures = read_json(local).get("architectures", []) if local.is_file() else []
    config = speculators_config(dims, aux_layer_ids, dtype, verifier_name_or_path, verifier_architectures,
                                speculative_tokens)
    embed = {"embed_tokens.weight": ((dims.vocab_size, dims.hidden_size), dtype)}
    tensors = _cast_weights(weights, {**sglang_tensor_specs(dims, dtype), **embed}, d2t, t2d, "weights to export")
    kept = speculators_tensor_specs(dims, dtype)
    tensors = {to_speculators_name(k): v for k, v in tensors.items() if to_speculators_name(k) in kept}
    info = export_info("speculators", aux_layer_ids, dtype, source=source, selection=selection, warnings=[])
    out = _write_folder(Path(out_dir), config, tensors, info, run_config)
    check_speculators_export(out)
    return out


def check_export(export_dir: Path) -> str:
    """Check a folder of either layout (chosen by its architectures); returns the layout's name."""
    architectures = read_json(Path(export_dir) / CONFIG_FILE).get("architectures")
    if architectures == [SPECULATORS_ARCHITECTURE]:
        check_speculators_export(export_dir)
        return "speculators"
    check_sglang_export(export_dir)
    return "sglang"


# -------------------------------------------------------------------------------------------- the stage

def export_dir(cfg: RunConfig) -> Path:
    """<run>/export."""
    return cfg.run_dir / "export"


def key_for(cfg: RunConfig) -> str:
    """The export stage key: export section and train.select, train + vocab manifests, target fingerprint."""
    from eagle3.config import section_dict
    from eagle3.run.stage import stage_key
    from eagle3.run.stages import manifest_path
    from eagle3.target.load import fingerprint, prepare_target

    fp = fingerprint(prepare_target(cfg))
    conf = section_dict(cfg, "export") | {"train.select": cfg.train.select}  # what to ship: not in train's key
    return stage_key("export", conf, [cfg.run_dir / TRAIN_MANIFEST, manifest_path(cfg, "vocab")], {"target": fp})


def _train_stats(cfg: RunConfig) -> dict[str, Any]:
    from eagle3.run.stage import read_manifest

    return (read_manifest(cfg.run_dir / TRAIN_MANIFEST) or {}).get("stats", {})


def _checkpoint_dir(cfg: RunConfig) -> tuple[Path, Any]:
    """(checkpoint folder, eagle3.model_card.Selection): export.checkpoint, else train.select's."""
    from eagle3.model_card import select_checkpoint

    selection = select_checkpoint(cfg.train.select, cfg.export.checkpoint, _train_stats(cfg))
    path = cfg.run_dir / "train" / selection.checkpoint
    if not selection.checkpoint or not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"no checkpoint weights at {path / WEIGHTS_FILE} ({selection.reason})")
    return path, selection


def write_cards(cfg: RunConfig, results: dict[str, Any] | None = None, model_dir: Path | None = None) -> list[Path]:
    """README.md (eagle3.model_card) into every export folder of the run; ``results``: the evaluation of them."""
    from eagle3.model_card import CardInputs, write_card
    from eagle3.target.load import prepare_target

    model_dir, train = model_dir or prepare_target(cfg), _train_stats(cfg)
    folders = {f: export_dir(cfg) / f for f in cfg.export.formats if (export_dir(cfg) / f / INFO_FILE).is_file()}
    return [write_card(CardInputs(cfg, folder, fmt, folders.get("sglang"), model_dir, read_json(folder / INFO_FILE),
                                  train, results)) for fmt, folder in folders.items()]


def _verifier(cfg: RunConfig, model_dir: Path) -> str:
    hf_path = cfg.target.path if cfg.target.kind == "hf" else None
    return cfg.export.verifier_name_or_path or hf_path or str(Path(model_dir).resolve())


def _drafter_inputs(cfg: RunConfig, model_dir: Path) -> tuple[DrafterDims, list[int], Tensor, Tensor]:
    """(dims, aux ids in our convention, d2t, t2d), checked against the features the drafter was trained on."""
    from eagle3.features.spec import FeatureSpec
    from eagle3.target.load import fingerprint, target_info
    from eagle3.data.vocab import load_vocab_map

    spec = FeatureSpec.load(cfg.run_dir / "features" / "spec.json")
    info = target_info(model_dir, cfg.target)
    if spec.target_fingerprint != fingerprint(model_dir) or spec.aux_layer_ids != info.aux_layer_ids:
        raise ValueError(f"features/spec.json (target {spec.target_fingerprint}, aux {spec.aux_layer_ids}) does not "
                         f"match the configured target {model_dir} (aux {info.aux_layer_ids})")
    d2t, t2d = load_vocab_map(cfg.run_dir / "vocab")
    return DrafterDims.from_target(info, model_dir, draft_vocab_size=len(d2t)), list(spec.aux_layer_ids), d2t, t2d


def _export_all(cfg: RunConfig) -> tuple[dict[str, Path], dict[str, Any]]:
    from safetensors.torch import load_file

    from eagle3.drafter.model import EMBED_TENSOR
    from eagle3.target.load import prepare_target, read_tensor

    model_dir = prepare_target(cfg)
    dims, aux, d2t, t2d = _drafter_inputs(cfg, model_dir)
    embed = {"embed_tokens.weight": read_tensor(model_dir, EMBED_TENSOR)}  # [V, H], for the speculators layout
    ckpt, selection = _checkpoint_dir(cfg)
    weights, dtype = load_file(str(ckpt / WEIGHTS_FILE)), FLOAT_DTYPES[cfg.export.dtype]
    common = dict(run_config=cfg.model_dump(mode="json"), source=str(ckpt), selection=selection.to_json())
    outputs, stats = {}, {"checkpoint": str(ckpt.relative_to(cfg.run_dir)), "selection": selection.to_json(),
                          "dtype": cfg.export.dtype, "formats": {}}
    for fmt in dict.fromkeys(cfg.export.formats):
        out = export_dir(cfg) / fmt
        if fmt == "sglang":
            export_sglang(weights, dims, d2t, t2d, aux, out, dtype, **common)
            ids = sglang_aux_ids(aux)
        else:
            export_speculators(weights | embed, dims, d2t, t2d, aux, out, dtype, _verifier(cfg, model_dir),
                               speculative_tokens=cfg.export.speculative_tokens, **common)
            ids = speculators_aux_ids(aux)
        outputs |= {f"{fmt}_config": out / CONFIG_FILE, f"{fmt}_weights": out / WEIGHTS_FILE}
        stats["formats"][fmt] = {"dir": str(out), "aux_layer_ids": ids,
                                 "warnings": aux_id_warnings(aux) if fmt == "sglang" else []}
    stats["aux_layer_ids_output_of_layer"] = aux
    write_cards(cfg, model_dir=model_dir)  # no measured table: the evaluate stage adds it (not hashed: module doc)
    return outputs, stats


def run_export(cfg: RunConfig, force: bool = False) -> StageOutcome:
    """Export the selected checkpoint in every configured layout; a no-op when the manifest matches."""
    from eagle3.run.stage import run_stage

    return run_stage("export", export_dir(cfg) / MANIFEST_FILE, key_for(cfg), lambda: _export_all(cfg), force=force)


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.export --config <run>/config.json [--set export.dtype=float32] [--force] | --check DIR"""
    from eagle3.run.cli_args import add_config_args, config_from_args, exit_on_user_error
    from infra.storage import run_lock

    parser = add_config_args(argparse.ArgumentParser(description=main.__doc__))
    parser.add_argument("--force", action="store_true", help="export again even if the manifest matches")
    parser.add_argument("--check", type=Path, metavar="DIR", help="only check an existing export folder")

    @exit_on_user_error
    def run() -> None:
        args = parser.parse_args(argv)
        if args.check:
            print(f"{args.check}: {check_export(args.check)} layout, check passed")
            return
        cfg = config_from_args(args)
        with run_lock(cfg.run_dir, owner="python -m eagle3.export"):
            outcome = run_export(cfg, force=args.force)
        print(f"export {'written' if outcome.computed else 'up to date'} (checkpoint {outcome.stats['checkpoint']})")
        for fmt, entry in outcome.stats["formats"].items():  # checked again: files may have changed since
            print(f"  {check_export(Path(entry['dir'])):<12} {entry['dir']}  aux ids {entry['aux_layer_ids']}  "
                  f"check passed" + "".join(f"\n  warning: {w}" for w in entry["warnings"]))

    run()


if __name__ == "__main__":
    main()
