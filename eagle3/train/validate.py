"""Validation over the val split: the loss, accuracy and acceptance estimate of every TTT step (or DFlash block
slot), rows spread over ranks and repeats not counted, plus the unigram baseline's step-0 accuracy."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from eagle3.drafter.alignment import align_step
from eagle3.drafter.dflash_loss import DFlashObjective
from eagle3.drafter.ttt import TTTBatch, metrics_from_counts
from eagle3.train import dflash as dflash_step
from eagle3.train.data import PackedBatch
from eagle3.train.dist import all_reduce_sum, autocast
from eagle3.train.trainer import Trainer, prepare_row, row_loader


@torch.no_grad()
def evaluate(tr: Trainer) -> dict[str, Any] | None:
    """Metrics over the whole val split (rows spread over ranks, repeats not counted) + the unigram baseline."""
    rows = tr.plan.val.rows_for(tr.dist.rank, tr.dist.world_size)
    if not tr.plan.val.rows:
        return None
    dflash = tr.dflash
    steps = dflash.num_slots if dflash is not None else tr.objective.ttt_steps
    sums = torch.zeros(5 * steps + 1, dtype=torch.float64, device=tr.dist.device)
    loader = row_loader(tr, rows)
    for row in loader:
        batch = prepare_row(tr, row, noise=False)
        if dflash is not None:
            sums += _dflash_eval_row(tr, dflash, batch, row)
            continue
        with autocast(tr.dist):
            sup = tr.objective.supervision(batch)
            out = tr.model(batch, sup)  # through the wrapper: FSDP2 must gather on every rank
        if row.counted:
            sums += _eval_counts(tr, batch, sup.argmax, out)
    all_reduce_sum(sums, tr.dist)
    loss_sum, supervised, predicted, correct, full = sums[:-1].view(5, steps)
    if dflash is not None:
        record = dflash_step.metrics(dflash, loss_sum, supervised, correct, full)
    else:
        record = metrics_from_counts(loss_sum, supervised, predicted, correct, full, tr.objective.step_decay)
    token, share = tr.unigram
    return {
        **record,
        "unigram_acc_0": float(sums[-1] / predicted[0].clamp_min(1)),
        "unigram_token": token,
        "unigram_train_share": share,
        "num_rows": len(tr.plan.val.rows),
    }


def _dflash_eval_row(tr: Trainer, dflash: DFlashObjective, batch: TTTBatch, row: PackedBatch) -> Tensor:
    """The DFlash val sums of one row (eagle3.train.dflash.eval_counts; zeros for a repeat that is not counted)."""
    with autocast(tr.dist):
        anchors = dflash.anchors(batch, row.noise_seed)
        out = tr.model(batch, anchors)  # through the wrapper: FSDP2 must gather on every rank
    counts = dflash_step.eval_counts(out, tr.unigram[0])
    return counts if row.counted else torch.zeros_like(counts)


def _eval_counts(tr: Trainer, batch: TTTBatch, argmax: Tensor, out: Any) -> Tensor:
    """[5 * S + 1] sums of one val row; the last entry counts step-0 hits of the unigram guess."""
    assert batch.document_ids is not None  # (collate_row sets it)
    step0 = align_step(batch.input_ids, batch.loss_mask, batch.document_ids, argmax, tr.objective.t2d, 0)
    unigram_hits = ((step0.target_argmax == tr.unigram[0]) & step0.predicts_marked).sum()
    parts = [out.loss_sum.float(), out.num_supervised, out.num_predicted, out.num_correct, out.num_full_correct]
    return torch.cat([torch.stack([p.double() for p in parts]).flatten(), unigram_hits.double()[None]])
