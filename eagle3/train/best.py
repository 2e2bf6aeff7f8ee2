"""Keeping the best checkpoint by validation: what ``train.select: best`` exports.

Every validation (``train.eval_every_steps`` and the last step) computes accept_len_est; one that beats the
best so far (ties keep the earlier step) makes the loop write a checkpoint of that step if none is due, and the
state it saves names the best step (``best_step``, ``best_accept_len_est`` in trainer.pt and checkpoint.json).
Checkpoint rotation never deletes that step, and a resumed run reads the best so far back from its checkpoint,
so it selects what an uninterrupted run selects. The train manifest records the best checkpoint (and hashes its
weights); the export stage reads it there.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from eagle3.train.checkpoint import TrainerState, checkpoints_dir, step_dir

log = logging.getLogger("eagle3.train")


def note_best(state: TrainerState, rec: dict[str, Any] | None) -> bool:
    """Record the validation ``rec`` of ``state.step`` as the best when its accept_len_est beats the best so far;
    True when it did (the caller then checkpoints this step)."""
    value = (rec or {}).get("accept_len_est")
    if value is None or not math.isfinite(value):
        return False
    if state.best_accept_len_est is not None and value <= state.best_accept_len_est:
        return False
    state.best_step, state.best_accept_len_est = state.step, float(value)
    log.info("train: step %d has the best validation accept_len_est so far (%.4f)", state.step, value)
    return True


def best_stats(state: TrainerState, metrics_path: Path, train_dir: Path) -> dict[str, Any]:
    """The train manifest's record of the best validation: its step, estimate, checkpoint (relative to
    ``train_dir``) and eval record, and every validation's [step, accept_len_est] from metrics.jsonl."""
    from eagle3.train.metrics import read_metrics

    evals = read_metrics(metrics_path, "eval")
    stats: dict[str, Any] = {
        "best_step": state.best_step,
        "best_accept_len_est": state.best_accept_len_est,
        "eval_history": [[e["step"], e["accept_len_est"]] for e in evals if "accept_len_est" in e],
        "best_checkpoint": None,
        "best_eval": None,
    }
    if state.best_step is not None:
        best = step_dir(checkpoints_dir(Path(train_dir).parent), state.best_step)
        stats["best_checkpoint"] = str(best.relative_to(train_dir))
        stats["best_eval"] = next((e for e in reversed(evals) if e["step"] == state.best_step), None)
    return stats
