"""Assembling a training run from its directory: inputs, drafter, objective, optimizer, schedule, data plans.

Learning-rate scaling (``train.lr_scaling``): ``train.lr`` is the rate tuned for a global batch of
``train.reference_rows_per_step`` packed rows per optimizer step. A run whose global batch has
R = world_size x grad_accum_steps rows uses
    none    lr
    linear  lr * R / reference_rows_per_step     (the linear scaling rule of large-batch SGD)
    sqrt    lr * sqrt(R / reference_rows_per_step)   (the usual rule for Adam-type optimizers)
So moving from 1 GPU with 8 accumulation steps to 8 GPUs with 1 keeps the rate (same R), and moving
to 8 GPUs with 8 scales it by 8 (linear) or 2.83 (sqrt). Warmup and cosine decay are counted in
optimizer steps of the run as configured.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from eagle3.config import RunConfig, section_dict
from eagle3.config_base import key_fields
from eagle3.data.stages import tokenize, vocab
from eagle3.drafter.dflash_loss import DFlashObjective
from eagle3.drafter.model import DrafterDims, Eagle3Drafter, init_weights
from eagle3.drafter.ttt import StepOptions, TTTObjective
from eagle3.features import STAGE as CAPTURE
from eagle3.features.spec import FeatureSpec
from eagle3.refresh import warm_start
from eagle3.run.layout import manifest_name, run_layout
from eagle3.run.stage import MissingInputError
from eagle3.target.tensors import drafter_dims, load_target_lm_head, load_target_weights
from eagle3.train import STAGE
from eagle3.train.data import EpochPlan, plan_epoch, read_split
from eagle3.train.dflash import DFlashSetup, build_dflash_objective, dflash_setup
from eagle3.train.step import token_loss_for

log = logging.getLogger("eagle3.train")

# ----------------------------------------------------------------------------------------------- the inputs


@dataclass(frozen=True)
class RunInputs:
    """Paths and facts a training run reads, checked against each other."""

    run_dir: Path
    model_dir: Path
    features_dir: Path
    tokenized: Path
    spec: FeatureSpec
    d2t: Tensor  # [Vd] int64
    t2d: Tensor  # [V] bool
    dims: DrafterDims
    dflash: DFlashSetup | None = None  # drafter.family=dflash: the drafter it trains (dims above unused)


def read_inputs(cfg: RunConfig, model_dir: Path) -> RunInputs:
    """Vocab map, feature spec and drafter dims; refuses features captured from another target or layers.

    Online (``train.features: online``) the spec is the one capture would write for this config; it is saved
    as features/spec.json (no shards) so export and evaluation know what the drafter was trained on.
    """
    from eagle3.data.vocab import load_vocab_map
    from eagle3.target.load import fingerprint, target_info

    layout = run_layout(cfg)
    if cfg.train.features == "online":
        from eagle3.features.run_spec import build_spec

        spec = build_spec(cfg, model_dir)
    else:
        if not layout.spec.is_file():
            raise MissingInputError(
                f"train reads captured features (train.features=offline) and {layout.spec} does not exist: run the "
                "capture stage first (eagle3 stage capture), or set train.features=online"
            )
        spec = FeatureSpec.load(layout.spec)
    if not Path(layout.vocab).exists():
        raise MissingInputError(f"train needs the draft vocab map at {layout.vocab}: run the vocab stage first")
    d2t, t2d = load_vocab_map(layout.vocab)
    info = target_info(model_dir, cfg.target)
    if spec.target_fingerprint != fingerprint(model_dir):
        raise ValueError(
            f"features in {layout.features} come from target {spec.target_fingerprint}, "
            f"not from {model_dir} ({fingerprint(model_dir)}); capture again"
        )
    if spec.aux_layer_ids != info.aux_layer_ids or spec.hidden_size != info.hidden_size:
        raise ValueError(
            f"features hold aux layers {spec.aux_layer_ids} of width {spec.hidden_size}, the config "
            f"asks for {info.aux_layer_ids} of width {info.hidden_size}"
        )
    if len(t2d) != info.vocab_size:
        raise ValueError(f"vocab map covers {len(t2d)} target ids, the target has {info.vocab_size}")
    dims = drafter_dims(info, model_dir, draft_vocab_size=len(d2t))
    dflash = dflash_setup(cfg, model_dir, spec.aux_layer_ids) if cfg.drafter.family == "dflash" else None
    return RunInputs(layout.root, Path(model_dir), layout.features, layout.tokenized, spec, d2t, t2d, dims, dflash)


def stage_key_for(cfg: RunConfig, inputs: RunInputs) -> str:
    """The train stage key: drafter + train config (operational fields excluded), seed, input manifests.

    Offline the features' manifest stands for them; online the tokenized data's manifest, the spec (aux ids,
    supervision, storage dtypes) and the target dtype do: the features are computed from exactly those.
    """
    from eagle3.features.shards.layout import spec_hash
    from eagle3.run.stage import stage_key
    from eagle3.train import measured

    layout = run_layout(cfg)
    # key_fields: the family and the DFlash section are hashed once set (eagle3 runs keep their keys)
    conf = {"drafter": key_fields(cfg.drafter), "seed": cfg.run.seed, **section_dict(cfg, STAGE.name)}
    extra = {
        "target": inputs.spec.target_fingerprint,
        **warm_start.key_extra(cfg),  # {} without refresh.init_from
        **measured.key_extra(cfg),
    }  # {} while train.measured is off
    if cfg.train.features == "online":
        manifests = [layout.manifest(tokenize.STAGE), layout.manifest(vocab.STAGE)]
        extra |= {"spec": spec_hash(inputs.spec), "target_dtype": cfg.target.dtype}
    else:
        # the capture manifest beside the features the run reads (features_dir, which may be another run's)
        manifests = [inputs.features_dir / manifest_name(CAPTURE.name), layout.manifest(vocab.STAGE)]
    return stage_key(STAGE, conf, manifests, extra)


def key_for(cfg: RunConfig) -> str:
    """The train stage key of ``cfg`` (prepares the target and reads the run's inputs)."""
    from eagle3.target.load import prepare_target

    return stage_key_for(cfg, read_inputs(cfg, prepare_target(cfg)))


# ---------------------------------------------------------------------------------------- model, optimizer


def build_objective(
    cfg: RunConfig, inputs: RunInputs, device: torch.device, options: StepOptions | None = None
) -> TTTObjective | DFlashObjective:
    """The family's seeded drafter with the target's frozen embeddings (and lm_head rows if asked) inside its
    objective, on ``device``: EAGLE-3's TTT unroll, or DFlash's blocks (eagle3.train.dflash).

    The trainer passes the supervision (DFlash: the anchors) to forward precomputed: it needs each step's
    supervised-token count of the whole accumulation window (all ranks) before the first backward.
    """
    if inputs.dflash is not None:
        return build_dflash_objective(cfg, inputs.dflash, inputs.model_dir, device)
    drafter = Eagle3Drafter(inputs.dims)
    init_weights(drafter, std=cfg.drafter.init_std, seed=cfg.run.seed)
    load_target_weights(drafter, inputs.model_dir, inputs.t2d, cfg.drafter.init_lm_head_from_target)
    init_from = warm_start.init_dir(cfg)
    if init_from is not None:  # a refresh fine-tunes the promoted drafter (eagle3.refresh.warm_start)
        warm_start.load_init(drafter, init_from, inputs.t2d)
    lm_head = load_target_lm_head(inputs.model_dir) if inputs.spec.supervision == "final_hidden" else None
    if lm_head is not None and device.type == "cuda":
        lm_head = lm_head.to(torch.bfloat16)  # frozen and only read under autocast: bf16 halves its memory
    return ttt_objective(cfg, drafter, inputs.t2d, inputs.d2t, lm_head, options).to(device)


def ttt_objective(
    cfg: RunConfig,
    drafter: Eagle3Drafter,
    t2d: Tensor,
    d2t: Tensor,
    lm_head: Tensor | None,
    options: StepOptions | None = None,
) -> TTTObjective:
    """EAGLE-3's objective over ``drafter`` as the run's settings make it (TTT steps, step decay, attention, token
    loss): what build_objective trains, and what a benchmark that builds its drafter otherwise (random weights over
    a target that exists only in memory) times. ``lm_head``: the target's frozen lm_head for final_hidden
    supervision, else None."""
    return TTTObjective(
        drafter,
        t2d,
        d2t,
        lm_head,
        cfg.drafter.ttt_steps,
        cfg.drafter.step_decay,
        cfg.drafter.attn_impl,
        options=options,
        loss=token_loss_for(cfg.train),
    )


def scaled_lr(lr: float, rule: str, rows_per_step: int, reference_rows: int) -> float:
    """The peak rate after the scaling rule of the module docstring."""
    ratio = rows_per_step / reference_rows
    return {"none": lr, "linear": lr * ratio, "sqrt": lr * math.sqrt(ratio)}[rule]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only; norms (1-D) are not decayed. Frozen parameters stay out."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_optimizer(cfg: RunConfig, model: nn.Module, lr: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (fused kernel on CUDA)."""
    t = cfg.train
    return torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=lr, betas=t.adam_betas, eps=t.adam_eps, fused=device.type == "cuda"
    )


