"""The training loop and the train stage's entry point (``train``): optimizer steps over packed rows, validation and
checkpoints when due, SIGTERM, progress. The Trainer and its setup are eagle3.train.trainer's; validation is
eagle3.train.validate's.

One optimizer step (``train_step``), on every rank:
  1. move its grad_accum_steps rows to the device, add aux noise (seeded per row);
  2. compute the target's supervision of each row (no grad) and each TTT step's supervised-token count,
     summed over the rows of every rank (one all-reduce): N_k;
  3. per row: loss = sum_k decay^k * loss_sum_k / N_k * world_size, backward (gradient sync on the last row
     only). DDP/FSDP average gradients over ranks, so the world_size factor makes the update the gradient of
     ONE masked mean over the whole global batch: 1 process x 2 accumulation steps and 2 processes x 1 step
     take the same step, and a row full of prompt tokens weighs what its supervised tokens weigh;
  4. clip, AdamW, scheduler; one all-reduce of the metric sums (and of the stop flag, so every rank
     stops after the same step). A step whose gradient norm is NaN/inf updates nothing (the schedule advances);
     a loss or gradient norm that stays non-finite for more than train.nonfinite_loss_patience steps in a row
     stops training with NonFiniteLossError before that step is validated or checkpointed.
CPU runs are fp32 and deterministic (same seed -> same losses, resumed or not); CUDA: bf16 autocast, fp32 weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import signal
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.config import RunConfig
from eagle3.drafter.ttt import metrics_from_counts
from eagle3.run.layout import RunLayout, run_relative
from eagle3.train import STAGE, measured
from eagle3.train import dflash as dflash_step
from eagle3.train.best import best_stats, note_best
from eagle3.train.build import read_inputs, stage_key_for
from eagle3.train.checkpoint import (
    CONFIG_FILE,
    INFO_FILE,
    MODEL_FILE,
    checkpoints_dir,
    latest_checkpoint,
    save_checkpoint,
    step_dir,
    verify_checkpoint,
)
from eagle3.train.data import PackedBatch
from eagle3.train.dist import DistInfo, all_reduce_sum, barrier, broadcast_object
from eagle3.train.metrics import format_step_line, mfu
from eagle3.train.step import optimizer_step, ttt_update
from eagle3.train.trainer import Trainer, prepare_row, row_loader, setup
from eagle3.train.validate import evaluate

log = logging.getLogger("eagle3.train")


class NonFiniteLossError(ValueError):
    """Training diverged: the loss (or gradient norm) was NaN or infinite for more steps than the patience allows."""


@dataclass
class TrainResult:
    """How a call ended: done (all steps), stopped (signal or stop_after_steps) or up_to_date."""

    status: str
    step: int
    checkpoint: Path | None
    last_train: dict[str, Any] | None = None
    last_eval: dict[str, Any] | None = None


# -------------------------------------------------------------------------------------------------- steps


def train_step(tr: Trainer, rows: list[PackedBatch], stop_requested: bool) -> tuple[dict[str, Any], bool]:
    """One optimizer step over this rank's rows (module docstring); returns (metrics, any rank asked to stop)."""
    batches = [prepare_row(tr, row, noise=True) for row in rows]
    dflash = tr.dflash
    if dflash is not None:  # blocks of the row instead of TTT steps (eagle3.train.dflash)
        anchors, counts = dflash_step.supervise(dflash, batches, [row.noise_seed for row in rows], tr.dist)
        sums = dflash_step.backward_rows(tr.model, batches, anchors, counts, tr.dist)
        grad_norm, lr = optimizer_step(tr.model, tr.optimizer, tr.scheduler, tr.cfg.train.grad_clip)
    else:
        sums, counts, grad_norm, lr = ttt_update(
            tr.model, batches, tr.optimizer, tr.scheduler, tr.cfg.train.grad_clip, tr.dist
        )
    extra = torch.tensor(
        [sum(r.num_tokens for r in rows), float(stop_requested)], dtype=torch.float64, device=sums.device
    )
    reduced = all_reduce_sum(torch.cat([sums.flatten(), extra]), tr.dist)
    loss_sum, predicted, correct, full = reduced[:-2].view(4, -1)
    if dflash is not None:
        record = dflash_step.metrics(dflash, loss_sum, counts, correct, full)
    else:
        record = metrics_from_counts(loss_sum, counts, predicted, correct, full, tr.objective.step_decay)
    return {**record, "lr": lr, "grad_norm": grad_norm, "num_tokens": int(reduced[-2])}, bool(reduced[-1] > 0)


