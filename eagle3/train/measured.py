"""Measured acceptance during training (``train.measured``): a short real speculative decode of the current weights.

Every ``train.measured.every_steps`` optimizer steps, and at the last step, rank 0 decodes the first ``num_prompts``
prompts of ``train.measured.prompts`` (else of evaluate.datasets), ``max_new_tokens`` each, with greedy chain drafting
(``chain_steps`` drafts, topk 1) verified by the target: eagle3.evaluate.speculate.speculative_decode with the eager
runners, the code the evaluate stage measures with. Its acceptance length (tokens committed per verify forward, bonus
included: the evaluation's definition) goes to metrics.jsonl as a ``measured`` record, beside the teacher-forced
``accept_len_est`` of the validations. A measurement above the best so far (ties keep the earlier step) makes the
loop checkpoint that step; the trainer state names it (``best_measured_step``), so rotation keeps it, a resumed run
continues from it, and the train manifest records it for ``train.select: measured``. With ``patience`` K > 0 training
stops after K measurements in a row without a new best (the run is done: final validation, checkpoint, manifest).

The measurement changes nothing training writes: it decodes a copy of the weights (gathered as a checkpoint gathers
them) in a drafter module of its own, without gradients, and the random streams that loading its models draws from
are forked and put back, so weights and losses are the same with and without it (tests/unit/test_train_measured.py).
What it costs: a second copy of the target (and of the drafter) on rank 0's device, loaded once; per measurement one
weight gather and about num_prompts x max_new_tokens / acceptance target forwards on rank 0 while the other ranks wait.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import Tensor, nn

from eagle3.config import ConfigError, RunConfig
from eagle3.config_measured import MeasuredConfig
from eagle3.drafter.model import DrafterDims
from eagle3.features.spec import FeatureSpec
from eagle3.train.checkpoint import TrainerState, checkpoints_dir, step_dir, to_export_names
from eagle3.train.dist import DistInfo, broadcast_object
from eagle3.train.metrics import MetricsWriter, ProgressWriter

if TYPE_CHECKING:
    from eagle3.drafter.model import Eagle3Drafter
    from eagle3.evaluate.runners import TargetRunner

log = logging.getLogger("eagle3.train")

RECORD_TYPE = "measured"
"""The metrics.jsonl type of a measurement's record."""


class Inputs(Protocol):
    """What loading reads of eagle3.train.build.RunInputs (a Protocol: this module sits below build and the loop)."""

    @property
    def model_dir(self) -> Path: ...
    @property
    def spec(self) -> FeatureSpec: ...
    @property
    def dims(self) -> DrafterDims: ...
    @property
    def d2t(self) -> Tensor: ...  # [Vd] int64
    @property
    def t2d(self) -> Tensor: ...  # [V] bool


class Training(Protocol):
    """What measuring reads and updates of eagle3.train.trainer.Trainer."""

    cfg: RunConfig
    dist: DistInfo
    model: nn.Module
    state: TrainerState
    total_steps: int
    metrics: MetricsWriter
    progress: ProgressWriter
    measurer: Measurer | None

    @property
    def train_dir(self) -> Path: ...


@dataclass
class Measurer:
    """What rank 0 decodes with: the target, a drafter module of its own, the rendered prompts and stop ids."""

    settings: MeasuredConfig
    target: TargetRunner
    drafter: Eagle3Drafter  # its trainable weights are replaced by the trained ones before every measurement
    d2t: Tensor  # [Vd] on the device
    prompts: list[list[int]]  # token ids of each prompt, rendered with the target's chat template
    stop_ids: list[int]


def enabled(cfg: RunConfig) -> bool:
    """True when train.measured is on (every_steps > 0)."""
    return cfg.train.measured.every_steps > 0


def prompt_sets(cfg: RunConfig) -> list[str]:
    """The prompt sets measured: train.measured.prompts, else evaluate.datasets."""
    return list(cfg.train.measured.prompts or cfg.evaluate.datasets)


def key_extra(cfg: RunConfig) -> dict[str, Any]:
    """The train key's part beyond the train section: the prompt sets measured and every prompt file's sha256 (what is
    measured picks the best checkpoint); {} while train.measured is off, so those keys stay as they were."""
    if not enabled(cfg):
        return {}
    from eagle3.evaluate.prompts import prompt_file_hashes

    sets = prompt_sets(cfg)
    return {"measured_prompts": sets, "measured_prompt_files": prompt_file_hashes(sets)}


# ------------------------------------------------------------------------------------------------- loading


