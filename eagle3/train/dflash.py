"""DFlash in the train stage (``drafter.family: dflash``): the drafter's sizes and layers from the target, its
objective, and the parts of a training step that differ from EAGLE-3's unroll (eagle3.train.loop calls them).

The features are the ones capture stores for EAGLE-3 (the aux layers, output-of-layer ids); the drafter reads
``drafter.dflash.target_layer_ids`` of them (default: all of them, ascending), so one capture serves both families.
The drafter is as wide as the target (hidden size, heads, head dim, MLP width, RoPE, as the published DFlash
drafts), with ``drafter.dflash.num_layers`` layers; its embeddings and lm_head are the target's, frozen.

One optimizer step over a window of rows (eagle3.train.loop for EAGLE-3 does the same with TTT steps):
  1. anchors per row from a generator seeded by the row's seed (eagle3.train.data.noise_seed: (seed, epoch, row)),
     so a resumed run draws the blocks an uninterrupted one draws;
  2. N_k = targets scored at slot k, summed over the window's rows on every rank (one all-reduce);
  3. per row: loss = sum_k w_k loss_sum_k / sum_k w_k N_k x world_size, then backward. DDP/FSDP average over the
     ranks, so the update is the gradient of ONE weighted mean over the global batch (dflash_loss's formula):
     1 process x 2 accumulation steps and 2 processes x 1 step take the same step.
Metrics carry EAGLE-3's names with k = slot - 1 (acc_0 is the first draft's accuracy); accept_len_est is the same
estimate (1 + sum_k prod_{i<=k} acc_i), so validation picks the best checkpoint by the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from eagle3.config import RunConfig
from eagle3.drafter.dflash import DFlashDims, DFlashDrafter, init_dflash_weights
from eagle3.drafter.dflash_loss import DFlashLossOutput, DFlashObjective, slot_weights
from eagle3.drafter.ttt import TTTBatch, metrics_from_counts
from eagle3.train.dist import DistInfo, all_reduce_sum, autocast, gradient_sync, unwrap

Anchors = tuple[Tensor, Tensor]
"""(anchors int64 [B, N], valid bool [B, N]) of one row (DFlashObjective.anchors)."""


# ------------------------------------------------------------------------------------------------- set-up


@dataclass(frozen=True)
class DFlashSetup:
    """What a DFlash drafter of this run is: its sizes, the target layers it reads and where they sit in the
    captured aux states."""

    dims: DFlashDims
    target_layer_ids: list[int]  # ascending, output-of-layer ids: fc's order and the export's dflash_config
    num_target_layers: int
    feature_index: list[int]  # place of each target layer among the captured aux layers
    num_aux: int  # aux layers captured


def mask_token_id_for(cfg: RunConfig, model_dir: Path) -> int:
    """drafter.dflash.mask_token_id, else the tokenizer's pad token, else its eos (a row of the target's
    embedding: SGLang cannot add one for a DFlash drafter)."""
    if cfg.drafter.dflash.mask_token_id is not None:
        return cfg.drafter.dflash.mask_token_id
    from eagle3.target.load import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    token = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError(
            f"the tokenizer of {model_dir} has neither a pad nor an eos token: set "
            "drafter.dflash.mask_token_id to an id of the target's vocab"
        )
    return int(token)


def dflash_setup(cfg: RunConfig, model_dir: Path, aux_layer_ids: list[int]) -> DFlashSetup:
    """The DFlash drafter of ``cfg`` for the target in ``model_dir`` whose aux layers ``aux_layer_ids`` are captured;
    ValueError naming the field when it asks for a layer the capture does not store or a train.loss other than kl."""
    from eagle3.target.load import target_info
    from eagle3.target.tensors import drafter_dims

    if cfg.train.loss != "kl":  # its loss is a CE against the row's tokens: no target distribution to overlap
        raise ValueError(
            f"train.loss={cfg.train.loss} scores EAGLE-3 steps only; drafter.family=dflash trains with "
            "its own cross-entropy (train.loss=kl)"
        )
    d, info = cfg.drafter.dflash, target_info(Path(model_dir), cfg.target)
    ids = list(d.target_layer_ids) if d.target_layer_ids is not None else sorted(aux_layer_ids)
    missing = [i for i in ids if i not in aux_layer_ids]
    if missing:
        raise ValueError(
            f"drafter.dflash.target_layer_ids {ids}: layers {missing} are not among the captured aux "
            f"layers {aux_layer_ids}; add them to target.aux_layer_ids so that capture stores them"
        )
    mask = mask_token_id_for(cfg, model_dir)
    if not 0 <= mask < info.vocab_size:
        raise ValueError(f"drafter.dflash.mask_token_id {mask} is outside the target's vocab [0, {info.vocab_size})")
    base = drafter_dims(info, model_dir, draft_vocab_size=info.vocab_size)  # the target's widths, heads, RoPE
    dims = DFlashDims(
        hidden_size=base.hidden_size,
        num_attention_heads=base.num_attention_heads,
        num_key_value_heads=base.num_key_value_heads,
        head_dim=base.head_dim,
        intermediate_size=base.intermediate_size,
        num_hidden_layers=d.num_layers,
        rms_norm_eps=base.rms_norm_eps,
        rope_theta=base.rope_theta,
        rope_scaling=base.rope_scaling,
        vocab_size=info.vocab_size,
        num_context_features=len(ids),
        block_size=d.block_size,
        mask_token_id=mask,
        max_position_embeddings=base.max_position_embeddings,
    )
    return DFlashSetup(dims, ids, info.num_layers, [aux_layer_ids.index(i) for i in ids], len(aux_layer_ids))


def build_dflash_objective(
    cfg: RunConfig, setup: DFlashSetup, model_dir: Path, device: torch.device
) -> DFlashObjective:
    """Seeded drafter with the target's frozen embeddings and lm_head, inside its objective, on ``device``."""
    from eagle3.target.load import EMBED_TENSOR, read_tensor
    from eagle3.target.tensors import load_target_lm_head

    drafter = DFlashDrafter(setup.dims)
    init_dflash_weights(drafter, std=cfg.drafter.init_std, seed=cfg.run.seed)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(read_tensor(Path(model_dir), EMBED_TENSOR))  # [V, H]
        drafter.lm_head.weight.copy_(load_target_lm_head(model_dir))  # [V, H]
    d = cfg.drafter.dflash
    if d.init == "target":
        from eagle3.train.dflash_init import init_from_target

        init_from_target(drafter, Path(model_dir), setup.target_layer_ids, setup.num_target_layers)
    objective = DFlashObjective(
        drafter,
        setup.feature_index,
        setup.num_aux,
        d.num_blocks,
        d.loss_decay_gamma,
        labels=d.labels,
        attn_impl=cfg.drafter.attn_impl,
        loss_chunk=cfg.train.loss_chunk_tokens,
    )
    return objective.to(device)


