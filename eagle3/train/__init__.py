"""Drafter training: packing loader, TTT loop, checkpoints, DDP/FSDP2. The torchrun entry point is __main__.

    python -m eagle3.train --config runs/tiny/config.json                       # one process (CPU or 1 GPU)
    python -m torch.distributed.run --standalone --nproc-per-node=8 -m eagle3.train --config <run>/config.json

Modules: data (plan, pack, collate, noise, prefetch), build (inputs, model, optimizer, schedule, LR scaling),
loop (steps, validation, signals, the stage), checkpoint (atomic full state, resume), dist (process group,
wrappers, collectives), metrics (FLOPs/MFU, metrics.jsonl, progress.json).
"""

from eagle3.run.layout import TRAIN_DIR
from eagle3.run.stage import StageId

STAGE = StageId("train", TRAIN_DIR)
"""The train stage in the run directory: train/train.manifest.json (the stage module is eagle3.train.stage)."""