# --------------------------------------------------------------------------------------------------- loop


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop finishes its step, checkpoints and exits cleanly."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def __enter__(self) -> StopSignal:
        with contextlib.suppress(ValueError):  # not the main thread: no handlers (tests, notebooks)
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def micro_batch_windows(tr: Trainer) -> Generator[list[PackedBatch], None, None]:
    """This rank's rows in groups of grad_accum_steps, from the sampler position on, epoch after epoch."""
    accum, world = tr.cfg.train.grad_accum_steps, tr.dist.world_size
    while tr.state.epoch < len(tr.plan.train):
        epoch = tr.state.epoch
        rows = tr.plan.train[epoch].rows_for(tr.dist.rank, world)
        loader = iter(row_loader(tr, rows, start=tr.state.rank_index(world), epoch=epoch, seed=tr.cfg.run.seed))
        try:
            while window := list(itertools.islice(loader, accum)):
                yield window
        finally:
            loader.close()


def advance(tr: Trainer, num_tokens: int) -> None:
    """Count a finished step and move the sampler position (to the next epoch at an epoch's end)."""
    s = tr.state
    s.step += 1
    s.tokens_seen += num_tokens
    s.epoch_rows_done += tr.plan.rows_per_step
    if s.epoch_rows_done >= len(tr.plan.train[s.epoch].rows):
        s.epoch, s.epoch_rows_done = s.epoch + 1, 0


def save(tr: Trainer, last: dict[str, Any] | None) -> Path:
    """A checkpoint of the current state (every rank takes part)."""
    info = {
        "stage_key": tr.stage_key,
        "rows_per_step": tr.plan.rows_per_step,
        "total_steps": tr.total_steps,
        "metrics": last or {},
    }
    path = save_checkpoint(
        checkpoints_dir(tr.inputs.run_dir),
        tr.model,
        tr.optimizer,
        tr.scheduler,
        tr.state,
        tr.cfg.model_dump_json(indent=2) + "\n",
        info,
        tr.dist,
        tr.cfg.train.keep_checkpoints,
    )
    log.info("train: checkpoint %s written", path)
    return path


@dataclass
class LoopClock:
    """Step timing for tokens/s, MFU and the ETA (averaged over this invocation's steps)."""

    start_s: float = dataclasses.field(default_factory=time.perf_counter)
    num_steps: int = 0

    def eta_s(self, steps_left: int) -> float:
        """Seconds left at the average pace so far."""
        return (time.perf_counter() - self.start_s) / max(self.num_steps, 1) * steps_left


def _record(tr: Trainer, epoch: int, metrics: dict[str, Any], step_s: float) -> dict[str, Any]:
    """The metrics.jsonl record of the step just finished (``epoch``: the one its rows came from)."""
    rec = {
        "type": "train",
        "step": tr.state.step,
        "epoch": epoch,
        **metrics,
        "step_s": step_s,
        "tokens_per_s": metrics["num_tokens"] / max(step_s, 1e-9),
        "tokens_seen": tr.state.tokens_seen,
    }
    rec["mfu"] = mfu(tr.row_flops, step_s, tr.peak_flops)
    return rec


def _report(tr: Trainer, rec: dict[str, Any], clock: LoopClock) -> None:
    tr.metrics.write(rec)
    log.info(format_step_line(rec, tr.total_steps))
    tr.progress.update(
        step=tr.state.step,
        epoch=tr.state.epoch,
        loss=rec["loss"],
        acc_0=rec.get("acc_0"),
        tokens_per_s=rec["tokens_per_s"],
        eta_s=clock.eta_s(tr.total_steps - tr.state.step),
    )


def _run_eval(tr: Trainer) -> dict[str, Any] | None:
    rec = evaluate(tr)
    if rec is not None:
        rec = {"type": "eval", "step": tr.state.step, "epoch": tr.state.epoch, **rec}
        tr.metrics.write(rec)
        log.info(
            "eval step %d: loss %.4f acc_0 %.3f (unigram %.3f) accept_len_est %.3f",
            tr.state.step,
            rec["loss"],
            rec.get("acc_0", 0.0),
            rec["unigram_acc_0"],
            rec["accept_len_est"],
        )
        tr.progress.update(force=True, last_eval=rec)
    if tr.online is not None and tr.online.cache is not None:  # what the cache saved so far
        log.info("train: %s", tr.online.cache.describe())
    return rec


