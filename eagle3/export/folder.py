"""Writing one export folder: the tensors in the layout's dtypes, config and provenance files, published atomically."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3.export.checks import (
    CONFIG_FILE,
    INFO_FILE,
    RUN_CONFIG_FILE,
    WEIGHTS_FILE,
    TensorSpec,
    check_finite,
    compare_tensors,
    dtype_name,
    sglang_aux_ids,
    speculators_aux_ids,
)


def cast_weights(
    weights: dict[str, Tensor], specs: dict[str, TensorSpec], d2t: Tensor, t2d: Tensor, where: str
) -> dict[str, Tensor]:
    """The tensors to write, in the spec's dtypes; the input set is checked first (a typo is not written), the cast
    values after (a NaN, an inf, or a weight the dtype cannot hold is not written either)."""
    given = {**weights, "d2t": d2t, "t2d": t2d}
    cast = {k for k, v in given.items() if v.is_floating_point() and k in specs and specs[k][1].is_floating_point}
    found = {k: (tuple(v.shape), specs[k][1] if k in cast else v.dtype) for k, v in given.items()}  # d2t/t2d as given
    compare_tensors(found, specs, where)
    out = {k: given[k].detach().to("cpu", specs[k][1]).contiguous() for k in specs}
    check_finite(out, f"{where} (as {', '.join(sorted({dtype_name(v.dtype) for v in out.values()}))})")
    return out


def write_folder(
    out_dir: Path,
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    info: dict[str, Any],
    run_config: dict[str, Any] | None,
) -> Path:
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

    return {
        "format": fmt,
        "dtype": dtype_name(dtype),
        "aux_layer_ids": {
            "output_of_layer": list(aux_layer_ids),
            "sglang": sglang_aux_ids(aux_layer_ids),
            "capture_before": speculators_aux_ids(aux_layer_ids),
        },
        "aux_convention_text": AUX_CONVENTION_TEXT,
        **extra,
    }
