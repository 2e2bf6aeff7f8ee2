"""What both export layouts share, and the checks that read a folder back.

File names, the dtypes a folder may hold, the aux-id conventions (ours, SGLang's, speculators'), the Llama fields
of a one-layer drafter's config (written and read back), and the tensor-set check every export passes
(``compare_tensors``: SGLang silently skips unknown weight names, so a typo must fail here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eagle3.drafter.model import DrafterDims
from eagle3.target.tensors import rope_settings

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
INFO_FILE, RUN_CONFIG_FILE = "eagle3_export.json", "eagle3_run_config.json"
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors header dtype name -> torch dtype."""
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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
        return [
            f"aux layer ids {ours} do not start at 1: SGLang's Llama targets read them right (they add 1), "
            f"but its deepseek_v2 / glm4_moe_lite targets add 1 only when the first id is 1 and would "
            f"capture other layers"
        ]
    return []


# -------------------------------------------------------------------------------------------- tensor sets


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
            problems.append(f"{name}: dtype {dtype_name(dtype)}, expected {dtype_name(want_dtype)}")
    if problems:
        raise ExportError(f"{where}: " + "; ".join(problems))


def is_finite(tensor: torch.Tensor) -> bool:
    """False for a floating-point tensor holding a NaN or an infinity."""
    return not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())


def refuse_non_finite(names: list[str], where: str) -> None:
    """Raise ExportError naming the tensors (NaN or inf: a diverged training, a damaged checkpoint, or a weight
    beyond the export dtype's range) that an engine would load and draft garbage with; nothing when empty."""
    if names:
        shown = ", ".join(sorted(names)[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
        raise ExportError(
            f"{where}: {len(names)} non-finite tensors (NaN or inf): {shown}; the training diverged "
            f"(see train/metrics.jsonl), the checkpoint is damaged, or a weight exceeds the export dtype"
        )


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """refuse_non_finite over tensors in memory."""
    refuse_non_finite([name for name, t in tensors.items() if not is_finite(t)], where)


def check_finite_file(weights: Path) -> None:
    """refuse_non_finite over a safetensors file, one tensor in memory at a time."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as fh:
        refuse_non_finite([name for name in fh.keys() if not is_finite(fh.get_tensor(name))], str(weights))  # noqa: SIM118 (safetensors' safe_open has keys() but is not iterable: `in fh` raises)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def header_specs(path: Path) -> dict[str, TensorSpec]:
    """name -> (shape, dtype) from a safetensors header, without reading the tensors."""
    from eagle3.target.load import safetensors_header

    if not Path(path).is_file():
        raise ExportError(f"{path} not found")
    header = {k: v for k, v in safetensors_header(path).items() if k != "__metadata__"}
    unknown = sorted(f"{k} ({v['dtype']})" for k, v in header.items() if v["dtype"] not in SAFETENSORS_DTYPES)
    if unknown:
        raise ExportError(f"{path}: tensors of a dtype no export uses: {unknown}")
    return {k: (tuple(v["shape"]), SAFETENSORS_DTYPES[v["dtype"]]) for k, v in header.items()}


def check_vocab_maps(weights: Path) -> None:
    from safetensors import safe_open

    from eagle3.data.vocab import VocabMapError, validate_maps

    with safe_open(str(weights), framework="pt") as fh:
        d2t, t2d = fh.get_tensor("d2t"), fh.get_tensor("t2d")
    try:
        validate_maps(d2t, t2d)
    except VocabMapError as exc:
        raise ExportError(f"{weights}: d2t/t2d: {exc}") from None


# ------------------------------------------------------------------------------------------------ configs


def rope_scaling_dict(dims: DrafterDims) -> dict[str, Any] | None:
    """The llama3 rope_scaling block of config.json (None for plain RoPE)."""
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


def llama_fields(dims: DrafterDims, dtype: torch.dtype) -> dict[str, Any]:
    """The Llama decoder fields of a one-layer drafter (what SGLang's LlamaConfig reads)."""
    return {
        "model_type": "llama",
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_key_value_heads,
        "head_dim": dims.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": dims.rms_norm_eps,
        "rope_theta": dims.rope_theta,
        "rope_scaling": rope_scaling_dict(dims),
        "max_position_embeddings": dims.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": dims.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name(dtype),
    }


def dims_from_llama_fields(
    cfg: dict[str, Any], draft_vocab_size: int, num_aux: int, target_hidden_size: int, where: Path
) -> DrafterDims:
    """DrafterDims back from the llama fields of an export's config (ExportError naming ``where``)."""
    try:
        theta, scaling = rope_settings(cfg)
        return DrafterDims(
            hidden_size=int(cfg["hidden_size"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg["num_key_value_heads"]),
            head_dim=int(cfg["head_dim"]),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=theta,
            rope_scaling=scaling,
            vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            num_aux=int(num_aux),
            target_hidden_size=int(target_hidden_size),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        )
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


def aux_problems(ids: Any, field: str) -> list[str]:
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids) and ids == sorted(set(ids)):
        return []
    return [f"{field} must be distinct ascending ids, got {ids!r}"]


def dtype_from_config(cfg: dict[str, Any], where: Path) -> torch.dtype:
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    if name not in FLOAT_DTYPES:
        raise ExportError(f"{where}: torch_dtype {name!r} is not one of {sorted(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[name]