@contextlib.contextmanager
def kept_random_state(device: torch.device) -> Iterator[None]:
    """Put the python, torch CPU and ``device``'s CUDA random states back on exit: building a module draws its init
    from them, and training must draw what it would have drawn without the measurement."""
    state = random.getstate()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield
    random.setstate(state)


def decode_dtype(settings: MeasuredConfig, device: torch.device) -> torch.dtype:
    """train.measured.dtype for ``device``: auto = bfloat16 on cuda, float32 on cpu."""
    name = settings.dtype if settings.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    return getattr(torch, name)


def open_measurer(cfg: RunConfig, inputs: Inputs, info: DistInfo) -> Measurer | None:
    """Rank 0's Measurer (None on other ranks and while train.measured is off); the target loaded once, the prompts
    rendered once. ConfigError for a drafter family the chain decode cannot draft with."""
    if not enabled(cfg):
        return None
    if cfg.drafter.family != "eagle3":
        raise ConfigError(
            f"train.measured decodes EAGLE-3 chains; drafter.family={cfg.drafter.family} is not "
            "measured during training: set train.measured.every_steps=0"
        )
    if not info.is_main:
        return None
    with kept_random_state(info.device):
        return _load(cfg, inputs, info.device)


def _load(cfg: RunConfig, inputs: Inputs, device: torch.device) -> Measurer:
    from eagle3.drafter.model import Eagle3Drafter
    from eagle3.evaluate.prompts import load_prompts
    from eagle3.evaluate.runners import TargetRunner
    from eagle3.target.load import load_model, load_tokenizer, stop_token_ids, target_info
    from eagle3.target.tensors import load_target_weights

    settings, dtype = cfg.train.measured, decode_dtype(cfg.train.measured, device)
    tokenizer = load_tokenizer(inputs.model_dir)
    items = load_prompts(prompt_sets(cfg), settings.num_prompts, tokenizer)[: settings.num_prompts]
    if not items:
        raise ConfigError(f"train.measured: no prompt in {prompt_sets(cfg)}")
    model = load_model(inputs.model_dir, str(dtype).removeprefix("torch."), str(device))
    drafter = Eagle3Drafter(inputs.dims)
    load_target_weights(drafter, inputs.model_dir, inputs.t2d, init_lm_head_from_target=False)  # the embeddings
    drafter = drafter.to(device=device, dtype=dtype).eval()
    stop_ids = stop_token_ids(tokenizer, target_info(inputs.model_dir, cfg.target))
    log.info(
        "train: measured acceptance every %d steps on %d prompts of %s, %d new tokens each, chain %d",
        settings.every_steps,
        len(items),
        prompt_sets(cfg),
        settings.max_new_tokens,
        settings.chain_steps,
    )
    return Measurer(
        settings,
        TargetRunner(model, inputs.spec.aux_layer_ids),
        drafter,
        inputs.d2t.to(device),
        [ids for _, ids in items],
        stop_ids,
    )


# ----------------------------------------------------------------------------------------------- measuring


