"""One EAGLE-3 optimizer step over a rank's prepared rows (steps 2-4 of eagle3.train.loop's docstring): the target's
supervision and the supervised counts of every rank, forward + backward of each row against the global counts, then
clip, AdamW and the schedule. The trainer and the lab's throughput benchmarks take exactly this step."""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import Tensor, nn

from eagle3.config import TrainConfig
from eagle3.drafter.acceptance import TokenLoss
from eagle3.drafter.alignment import align_steps
from eagle3.drafter.model import trainable_parameters
from eagle3.drafter.ttt import StepOptions, TTTBatch, TTTObjective
from eagle3.train.dist import DistInfo, all_reduce_sum, autocast, full_tensor, gradient_sync, unwrap


def step_options_for(train: TrainConfig, device: torch.device) -> StepOptions:
    """The unroll's switches (how the step runs, not what it computes): compiled on CUDA only."""
    return StepOptions(
        compile_backend="inductor" if train.compile != "off" and device.type == "cuda" else None,
        loss_chunk_tokens=train.loss_chunk_tokens,
        reuse_block_mask=train.reuse_block_mask,
    )


def token_loss_for(train: TrainConfig) -> TokenLoss:
    """What each TTT step is scored by: train.loss and its weights (eagle3.drafter.acceptance)."""
    return TokenLoss(train.loss, train.loss_tv_weight, train.loss_lk_eta)


def supervised_counts(objective: TTTObjective, batch: TTTBatch, argmax: Tensor) -> Tensor:
    """[S] positions in each TTT step's loss (the same position masks ttt_loss builds)."""
    assert batch.document_ids is not None  # (collate_row sets it)
    steps = align_steps(
        batch.input_ids, batch.loss_mask, batch.document_ids, argmax, objective.t2d, objective.ttt_steps
    )
    return torch.stack([aligned.position_mask.sum() for aligned in steps])


def supervise(objective: TTTObjective, batches: list[TTTBatch], info: DistInfo) -> tuple[list, Tensor]:
    """(supervision of each row, [S] supervised-token counts summed over the rows of every rank)."""
    with torch.no_grad(), autocast(info):
        sups = [objective.supervision(b) for b in batches]
    counts = cast(Tensor, sum(supervised_counts(objective, b, s.argmax) for b, s in zip(batches, sups)))  # (rows: >= 1)
    return sups, all_reduce_sum(counts.double(), info)


def backward_rows(model: nn.Module, batches: list[TTTBatch], sups: list, counts: Tensor, info: DistInfo) -> Tensor:
    """Forward + backward of every row against the global counts; returns summed metric counts [4, S]."""
    obj = cast(TTTObjective, unwrap(model))
    weights = obj.step_decay ** torch.arange(obj.ttt_steps, device=counts.device, dtype=torch.float32)
    norm = counts.float().clamp_min(1)
    sums = torch.zeros(4, obj.ttt_steps, device=counts.device, dtype=torch.float64)
    for i, (batch, sup) in enumerate(zip(batches, sups)):
        with gradient_sync(model, enabled=i == len(batches) - 1):
            with autocast(info):
                out = model(batch, sup)
                loss = (weights * out.loss_sum / norm).sum() * info.world_size
            loss.backward()
        sums += torch.stack(
            [
                out.loss_sum.detach().double(),
                out.num_predicted.double(),
                out.num_correct.double(),
                out.num_full_correct.double(),
            ]
        )
    return sums


def optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, grad_clip: float
) -> tuple[float, float]:
    """Clip, step, advance the schedule; returns (grad norm before clipping, lr used). A non-finite norm (the same
    on every rank) skips the update: AdamW would turn the weights and its moments into NaN for good."""
    params = trainable_parameters(model)
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf")))
    lr = scheduler.get_last_lr()[0]
    if math.isfinite(float(grad_norm)):
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm), lr


def ttt_update(
    model: nn.Module,
    batches: list[TTTBatch],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    grad_clip: float,
    info: DistInfo,
) -> tuple[Tensor, Tensor, float, float]:
    """One EAGLE-3 optimizer step over this rank's prepared rows, as the trainer takes it: supervision and the
    supervised counts of every rank, forward + backward of each row, then clip and step. ``model`` is the
    TTTObjective or its DDP/FSDP2 wrapper. Returns (this rank's summed metric counts [4, S], every rank's
    supervised counts [S], grad norm before clipping, lr used)."""
    sups, counts = supervise(cast(TTTObjective, unwrap(model)), batches, info)
    sums = backward_rows(model, batches, sups, counts, info)
    grad_norm, lr = optimizer_step(model, optimizer, scheduler, grad_clip)
    return sums, counts, grad_norm, lr
