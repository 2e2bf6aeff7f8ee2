"""The draft vocabulary map: which target tokens the drafter's lm_head can produce.

Algorithm (SpecForge's, with speculators' deterministic tie-break):
1. count target ids over ``input_ids[loss_mask == 1]`` of the train split only (the tokens the
   drafter must produce; val rows must not leak into a training decision);
2. rank by (count desc, id asc), so the map does not depend on row order;
3. forced ids (EOS / end-of-turn) are always kept: they replace the lowest-ranked others, since a
   drafter that cannot propose the end of a turn loses a token at every turn end;
4. with fewer distinct tokens than the draft size, the ranking continues with the lowest unused ids
   (count 0), which is the same as SpecForge's fill from ``range(draft_vocab_size)`` when those are free;
5. sort ascending; ``d2t[i] = used[i] - i`` (int64 [draft]); ``t2d`` = bool [target_vocab].
SGLang and vLLM load only ``d2t`` (hot ids = d2t + arange); the trainer masks target logits with ``t2d``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

from infra.storage import atomic_path, atomic_write_json

MAP_FILE = "vocab_map.safetensors"
INFO_FILE = "vocab_map.json"


class VocabMapError(ValueError):
    """A vocab map that is inconsistent, or that cannot be built from the given inputs."""


def _supervised_ids(batch: Any, where: Path) -> np.ndarray:
    """int64 ids of the supervised tokens of the train rows in one record batch."""
    batch = batch.filter(pc.equal(batch.column("split"), "train"))
    ids = batch.column("input_ids").flatten().to_numpy(zero_copy_only=False)  # [sum T]
    mask = batch.column("loss_mask").flatten().to_numpy(zero_copy_only=False)  # [sum T]
    if len(ids) != len(mask):
        raise VocabMapError(f"{where}: input_ids and loss_mask have different total lengths")
    return ids[mask == 1].astype(np.int64)


def count_train_tokens(tokenized_parquet: Path, target_vocab_size: int) -> tuple[np.ndarray, int]:
    """(int64 counts [target_vocab] of supervised token ids over train rows, number of train rows).

    Streams record batches so memory stays bounded by one batch, not the whole dataset.
    """
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    num_train_rows = 0
    source = pq.ParquetFile(tokenized_parquet)
    for batch in source.iter_batches(batch_size=4096, columns=["split", "input_ids", "loss_mask"]):
        num_train_rows += int(pc.sum(pc.equal(batch.column("split"), "train")).as_py() or 0)
        supervised = _supervised_ids(batch, tokenized_parquet)
        if len(supervised) and (supervised.min() < 0 or supervised.max() >= target_vocab_size):
            raise VocabMapError(
                f"{tokenized_parquet}: token id {int(supervised.max())} outside the target "
                f"vocab of {target_vocab_size} (wrong tokenizer?)"
            )
        counts += np.bincount(supervised, minlength=target_vocab_size)
    return counts, num_train_rows


def rank_tokens(counts: np.ndarray) -> np.ndarray:
    """All ids ordered by (count desc, id asc): int64 [V]."""
    ids = np.arange(len(counts), dtype=np.int64)
    return np.lexsort((ids, -counts)).astype(np.int64)  # lexsort sorts by the last key first


def select_tokens(counts: np.ndarray, draft_vocab_size: int, forced_ids: list[int]) -> np.ndarray:
    """The used target ids, sorted ascending: int64 [draft]; forced ids replace the lowest-ranked others."""
    forced = np.unique(np.asarray(forced_ids, dtype=np.int64))
    if len(forced) and (forced.min() < 0 or forced.max() >= len(counts)):
        raise VocabMapError(f"forced ids {forced.tolist()} must lie in [0, {len(counts)})")
    if len(forced) > draft_vocab_size:
        raise VocabMapError(f"{len(forced)} forced ids do not fit in a draft vocab of {draft_vocab_size}")
    ranked = rank_tokens(counts)
    others = ranked[~np.isin(ranked, forced)][: draft_vocab_size - len(forced)]
    return np.sort(np.concatenate([forced, others]))


def maps_from_used(used: np.ndarray, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft] = used - arange, t2d bool [target_vocab]) from sorted used ids."""
    used_t = torch.as_tensor(used, dtype=torch.int64)
    d2t = used_t - torch.arange(len(used_t), dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used_t] = True
    return d2t, t2d