def gather_weights(model: nn.Module) -> dict[str, Tensor]:
    """The drafter's trainable weights, full, on the CPU, by their export names (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True, cpu_offload=True)
    return to_export_names(cast(dict[str, Tensor], get_model_state_dict(model, options=options)))  # (all tensors)


@torch.no_grad()
def decode(m: Measurer, weights: dict[str, Tensor]) -> dict[str, Any]:
    """The measurement of ``weights``: every prompt decoded by chain drafting and greedy verification; acceptance
    length = tokens committed by verify forwards / verify forwards (the prefill's first token in neither)."""
    with kept_random_state(m.target.device):  # training draws what it would have drawn without the measurement
        return _decode(m, weights)


def _decode(m: Measurer, weights: dict[str, Tensor]) -> dict[str, Any]:
    from eagle3.evaluate.proposers import EagleProposer
    from eagle3.evaluate.speculate import speculative_decode

    loaded = m.drafter.load_state_dict(weights, strict=False)  # copies (and casts) into the decode's own drafter
    if loaded.unexpected_keys or set(loaded.missing_keys) != {"embed_tokens.weight"}:
        raise RuntimeError(
            f"train.measured: trained weights do not fit the drafter: missing {loaded.missing_keys}, "
            f"unexpected {loaded.unexpected_keys}"
        )
    proposer = EagleProposer(m.drafter, m.d2t, m.settings.chain_steps)
    start = time.perf_counter()
    results = [speculative_decode(m.target, proposer, ids, m.settings.max_new_tokens, m.stop_ids) for ids in m.prompts]
    m.target.reset()  # free the KV caches until the next measurement
    proposer.reset()
    committed = sum(s.committed for r in results for s in r.steps)
    verifies = sum(len(r.steps) for r in results)
    return {
        "accept_len": committed / max(verifies, 1),
        "num_prompts": len(results),
        "num_tokens": sum(len(r.tokens) for r in results),
        "num_verify": verifies,
        "chain_steps": m.settings.chain_steps,
        "decode_s": round(time.perf_counter() - start, 4),
    }


def due(tr: Training, final: bool = False) -> bool:
    """Whether this step is measured: every every_steps steps, the last step, and where the run ends (``final``);
    never twice (a run resumed from a measured step's checkpoint has measured it)."""
    every, step = tr.cfg.train.measured.every_steps, tr.state.step
    if not every or tr.state.measured_step == step:
        return False
    return final or step % every == 0 or step >= tr.total_steps


def measure_if_due(tr: Training, final: bool = False) -> bool:
    """Measure this step when it is due (every rank takes part: the weight gather may be a collective, and all ranks
    get the result); writes the record; True when it is the best measurement so far (the caller checkpoints)."""
    if not due(tr, final):
        return False
    weights = gather_weights(tr.model)
    result = decode(tr.measurer, weights) if tr.measurer is not None else None
    result = broadcast_object(result, tr.dist)
    best = note_measured(tr.state, result["accept_len"])
    rec = {
        "type": RECORD_TYPE,
        "step": tr.state.step,
        "epoch": tr.state.epoch,
        "tokens_seen": tr.state.tokens_seen,
        **result,
    }
    tr.metrics.write(rec)
    tr.progress.update(force=True, last_measured=rec)
    log.info(
        "measured step %d: accept_len %.3f over %d verify forwards (%d tokens, %.1f s)%s",
        rec["step"],
        rec["accept_len"],
        rec["num_verify"],
        rec["num_tokens"],
        rec["decode_s"],
        " - best so far"
        if best
        else f" - best {tr.state.best_measured_accept_len:.3f} at step {tr.state.best_measured_step}",
    )
    return best


def note_measured(state: TrainerState, accept_len: float) -> bool:
    """Record a measurement of ``state.step``; True when it beats the best so far (ties keep the earlier step)."""
    state.measured_step = state.step
    if state.best_measured_accept_len is not None and accept_len <= state.best_measured_accept_len:
        state.measured_since_best += 1
        return False
    state.best_measured_step, state.best_measured_accept_len = state.step, float(accept_len)
    state.measured_since_best = 0
    return True


def patience_spent(tr: Training) -> bool:
    """True once train.measured.patience measurements in a row brought no new best (training stops there)."""
    patience = tr.cfg.train.measured.patience
    spent = enabled(tr.cfg) and patience > 0 and tr.state.measured_since_best >= patience
    if spent:
        log.warning(
            "train: stopping early at step %d of %d: %d measurements without a new best (best accept_len "
            "%.3f at step %s; train.measured.patience=%d)",
            tr.state.step,
            tr.total_steps,
            tr.state.measured_since_best,
            tr.state.best_measured_accept_len or 0.0,
            tr.state.best_measured_step,
            patience,
        )
    return spent


# ------------------------------------------------------------------------------------------------ manifest


def manifest_part(tr: Training) -> tuple[dict[str, Any], dict[str, Path]]:
    """(stats, outputs) the train manifest adds for the measurements, ({}, {}) while train.measured is off: the best
    one's step, acceptance and checkpoint (relative to <run>/train, its weights verified and hashed as
    ``best_measured_model``), every measurement's [step, accept_len], and whether patience stopped the run."""
    from eagle3.train.checkpoint import MODEL_FILE, verify_checkpoint
    from eagle3.train.metrics import read_metrics

    if not enabled(tr.cfg):
        return {}, {}
    state, train_dir = tr.state, tr.train_dir
    history = [[r["step"], r["accept_len"]] for r in read_metrics(tr.metrics.path, RECORD_TYPE)]
    stats: dict[str, Any] = {
        "best_measured_step": state.best_measured_step,
        "best_measured_accept_len": state.best_measured_accept_len,
        "best_measured_checkpoint": None,
        "measured_history": history,
        "stopped_early": state.step < tr.total_steps,
    }
    if state.best_measured_step is None:
        return stats, {}
    best = step_dir(checkpoints_dir(train_dir.parent), state.best_measured_step)
    verify_checkpoint(best, (MODEL_FILE,))  # the manifest hashes what is on disk: bless only what was written
    stats["best_measured_checkpoint"] = str(best.relative_to(train_dir))
    return stats, {"best_measured_model": best / MODEL_FILE}