def run(tr: Trainer, stop_after_steps: int | None = None) -> TrainResult:
    """Train until the last step, a signal, or ``stop_after_steps`` steps of this call (then checkpoint)."""
    t, clock = tr.cfg.train, LoopClock()
    last_train = last_eval = None
    saved_at, evaluated_at, checkpoint = -1, -1, latest_checkpoint(checkpoints_dir(tr.inputs.run_dir))
    non_finite = 0  # steps in a row with a NaN/inf loss or gradient norm
    tr.progress.update(force=True, step=tr.state.step, epoch=tr.state.epoch)
    with StopSignal() as stop:
        windows = micro_batch_windows(tr)
        step_start = time.perf_counter()
        for window in windows:
            if tr.state.step >= tr.total_steps or measured.patience_spent(tr):
                break
            limit_hit = stop_after_steps is not None and clock.num_steps + 1 >= stop_after_steps
            epoch = tr.state.epoch
            metrics, stopping = train_step(tr, window, stop.signum is not None or limit_hit)
            advance(tr, metrics["num_tokens"])
            clock.num_steps += 1
            now = time.perf_counter()
            last_train = _record(tr, epoch, metrics, now - step_start)
            _report(tr, last_train, clock)
            non_finite = check_finite_step(tr, last_train, non_finite)
            improved = False
            if (t.eval_every_steps and tr.state.step % t.eval_every_steps == 0) or tr.state.step >= tr.total_steps:
                last_eval, evaluated_at = _run_eval(tr), tr.state.step
                improved = note_best(tr.state, last_eval)
            improved |= measured.measure_if_due(tr)
            if (t.checkpoint_every_steps and tr.state.step % t.checkpoint_every_steps == 0) or stopping or improved:
                checkpoint, saved_at = save(tr, last_train), tr.state.step
            if stopping and tr.state.step < tr.total_steps:
                assert checkpoint is not None  # (saved above: stopping saves one)
                windows.close()
                return _stopped(tr, stop.signum, checkpoint, last_train, last_eval)
            step_start = time.perf_counter()
        windows.close()
    improved = False
    if evaluated_at != tr.state.step:  # e.g. resumed from the final step's checkpoint before the manifest
        rec = _run_eval(tr)
        improved, last_eval = note_best(tr.state, rec), rec or last_eval
    improved |= measured.measure_if_due(tr, final=True)
    if saved_at != tr.state.step or improved:
        checkpoint = save(tr, last_train)
    return TrainResult("done", tr.state.step, checkpoint, last_train, last_eval)


def check_finite_step(tr: Trainer, rec: dict[str, Any], streak: int) -> int:
    """The count of non-finite steps in a row after the step ``rec`` records; NonFiniteLossError past the patience.

    Every rank sees the same reduced loss and global gradient norm, so every rank stops at the same step."""
    if math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"]):
        return 0
    patience = tr.cfg.train.nonfinite_loss_patience
    if streak + 1 > patience:
        raise NonFiniteLossError(
            f"training diverged: step {tr.state.step} has loss {rec['loss']} and gradient norm {rec['grad_norm']}, "
            f"{streak + 1} non-finite step(s) in a row (train.nonfinite_loss_patience={patience}); nothing of it was "
            f"checkpointed: lower train.lr, check the data, or raise the patience, then rerun to resume from the last "
            f"checkpoint"
        )
    log.warning(
        "train: step %d has a non-finite loss or gradient norm (loss %s, grad norm %s): update skipped "
        "(%d of %d in a row allowed)",
        tr.state.step,
        rec["loss"],
        rec["grad_norm"],
        streak + 1,
        patience,
    )
    return streak + 1


def _stopped(
    tr: Trainer, signum: int | None, checkpoint: Path, last_train: dict | None, last_eval: dict | None
) -> TrainResult:
    why = f"received {signal.Signals(signum).name}" if signum is not None else "stop_after_steps reached"
    log.warning(
        "train: %s: finished step %d, checkpoint %s written, exiting cleanly (rerun the same command to resume)",
        why,
        tr.state.step,
        checkpoint,
    )
    tr.progress.update(
        state="stopped", force=True, step=tr.state.step, checkpoint=run_relative(tr.inputs.run_dir, checkpoint)
    )
    return TrainResult("stopped", tr.state.step, checkpoint, last_train, last_eval)


# ----------------------------------------------------------------------------------------------- the stage


def train(cfg: RunConfig, stop_after_steps: int | None = None, known_key: str | None = None) -> TrainResult:
    """The train stage in this process: join torchrun's group (if any), lock the run, skip when the manifest
    matches, else set up, resume, train, and write train.manifest.json when all steps are done.

    ``known_key``: the train key of ``cfg`` when the caller computed it already (it is computed once per run of
    the stage). It is taken as given, not checked: a wrong one would name this training's manifest and checkpoints
    after other inputs. The pipeline's train task is the only caller that passes one; its cache-key function
    computed it from this very config, under the run lock its flow holds until the training ends, so no input
    stage can change in between (tasks/train.py)."""
    from eagle3.train.dist import init_distributed, shutdown

    info = init_distributed(cfg.train.device)
    try:
        with _run_locked(cfg, info):
            return _train(cfg, info, stop_after_steps, known_key)
    finally:
        shutdown(info)