# ------------------------------------------------------------------------------------------------ the step


def dflash_of(model: nn.Module) -> DFlashObjective | None:
    """The DFlash objective inside a (possibly wrapped) training model, None for another family."""
    inner = unwrap(model)
    return inner if isinstance(inner, DFlashObjective) else None


def supervise(
    objective: DFlashObjective, batches: list[TTTBatch], seeds: list[int], info: DistInfo
) -> tuple[list[Anchors], Tensor]:
    """(anchors of each row, [K-1] scored targets per slot summed over the rows of every rank)."""
    anchors = [objective.anchors(b, seed) for b, seed in zip(batches, seeds)]
    counts = torch.stack([objective.supervised_counts(b, a) for b, a in zip(batches, anchors)]).sum(0)
    return anchors, all_reduce_sum(counts.double(), info)


def backward_rows(
    model: nn.Module, batches: list[TTTBatch], anchors: list[Anchors], counts: Tensor, info: DistInfo
) -> Tensor:
    """Forward + backward of every row against the global counts (module docstring); summed counts [4, K-1]:
    CE sums, scored targets, correct drafts, drafts correct with every earlier slot of their block."""
    obj = dflash_of(model)
    assert obj is not None, "a DFlash objective"
    weights = slot_weights(obj.drafter.dims.block_size, obj.gamma, counts.device)  # [K-1] fp32
    norm = (weights.double() * counts).sum().clamp_min(torch.finfo(torch.float32).tiny).float()
    sums = torch.zeros(4, obj.num_slots, device=counts.device, dtype=torch.float64)
    for i, (batch, anchor) in enumerate(zip(batches, anchors)):
        with gradient_sync(model, enabled=i == len(batches) - 1):
            with autocast(info):
                out: DFlashLossOutput = model(batch, anchor)
                loss = (weights * out.loss_sum).sum() / norm * info.world_size
            loss.backward()
        sums += _count_rows(out)
    return sums


