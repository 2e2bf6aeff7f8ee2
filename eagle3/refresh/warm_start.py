"""Warm start: a drafter's training begins from an SGLang EAGLE-3 export (``refresh.init_from``) instead of the seeded
init, so a refresh fine-tunes the promoted drafter rather than training a new one.

Every tensor of the export but the vocab maps is copied into the freshly built drafter after its usual init (the
target's embeddings are already there; an export of a drafter narrower than its target carries its own table and
that is copied too). lm_head rows are matched by target token id: the export's row of target token t goes to the row
of t in this run's draft vocab, and a token the export's vocab lacks keeps the init it got (the target's lm_head
row, or random). With the same vocab this is a plain copy. Shapes that differ (another target, another width) are
an error naming the tensor.

The train stage's key hashes the export's weights (``key_extra``), so another starting point trains again.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor, nn

    from eagle3.config import RunConfig

VOCAB_KEYS = ("d2t", "t2d")


class WarmStartError(ValueError):
    """An export that cannot start this drafter's training (another family, target or width)."""


def init_dir(cfg: RunConfig) -> Path | None:
    """The export a run's training starts from (refresh.init_from), or None."""
    return Path(cfg.refresh.init_from) if cfg.refresh.init_from else None


def key_extra(cfg: RunConfig) -> dict[str, Any]:
    """What the train key adds for a warm start: the sha256 of the export's weights ({} without one, so keys of runs
    that start from the seeded init stay as they were)."""
    from eagle3.export.checks import WEIGHTS_FILE
    from infra.storage import sha256_file_cached

    folder = init_dir(cfg)
    if folder is None:
        return {}
    if cfg.drafter.family != "eagle3":
        raise WarmStartError(
            f"refresh.init_from warm-starts EAGLE-3 drafters only, not drafter.family={cfg.drafter.family}"
        )
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(
            f"refresh.init_from is {folder}, which has no {WEIGHTS_FILE} (an SGLang export folder "
            "is expected: export/sglang of a run, or a promoted drafter)"
        )
    return {"init_from": sha256_file_cached(weights)}


def load_init(model: nn.Module, folder: Path, t2d: Tensor) -> list[str]:
    """Copy the export in ``folder`` into ``model`` (an Eagle3Drafter whose draft vocab is ``t2d``, bool [V]); the
    names copied. lm_head rows go by target id (module docstring)."""
    import torch
    from safetensors.torch import load_file

    from eagle3.export.checks import WEIGHTS_FILE

    stored = load_file(str(Path(folder) / WEIGHTS_FILE))
    state = model.state_dict()
    unknown = sorted(set(stored) - set(state) - set(VOCAB_KEYS))
    if unknown:
        raise WarmStartError(f"{folder}: tensors {unknown} have no place in this drafter (another family or layout?)")
    with torch.no_grad():
        for name, value in stored.items():
            if name in VOCAB_KEYS or name == "lm_head.weight":
                continue
            _check_shape(state[name], value, name, folder)
            state[name].copy_(value.to(state[name].dtype))
        _copy_lm_head_rows(state["lm_head.weight"], stored["lm_head.weight"], stored["t2d"], t2d, folder)
    return sorted(k for k in stored if k not in VOCAB_KEYS)


def _check_shape(ours: Tensor, theirs: Tensor, name: str, folder: Path) -> None:
    if tuple(ours.shape) != tuple(theirs.shape):
        raise WarmStartError(
            f"{folder}: {name} has shape {tuple(theirs.shape)}, this drafter's is {tuple(ours.shape)} "
            "(refresh.init_from must be a drafter of the same target and width)"
        )


def _copy_lm_head_rows(ours: Tensor, theirs: Tensor, their_t2d: Tensor, our_t2d: Tensor, folder: Path) -> None:
    """ours[i] = theirs[j] where draft id i here and draft id j there stand for the same target id."""
    import torch

    if len(their_t2d) != len(our_t2d) or ours.shape[1] != theirs.shape[1]:
        raise WarmStartError(
            f"{folder}: its vocab map covers {len(their_t2d)} target ids and its lm_head is "
            f"{tuple(theirs.shape)}; this drafter's: {len(our_t2d)} ids, {tuple(ours.shape)}"
        )
    row_of = torch.full((len(their_t2d),), -1, dtype=torch.long)  # [V] target id -> draft row there (-1: absent)
    row_of[their_t2d.nonzero().squeeze(1)] = torch.arange(int(their_t2d.sum()))
    rows = row_of[our_t2d.nonzero().squeeze(1)]  # [Vd] row there of each of our draft ids
    found = rows >= 0
    ours[found] = theirs[rows[found]].to(ours.dtype)
