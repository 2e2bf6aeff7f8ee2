"""The FeatureSpec of a run (what its captured features hold) and its check against features/spec.json.

The capture stage writes spec.json before its first shard and refuses a run whose spec differs (its shards would
mix two kinds of features); online training (eagle3.train) writes and checks the same file for the features it
computes, so export and evaluation read what the drafter was trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3.config import RunConfig
from eagle3.features.spec import FeatureSpec
from eagle3.run.layout import SPEC_FILE


class SpecMismatchError(ValueError):
    """features/spec.json describes other features than this run would capture."""


def build_spec(cfg: RunConfig, model_dir: Path) -> FeatureSpec:
    """The FeatureSpec this run's capture produces (target shape, aux ids, supervision, dtypes, template)."""
    from eagle3.target.load import fingerprint, load_tokenizer, target_info
    from infra.storage import sha256_text

    info = target_info(model_dir, cfg.target)
    template = load_tokenizer(model_dir).chat_template
    cap = cfg.capture
    return FeatureSpec(
        target_name=cfg.target.name,
        target_fingerprint=fingerprint(model_dir),
        hidden_size=info.hidden_size,
        num_layers=info.num_layers,
        vocab_size=info.vocab_size,
        aux_layer_ids=info.aux_layer_ids,
        supervision=cap.supervision,
        topk=cap.topk if cap.supervision == "topk_logprobs" else None,
        dtype=cap.dtype,
        aux_dtype=cap.aux_dtype,
        max_len=cfg.tokenize.max_len,
        chat_template_hash=sha256_text(template if isinstance(template, str) else json.dumps(template)),
        backend=cap.backend,
    )


def spec_differences(old: dict[str, Any], new: FeatureSpec) -> list[str]:
    """'field: old -> new' for every field that differs."""
    fresh = new.model_dump(mode="json")
    keys = sorted(set(old) | set(fresh))
    return [f"{k}: {old.get(k)!r} -> {fresh.get(k)!r}" for k in keys if old.get(k) != fresh.get(k)]


def save_or_check_spec(fdir: Path, spec: FeatureSpec) -> None:
    """Write <fdir>/spec.json, or refuse when the one there describes other features (which fields differ)."""
    fdir.mkdir(parents=True, exist_ok=True)
    path = fdir / SPEC_FILE
    if path.is_file():
        old = json.loads(path.read_text())
        diffs = spec_differences(old, spec)
        if diffs:
            raise SpecMismatchError(
                f"{path} was written for other features; differing fields: {'; '.join(diffs)}. "
                f"Delete {fdir} to capture again with this config, or use another run.name"
            )
        return
    spec.save(path)