@contextlib.contextmanager
def _run_locked(cfg: RunConfig, info: DistInfo) -> Iterator[None]:
    """Rank 0 holds the run lock; every rank fails with the holder's name when it is taken."""
    from eagle3.run.layout import write_run_config
    from infra.storage import LockHeldError, run_lock

    with contextlib.ExitStack() as stack:
        error = None
        if info.is_main:
            try:
                stack.enter_context(run_lock(cfg.run_dir, owner="python -m eagle3.train"))
                write_run_config(cfg)
            except LockHeldError as exc:
                error = str(exc)
        error = broadcast_object(error, info)
        if error:
            raise LockHeldError(error)
        yield


def _prepare_target(cfg: RunConfig, info: DistInfo) -> Path:
    """The target directory; rank 0 first, since it may build or convert it into the cache."""
    from eagle3.target.load import prepare_target

    model_dir = prepare_target(cfg) if info.is_main else None
    barrier(info)
    return model_dir if model_dir is not None else prepare_target(cfg)


def _train(cfg: RunConfig, info: DistInfo, stop_after_steps: int | None, known_key: str | None) -> TrainResult:
    from eagle3.run.stage import manifest_matches

    inputs = read_inputs(cfg, _prepare_target(cfg, info))
    if cfg.train.features == "online" and info.is_main:
        from eagle3.features.run_spec import save_or_check_spec

        save_or_check_spec(inputs.features_dir, inputs.spec)  # export and evaluation read what was trained on
    manifest = RunLayout(inputs.run_dir).manifest(STAGE)
    key = known_key or stage_key_for(cfg, inputs)  # the one computation of this run's key (train's docstring)
    if broadcast_object(manifest_matches(manifest, key) if info.is_main else None, info):
        log.info("train: up to date (%s), nothing to do", manifest)
        return TrainResult("up_to_date", -1, None)
    if info.is_main:
        manifest.unlink(missing_ok=True)
    tr = setup(cfg, info, inputs, key)
    try:
        result = run(tr, stop_after_steps)
    except BaseException as exc:
        tr.progress.update(state="failed", force=True, error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        tr.metrics.close()
    if result.status == "done":
        _finish(tr, result)
    return result


def _finish(tr: Trainer, result: TrainResult) -> None:
    """train.manifest.json (rank 0) naming the final and the best checkpoint and their metrics; progress 'done'."""
    from eagle3.run.stage import write_manifest

    if tr.dist.is_main:
        final = result.checkpoint
        assert final is not None  # (a done run has its final checkpoint)
        verify_checkpoint(final, (MODEL_FILE, CONFIG_FILE))  # the manifest hashes what is on disk: bless only
        if tr.state.best_step is not None:  # what was written (the best may be a checkpoint of an earlier call)
            verify_checkpoint(step_dir(checkpoints_dir(tr.inputs.run_dir), tr.state.best_step), (MODEL_FILE,))
        outputs = {"model": final / MODEL_FILE, "checkpoint": final / INFO_FILE, "config": final / CONFIG_FILE}
        packing = [dataclasses.asdict(p.stats) for p in tr.plan.train]  # per epoch: rows, truncations, repeats
        stats = {
            "final_checkpoint": str(final.relative_to(tr.train_dir)),
            "step": result.step,
            "total_steps": tr.total_steps,
            "train": result.last_train,
            "eval": result.last_eval,
            "packing": packing,
            "rows_per_step": tr.plan.rows_per_step,
            **best_stats(tr.state, tr.metrics.path, tr.train_dir),
        }
        if tr.state.best_step is not None:
            outputs["best_model"] = tr.train_dir / stats["best_checkpoint"] / MODEL_FILE
        measured_stats, measured_outputs = measured.manifest_part(tr)  # ({}, {}) while train.measured is off
        stats, outputs = stats | measured_stats, outputs | measured_outputs
        write_manifest(RunLayout(tr.inputs.run_dir).manifest(STAGE), STAGE, tr.stage_key, outputs, stats)
    tr.progress.update(
        state="done",
        force=True,
        step=result.step,
        checkpoint=run_relative(tr.inputs.run_dir, result.checkpoint) if result.checkpoint else None,
        eta_s=0.0,
    )
    log.info("train: done after %d steps; final checkpoint %s", result.step, result.checkpoint)
    barrier(tr.dist)