def validate_maps(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int | None = None) -> None:
    """Raise VocabMapError unless d2t and t2d describe the same strictly increasing set of target ids."""
    if d2t.dtype != torch.int64 or d2t.dim() != 1 or t2d.dtype != torch.bool or t2d.dim() != 1:
        raise VocabMapError(
            f"expected d2t int64 [draft] and t2d bool [target], got {d2t.dtype} "
            f"{list(d2t.shape)} and {t2d.dtype} {list(t2d.shape)}"
        )
    draft = len(d2t)
    if draft_vocab_size is not None and draft != draft_vocab_size:
        raise VocabMapError(f"d2t has {draft} entries, expected {draft_vocab_size}")
    used = d2t + torch.arange(draft, dtype=torch.int64)
    if draft and (used.min() < 0 or used.max() >= len(t2d)):
        raise VocabMapError(f"d2t points outside the target vocab of {len(t2d)}")
    if draft > 1 and not bool((used[1:] > used[:-1]).all()):
        raise VocabMapError("d2t + arange is not strictly increasing (ids unsorted or repeated)")
    if int(t2d.sum()) != draft or not bool(t2d[used].all()):
        raise VocabMapError(f"t2d marks {int(t2d.sum())} ids but d2t lists {draft}, or they disagree")


def coverage_at(counts: np.ndarray, sizes: list[int]) -> dict[int, float]:
    """Fraction of supervised train tokens covered by the top-k ids, for each k in ``sizes``."""
    total = int(counts.sum())
    ranked_counts = np.sort(counts)[::-1]
    cumulative = np.concatenate([[0], np.cumsum(ranked_counts)])  # cumulative[k] = tokens covered by top k
    return {k: (float(cumulative[min(k, len(counts))]) / total if total else 0.0) for k in sizes}


def _save(out_dir: Path, d2t: torch.Tensor, t2d: torch.Tensor, info: dict[str, Any]) -> dict[str, Path]:
    map_path, info_path = out_dir / MAP_FILE, out_dir / INFO_FILE
    with atomic_path(map_path) as tmp:
        save_file({"d2t": d2t, "t2d": t2d}, str(tmp), metadata={"tokenizer_fingerprint": info["tokenizer_fingerprint"]})
    atomic_write_json(info_path, info)
    return {"vocab_map": map_path, "info": info_path}


def build_vocab_map(
    tokenized_parquet: Path,
    target_vocab_size: int,
    draft_vocab_size: int,
    forced_ids: list[int],
    out_dir: Path,
    tokenizer_fingerprint: str,
) -> tuple[dict[str, Path], dict]:
    """Count supervised train tokens, pick the draft vocab, validate and save d2t/t2d plus a JSON summary."""
    draft_vocab_size = min(draft_vocab_size, target_vocab_size)  # a draft vocab cannot exceed the target's
    counts, num_train_rows = count_train_tokens(tokenized_parquet, target_vocab_size)
    if not counts.any():
        # A map ranked from zero counts is just the lowest ids: it would look valid and be useless.
        raise VocabMapError(
            f"{tokenized_parquet}: no supervised tokens in the train split ({num_train_rows:,} "
            "train rows), so there is nothing to build a draft vocabulary from"
        )
    used = select_tokens(counts, draft_vocab_size, forced_ids)
    d2t, t2d = maps_from_used(used, target_vocab_size)
    validate_maps(d2t, t2d, draft_vocab_size)
    if not torch.equal(d2t + torch.arange(draft_vocab_size), torch.as_tensor(used)):
        raise VocabMapError("d2t + arange does not reproduce the selected ids")
    total = int(counts.sum())
    info = {
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": target_vocab_size,
        "coverage": float(counts[used].sum()) / total if total else 0.0,
        "coverage_at": {str(k): v for k, v in coverage_at(counts, [8192, 32000, draft_vocab_size]).items()},
        "num_distinct_tokens": int((counts > 0).sum()),
        "num_train_loss_tokens": total,
        "num_train_rows": num_train_rows,
        "forced_ids": sorted({int(i) for i in forced_ids}),
        "tokenizer_fingerprint": tokenizer_fingerprint,
    }
    return _save(Path(out_dir), d2t, t2d, info), info


def load_vocab_map(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft], t2d bool [target]) from a vocab_map.safetensors file or its folder, validated."""
    path = Path(path)
    if path.is_dir():
        path = path / MAP_FILE
    tensors = load_file(str(path))
    missing = {"d2t", "t2d"} - tensors.keys()
    if missing:
        raise VocabMapError(f"{path}: missing tensors {sorted(missing)}")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    try:
        validate_maps(d2t, t2d)
    except VocabMapError as exc:
        raise VocabMapError(f"{path}: {exc}") from None
    return d2t, t2d