def _count_rows(out: DFlashLossOutput) -> Tensor:
    return torch.stack(
        [
            out.loss_sum.detach().double(),
            out.num_supervised.double(),
            out.num_correct.double(),
            out.num_full_correct.double(),
        ]
    )


def metrics(
    objective: DFlashObjective, loss_sum: Tensor, num_supervised: Tensor, num_correct: Tensor, num_full_correct: Tensor
) -> dict[str, Any]:
    """Per-slot metrics under EAGLE-3's names (module docstring); ``loss`` is the weighted mean trained on."""
    record = metrics_from_counts(loss_sum, num_supervised, num_supervised, num_correct, num_full_correct)
    weights = slot_weights(objective.drafter.dims.block_size, objective.gamma, loss_sum.device).double()
    weighted_count = (weights * num_supervised.double()).sum().clamp_min(torch.finfo(torch.float64).tiny)
    mean = (weights * loss_sum.double()).sum() / weighted_count
    return {**record, "loss": float(mean)}


def eval_counts(out: DFlashLossOutput, unigram_token: int) -> Tensor:
    """[5 * (K-1) + 1] sums of one val row (the layout eagle3.train.validate.evaluate reduces); the last entry counts
    the scored first-slot references (the target's argmax, as EAGLE-3's) that equal the unigram guess."""
    unigram_hits = ((out.reference[..., 0] == unigram_token) & out.supervised[..., 0]).sum()
    rows = _count_rows(out)
    parts = [rows[0], rows[1], rows[1], rows[2], rows[3]]  # every scored target is a prediction
    return torch.cat([torch.stack(parts).flatten(), unigram_hits.double()[None]])


def row_flops(dims: DFlashDims, seq_len: int, num_blocks: int) -> float:
    """FLOPs of one training step over a packed row of ``seq_len`` tokens with ``num_blocks`` blocks (x3 for the
    backward, as eagle3.train.metrics counts): fc and the context keys/values per token, the layers and the target
    lm_head per block token, and the attention each block token needs: its own block and the context before its
    anchor, half the row on average for anchors spread over it (the useful work, whichever kernel runs it: the
    dense mask computes every key, flex skips the tiles no block sees)."""
    h, hd, layers = dims.hidden_size, dims.head_dim, dims.num_hidden_layers
    heads, kv = dims.num_attention_heads, dims.num_key_value_heads
    block_tokens = num_blocks * dims.block_size
    per_layer_token = 2 * h * (heads + 2 * kv) * hd + 2 * heads * hd * h + 2 * 3 * h * dims.intermediate_size
    context = seq_len * (2 * dims.num_context_features * h * h + layers * 2 * h * 2 * kv * hd)
    linear = block_tokens * (layers * per_layer_token + 2 * h * dims.vocab_size) + context
    attention = layers * block_tokens * (seq_len // 2 + dims.block_size) * 4 * hd * heads
    return float(3 * (linear + attention))