@dataclass
class WarmupCosine:
    """LR factor at optimizer step s: linear warmup to 1 over ``warmup`` steps, then cosine to ``min_ratio``."""

    total_steps: int
    warmup_steps: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_steps_for(cfg: RunConfig, total_steps: int) -> int:
    """train.warmup_steps when set, else round(warmup_ratio x total steps)."""
    if cfg.train.warmup_steps is not None:
        return min(cfg.train.warmup_steps, total_steps)
    return round(cfg.train.warmup_ratio * total_steps)


def build_scheduler(
    cfg: RunConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine as a LambdaLR (its state, the step count, goes into checkpoints)."""
    factor = WarmupCosine(total_steps, warmup_steps_for(cfg, total_steps), cfg.train.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class DataPlan:
    """Every epoch's train plan (lengths only, so total steps are known up front) and the val plan."""

    train: list[EpochPlan]
    val: EpochPlan
    rows_per_step: int  # world_size x grad_accum_steps

    def steps_in(self, epoch: int) -> int:
        """Optimizer steps in one epoch."""
        return len(self.train[epoch].rows) // self.rows_per_step

    @property
    def total_steps(self) -> int:
        """Optimizer steps over all epochs."""
        return sum(self.steps_in(e) for e in range(len(self.train)))


def plan_data(cfg: RunConfig, inputs: RunInputs, world_size: int) -> DataPlan:
    """Pack every epoch of the train split and the val split (val padded to equal counts per rank)."""
    from eagle3.features.shards.reader import ShardReader
    from eagle3.train.data import check_captured

    train, val = read_split(inputs.tokenized, "train"), read_split(inputs.tokenized, "val")
    if cfg.train.features == "offline":
        reader = ShardReader(inputs.features_dir)
        check_captured(train, reader, "train")
        check_captured(val, reader, "val")
    if not train:
        raise ValueError(f"{inputs.tokenized} has no train rows")
    t = cfg.train
    if t.max_train_tokens is not None:
        train = first_tokens(train, t.max_train_tokens, inputs.tokenized)
    rows_per_step = world_size * t.grad_accum_steps
    epochs = [
        plan_epoch(train, t.tokens_per_row, e, cfg.run.seed, rows_per_step, shuffle=True) for e in range(t.num_epochs)
    ]
    val_plan = plan_epoch(val, t.tokens_per_row, 0, cfg.run.seed, world_size, shuffle=False)
    return DataPlan(epochs, val_plan, rows_per_step)


def first_tokens(samples: list[tuple[str, int]], budget: int, source: Path) -> list[tuple[str, int]]:
    """The longest prefix of ``samples`` (file order) holding at most ``budget`` tokens.

    File order is the merge's seeded shuffle, so a smaller budget takes a subset of a larger one's rows (the
    points of a data-scaling curve are nested). A split with fewer tokens than the budget is an error: the
    curve point would be labelled with more data than it trained on.
    """
    total = sum(n for _, n in samples)
    if total < budget:
        raise ValueError(
            f"train.max_train_tokens is {budget:,} but the train split of {source} holds only "
            f"{total:,} tokens ({len(samples)} rows); generate more data or lower the budget"
        )
    kept, used = [], 0
    for sample in samples:
        if used + sample[1] > budget:
            break
        kept.append(sample)
        used += sample[1]
    if not kept:
        raise ValueError(
            f"train.max_train_tokens {budget:,} is below the first train row of {source} ({samples[0][1]:,} tokens)"
        )
    return kept


def total_steps_for(cfg: RunConfig, plan: DataPlan) -> int:
    """Steps of all epochs, capped by train.max_steps."""
    total = plan.total_steps
    return min(total, cfg.train.max_steps) if cfg.train.max_steps else total


def unigram_token(inputs: RunInputs) -> tuple[int, float]:
    """(most frequent supervised train token, its share of supervised train tokens): the unigram baseline."""
    from eagle3.data.vocab import count_train_tokens

    counts, _ = count_train_tokens(inputs.tokenized, len(inputs.t2d))
    top = int(counts.argmax())
    return top, float(counts[top]) / max(int(counts.sum()), 1)
