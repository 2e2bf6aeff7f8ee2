"""The Trainer record and its setup: the seeded objective in its wrapper, the optimizer and schedule, the data
plans, the metric writers and the resume from the latest intact checkpoint; and how the trainer reads its rows
(the loader over shards or tokenized rows, each row moved to the device with its aux noise)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from eagle3.config import RunConfig
from eagle3.drafter.dflash_loss import DFlashObjective
from eagle3.drafter.ttt import TTTBatch, TTTObjective
from eagle3.run.layout import RunLayout
from eagle3.train import dflash as dflash_step
from eagle3.train import measured
from eagle3.train.build import (
    DataPlan,
    RunInputs,
    build_objective,
    build_optimizer,
    build_scheduler,
    plan_data,
    scaled_lr,
    total_steps_for,
    unigram_token,
)
from eagle3.train.checkpoint import (
    CONFIG_FILE,
    MODEL_FILE,
    CorruptCheckpointError,
    TrainerState,
    check_compatible,
    checkpoints_dir,
    latest_intact_checkpoint,
    load_checkpoint,
    read_info,
    step_dir,
    verify_checkpoint,
)
from eagle3.train.data import PackedBatch, RowLoader, add_aux_noise, batch_to
from eagle3.train.dist import DistInfo, broadcast_object, unwrap, wrap
from eagle3.train.metrics import MetricsWriter, ProgressWriter, drafter_row_flops, peak_flops
from eagle3.train.online import OnlineFeatures, TokenReader
from eagle3.train.step import step_options_for

log = logging.getLogger("eagle3.train")


@dataclass
class Trainer:
    """Everything one training run holds (built by ``setup``)."""

    cfg: RunConfig
    dist: DistInfo
    inputs: RunInputs
    model: nn.Module  # the objective, wrapped in DDP or sharded by FSDP2 (or bare in a one-process world)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    plan: DataPlan
    total_steps: int
    stage_key: str
    unigram: tuple[int, float]  # (token id, share of supervised train tokens)
    metrics: MetricsWriter
    progress: ProgressWriter
    state: TrainerState
    row_flops: float
    peak_flops: float | None
    online: OnlineFeatures | None = None  # train.features=online: the frozen target that fills each row
    tokens: TokenReader | None = None  # online: the rows' token ids and masks, in place of the shards
    measurer: measured.Measurer | None = None  # train.measured, rank 0: the target and prompts it decodes

    @property
    def objective(self) -> TTTObjective:
        """The unwrapped EAGLE-3 objective (supervision, buffers); a DFlash run's is ``dflash``."""
        return cast(TTTObjective, unwrap(self.model))

    @property
    def dflash(self) -> DFlashObjective | None:
        """The unwrapped DFlash objective (drafter.family=dflash), else None."""
        return dflash_step.dflash_of(self.model)

    @property
    def train_dir(self) -> Path:
        """<run>/train."""
        return RunLayout(self.inputs.run_dir).train

    @property
    def float_dtype(self) -> torch.dtype:
        """Feature dtype on the device: bf16 as stored on CUDA (autocast reads it), fp32 on CPU."""
        return torch.bfloat16 if self.dist.device.type == "cuda" else torch.float32


# ------------------------------------------------------------------------------------------------- setup


