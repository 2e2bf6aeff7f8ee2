"""Full-state checkpoints under <run>/train/checkpoints/step-N/, written atomically, resumed automatically.

A checkpoint directory holds
    model.safetensors   trainable drafter weights, full (unsharded) fp32, SGLang names (fc.weight, midlayer.*,
                        norm.weight, lm_head.weight); the frozen embeddings are the target's and stay out
    optimizer.pt        AdamW state keyed by parameter name (loads into DDP, FSDP2 or a plain module)
    trainer.pt          LR scheduler state, every rank's RNG states (python, torch, cuda)
    config.json         the resolved run config it was trained with
    checkpoint.json     step, sampler position, tokens seen, world layout, stage key, metrics, the best
                        validation so far (best_step, best_accept_len_est), and the size and sha256 of every
                        other file (hashed as it is written); written last
Rank 0 writes everything into ``.step-N.tmp-<pid>/``, fsyncs each file and the directory, then renames it
to ``step-N``: a directory named step-N is complete by construction (a crash leaves only a temp dir,
removed at the next save). It is intact while every file has its recorded size and sha256 (``verify_checkpoint``):
resuming, selecting the best checkpoint and exporting check that first, so a bit flipped on disk is refused
(``CorruptCheckpointError`` naming the file), never trained on or shipped; resuming falls back to the newest
intact checkpoint and moves the damaged one aside as ``step-N.corrupt``. Only the newest ``keep`` checkpoints are
kept, and the best ones (``best_step`` and ``best_measured_step`` of the state being saved), which the export ships
when train.select is best or measured.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save
from torch import nn

from eagle3.run.layout import RunLayout
from eagle3.train.dist import DistInfo, all_gather_objects, barrier
from infra.storage import publish_dir, seal_dir

log = logging.getLogger("eagle3.train")

CHECKPOINT_RE = re.compile(r"^step-(\d+)$")
MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE = "model.safetensors", "optimizer.pt", "trainer.pt"
CONFIG_FILE, INFO_FILE = "config.json", "checkpoint.json"
DRAFTER_PREFIX = "drafter."
"""The objective holds the drafter under this name; checkpoint weight names drop it (SGLang names)."""


@dataclass
class TrainerState:
    """Where training stands: optimizer steps done and the sampler position (epoch, rows done)."""

    step: int = 0
    epoch: int = 0
    epoch_rows_done: int = 0  # rows of this epoch's global plan already trained on (a multiple of W * A)
    tokens_seen: int = 0  # real tokens, all ranks
    best_step: int | None = None  # the step of the highest validation accept_len_est so far (it has a checkpoint)
    best_accept_len_est: float | None = None
    # train.measured (eagle3.train.measured): the last measured step, the best measured one (it has a checkpoint),
    # and measurements since that best (train.measured.patience stops training at this many)
    measured_step: int | None = None
    best_measured_step: int | None = None
    best_measured_accept_len: float | None = None
    measured_since_best: int = 0

    def rank_index(self, world_size: int) -> int:
        """Index of the next row in a rank's list (rank r takes plan rows r, r + W, ...)."""
        return self.epoch_rows_done // world_size


class CheckpointMismatchError(ValueError):
    """The checkpoint was written by a run that this one cannot continue (other config or batch layout)."""


class CorruptCheckpointError(ValueError):
    """A checkpoint file no longer has the size or sha256 that checkpoint.json recorded when it was written."""


def checkpoints_dir(run_dir: Path) -> Path:
    """<run>/train/checkpoints."""
    return RunLayout(Path(run_dir)).checkpoints


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    if not Path(ckpt_dir).is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in Path(ckpt_dir).iterdir()
        if (m := CHECKPOINT_RE.match(p.name)) and (p / INFO_FILE).is_file()
    ]
    return sorted(found)


def step_dir(ckpt_dir: Path, step: int) -> Path:
    """<checkpoints>/step-N: where the checkpoint of step N lives."""
    return Path(ckpt_dir) / f"step-{step}"


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


# ------------------------------------------------------------------------------------------------------ RNG


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (python, torch CPU, and every CUDA device once CUDA is initialised)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what capture_rng took."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------- state dicts