def setup(cfg: RunConfig, info: DistInfo, inputs: RunInputs, stage_key: str) -> Trainer:
    """Seeded model, wrapper, optimizer, schedule, data plans; resumed from the latest checkpoint. ``stage_key``: the
    train key of ``cfg`` and ``inputs`` (eagle3.train.build.stage_key_for), which the caller computed once already to
    check the manifest; every checkpoint carries it, and one that carries another is refused."""
    import random

    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    plan = plan_data(cfg, inputs, info.world_size)
    total = total_steps_for(cfg, plan)
    objective = build_objective(cfg, inputs, info.device, step_options_for(cfg.train, info.device))
    model = wrap(objective, cfg.train.parallel, info)
    lr = scaled_lr(cfg.train.lr, cfg.train.lr_scaling, plan.rows_per_step, cfg.train.reference_rows_per_step)
    optimizer = build_optimizer(cfg, model, lr, info.device)
    layout = RunLayout(inputs.run_dir)
    unigram = broadcast_object(unigram_token(inputs) if info.is_main else None, info)
    if inputs.dflash is not None:
        row_flops = dflash_step.row_flops(inputs.dflash.dims, cfg.train.tokens_per_row, cfg.drafter.dflash.num_blocks)
    else:
        row_flops = drafter_row_flops(
            inputs.dims, cfg.train.tokens_per_row, cfg.drafter.ttt_steps, inputs.spec.supervision == "final_hidden"
        )["total"]
    tr = Trainer(
        cfg,
        info,
        inputs,
        model,
        optimizer,
        build_scheduler(cfg, optimizer, total),
        plan,
        total,
        stage_key,
        unigram,
        MetricsWriter(layout.metrics, info.is_main),
        ProgressWriter(layout.progress, total, info.is_main, cfg.train.progress_every_s),
        TrainerState(),
        cfg.train.grad_accum_steps * row_flops,
        peak_flops(info.device),
    )
    if cfg.train.features == "online":
        tr.tokens = TokenReader(inputs.tokenized)
        tr.online = OnlineFeatures.from_config(cfg, inputs.model_dir, inputs.spec, info.device, info)
        log.info("train: online target forward %s", tr.online.describe())
    log.info(
        "train: %d steps (%d epochs, %d rows per step, lr %.3e), %d train rows/epoch (fill %.2f, %d truncated), "
        "%d val rows, world %d (%s) on %s",
        total,
        len(plan.train),
        plan.rows_per_step,
        lr,
        len(plan.train[0].rows),
        plan.train[0].stats.fill(cfg.train.tokens_per_row),
        plan.train[0].stats.num_truncated,
        len(plan.val.rows),
        info.world_size,
        cfg.train.parallel,
        info.device,
    )
    tr.measurer = measured.open_measurer(cfg, inputs, info)
    resume(tr)
    return tr


def resume(tr: Trainer) -> None:
    """Continue from the latest intact checkpoint, if any (its config and batch layout must match; rank 0 verifies
    its files' sha256, and those of the best checkpoint it names, for every rank)."""
    chosen: str | CorruptCheckpointError | None = None
    if tr.dist.is_main:
        try:
            chosen = _verified_resume_point(checkpoints_dir(tr.inputs.run_dir))
        except CorruptCheckpointError as exc:
            chosen = exc
    chosen = broadcast_object(chosen, tr.dist)
    if isinstance(chosen, CorruptCheckpointError):
        raise CorruptCheckpointError(str(chosen))
    if chosen is None:
        return
    path = Path(chosen)
    check_compatible(read_info(path), tr.stage_key, tr.plan.rows_per_step)
    tr.state = load_checkpoint(path, tr.model, tr.optimizer, tr.scheduler, tr.dist)
    tr.metrics.keep_until(tr.state.step)
    log.info(
        "train: resuming from %s (step %d, epoch %d, row %d of the epoch)",
        path,
        tr.state.step,
        tr.state.epoch,
        tr.state.epoch_rows_done,
    )


def _verified_resume_point(ckpt_dir: Path) -> str | None:
    """The newest intact checkpoint (damaged newer ones moved aside), after checking the best checkpoint it names:
    train.select=best would ship that one, so a damaged best fails now rather than after training."""
    path = latest_intact_checkpoint(ckpt_dir)
    if path is None:
        return None
    info = read_info(path)
    for best in {info.get("best_step"), info.get("best_measured_step")}:  # (by validation, by measurement)
        if best is not None and step_dir(ckpt_dir, best) != path:
            verify_checkpoint(step_dir(ckpt_dir, best), (MODEL_FILE, CONFIG_FILE))
    return str(path)


# --------------------------------------------------------------------------------------------------- rows


def prepare_row(tr: Trainer, row: PackedBatch, noise: bool) -> TTTBatch:
    """The row on the device, with the configured aux noise when ``noise`` (train rows only)."""
    batch = batch_to(row.batch, tr.dist.device)
    if tr.online is not None:
        batch = tr.online.fill(batch, list(row.lengths), tr.float_dtype, row.ids, host=row.batch)
    if noise and tr.cfg.train.aux_noise != "none":
        assert batch.aux is not None  # (filled above when online)
        batch = dataclasses.replace(
            batch, aux=add_aux_noise(batch.aux, tr.cfg.train.aux_noise, tr.cfg.train.aux_noise_std, row.noise_seed)
        )
    return batch


def row_loader(tr: Trainer, rows: list, **position: int) -> RowLoader:
    """This trainer's loader over ``rows``: shards offline, tokenized rows online (features filled on the device)."""
    return RowLoader(
        tr.inputs.features_dir,
        rows,
        tr.cfg.train.tokens_per_row,
        tr.float_dtype,
        depth=tr.cfg.train.prefetch_rows,
        pin_memory=tr.dist.device.type == "cuda",
        reader=tr.tokens,
        **position,
    )