def _options(**kw: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen parameters (the target embeddings) are reloaded from the target, never saved.
    return StateDictOptions(full_state_dict=True, ignore_frozen_params=True, **kw)


def gather_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full model and optimizer state dicts keyed by name; a collective under FSDP (rank 0 gets them)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, [optimizer], options=_options(cpu_offload=True))


def to_export_names(model_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """'drafter.fc.weight' -> 'fc.weight' (contiguous CPU tensors, as safetensors wants)."""
    return {k.removeprefix(DRAFTER_PREFIX): v.detach().cpu().contiguous() for k, v in model_sd.items()}


def from_export_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of to_export_names."""
    return {DRAFTER_PREFIX + k: v for k, v in weights.items()}


# ------------------------------------------------------------------------------------------------- writing


class _HashingWriter:
    """A binary file that hashes what is written to it (torch.save writes through it: no second read)."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.sha256 = fh, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def _write_hashed(path: Path, write: Any) -> str:
    """Call ``write(file)`` on a new file at ``path``; the sha256 of what it wrote."""
    with open(path, "wb") as fh:
        writer = _HashingWriter(fh)
        write(writer)
    return writer.sha256.hexdigest()


def _write_files(
    tmp: Path, model_sd: dict, optim_sd: dict, trainer: dict, config_json: str, info: dict[str, Any]
) -> None:
    """Every file of a checkpoint into ``tmp``, fsynced, each hashed as written; checkpoint.json last."""
    hashes = {
        MODEL_FILE: _write_hashed(tmp / MODEL_FILE, lambda f: f.write(save(to_export_names(model_sd)))),
        OPTIMIZER_FILE: _write_hashed(tmp / OPTIMIZER_FILE, lambda f: torch.save(optim_sd, f)),
        TRAINER_FILE: _write_hashed(tmp / TRAINER_FILE, lambda f: torch.save(trainer, f)),
        CONFIG_FILE: _write_hashed(tmp / CONFIG_FILE, lambda f: f.write(config_json.encode())),
    }
    info = {
        **info,
        "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir())},
        "sha256": hashes,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    seal_dir(tmp)


def prune(ckpt_dir: Path, keep: int, protect: int | Iterable[int | None] | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (and the step or steps ``protect``) and any temp dir left by a
    crash; returns what went."""
    kept = {protect} if protect is None or isinstance(protect, int) else set(protect)
    old = list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []
    removed = [p for step, p in old if step not in kept]
    removed += [p for p in Path(ckpt_dir).glob(".step-*") if p.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def save_checkpoint(
    ckpt_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainerState,
    config_json: str,
    info: dict[str, Any],
    dist_info: DistInfo,
    keep: int,
) -> Path:
    """Collect the full state on every rank (collectives), write it atomically on rank 0, prune; all ranks
    return once step-N exists."""
    model_sd, optim_sd = gather_state(model, optimizer)
    rngs = all_gather_objects(capture_rng(), dist_info)
    final = step_dir(ckpt_dir, state.step)
    if dist_info.is_main:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(ckpt_dir) / f".step-{state.step}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        trainer = {"scheduler": scheduler.state_dict(), "rng": rngs, "state": asdict(state)}
        _write_files(
            tmp, model_sd, optim_sd, trainer, config_json, {**info, **asdict(state), "world_size": dist_info.world_size}
        )
        publish_dir(tmp, final)
        prune(ckpt_dir, keep, protect=(state.best_step, state.best_measured_step))
    barrier(dist_info)
    return final


# ------------------------------------------------------------------------------------------------- reading


def read_info(path: Path) -> dict[str, Any]:
    """checkpoint.json of a checkpoint directory."""
    return json.loads((Path(path) / INFO_FILE).read_text())


def checkpoint_problem(path: Path, names: tuple[str, ...] | None = None) -> str | None:
    """Why checkpoint ``path`` is not intact (its files, or only ``names``, against the sizes and sha256 that
    checkpoint.json recorded as they were written), or None. A checkpoint written before hashes were recorded
    is checked by size only (logged)."""
    from infra.storage import sha256_file_cached

    path = Path(path)
    try:
        info = read_info(path)
        sizes, hashes = dict(info["files"]), info.get("sha256")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path / INFO_FILE} cannot be read ({type(exc).__name__}: {exc})"
    if hashes is None:
        log.warning(
            "train: %s records no sha256 of its files (written by an older version): checked by size only", path
        )
    for name in names if names is not None else [n for n in sorted(sizes) if n != INFO_FILE]:
        file = path / name
        if name not in sizes or (hashes is not None and name not in hashes):
            return f"{path / INFO_FILE} records no {name}"
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != sizes[name]:
            return f"{file} has {file.stat().st_size} bytes where {INFO_FILE} recorded {sizes[name]}"
        if hashes is not None and (digest := sha256_file_cached(file)) != hashes[name]:
            return (
                f"{file} has sha256 {digest[:16]}..., not the {hashes[name][:16]}... recorded in {INFO_FILE} "
                f"when it was written (changed or corrupted on disk)"
            )
    return None


def verify_checkpoint(path: Path, names: tuple[str, ...] | None = None) -> None:
    """CorruptCheckpointError naming the file unless checkpoint ``path`` is intact (``checkpoint_problem``)."""
    problem = checkpoint_problem(path, names)
    if problem:
        raise CorruptCheckpointError(f"checkpoint {Path(path).name} is damaged: {problem}")


def latest_intact_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint that passes verify_checkpoint (None when there is none at all). Damaged newer ones
    are renamed to ``step-N.corrupt`` (kept to inspect, never listed); when every checkpoint is damaged,
    CorruptCheckpointError names the newest one's problem and nothing is moved (training from scratch over
    them is the user's call)."""
    found = list_checkpoints(ckpt_dir)
    damaged: list[tuple[Path, str]] = []
    for _, path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            for bad, _ in damaged:
                aside = bad.with_name(f"{bad.name}.corrupt")
                shutil.rmtree(aside, ignore_errors=True)
                os.rename(bad, aside)
            return path
        log.warning("train: checkpoint %s is damaged (%s); trying the one before it", path.name, problem)
        damaged.append((path, problem))
    if damaged:
        newest, problem = damaged[0]
        raise CorruptCheckpointError(
            f"no intact checkpoint in {ckpt_dir}: checkpoint {newest.name} is damaged: "
            f"{problem}; delete {ckpt_dir} to train from scratch"
        )
    return None


def check_compatible(info: dict[str, Any], stage_key: str, rows_per_step: int) -> None:
    """Refuse a checkpoint of another config, or of another global batch layout (the plan would differ)."""
    if info.get("stage_key") != stage_key:
        raise CheckpointMismatchError(
            f"checkpoint step-{info.get('step')} was written for another drafter/train config or other inputs; "
            f"delete its checkpoints directory to train from scratch, or use another run.name"
        )
    if info.get("rows_per_step") != rows_per_step:
        raise CheckpointMismatchError(
            f"checkpoint step-{info.get('step')} trained with {info.get('rows_per_step')} rows per optimizer step "
            f"(world_size x grad_accum_steps), this run has {rows_per_step}; resume with the same product"
        )


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, dist_info: DistInfo
) -> TrainerState:
    """Restore weights, optimizer, scheduler and this rank's RNG (each rank reads the files itself)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    weights: dict[str, Any] = from_export_names(load_file(str(path / MODEL_FILE)))  # (what set_state_dict takes)
    expected = {k for k, p in _named_trainable(model)}
    if set(weights) != expected:
        raise CheckpointMismatchError(
            f"{path / MODEL_FILE} holds {sorted(set(weights) ^ expected)[:5]} "
            f"beyond/short of the drafter's trainable weights"
        )
    optim_sd = torch.load(path / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
    set_state_dict(
        model, [optimizer], model_state_dict=weights, optim_state_dict=optim_sd, options=_options(strict=False)
    )
    for group in optimizer.param_groups:  # the state-dict round trip turns the betas tuple into a list
        group["betas"] = tuple(group["betas"])
    trainer = torch.load(path / TRAINER_FILE, weights_only=True, map_location="cpu")
    scheduler.load_state_dict(trainer["scheduler"])
    if dist_info.rank < len(trainer["rng"]):
        restore_rng(trainer["rng"][dist_info.rank])
    return TrainerState(**trainer["state"])


def _named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of trainable parameters, names as state-dict APIs give them (no DDP prefix)."""
    from eagle3.train.dist import unwrap

    return [(n, p) for n, p in unwrap(model).named_parameters() if p.requires_grad]
